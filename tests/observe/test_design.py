"""The 2 x 2 judgement from committed data files: effects against brute force, verdicts, F4."""

import json
import math

import numpy as np
import pytest

from mixrl.lab.study import design, paired, studydata, studyrun

TASKS = [f"t{i}" for i in range(12)]


def _pk(n, c, k):
    return 1.0 - math.comb(n - c, k) / math.comb(n, k) if n - c >= k else 1.0


def _counts(rng, p):
    return {t: [16, int(rng.binomial(16, min(1.0, max(0.0, p + 0.02 * i))))] for i, t in enumerate(TASKS)}


def _write(out, name, per_task, rows, fp32=None, base=None):
    f = out / "data" / (name + ".json")
    f.parent.mkdir(parents=True, exist_ok=True)
    cols = {"step": [r["step"] for r in rows]}
    for k in sorted({k for r in rows for k in r} - {"step"}):
        cols[k] = [r.get(k) for r in rows]
    f.write_text(json.dumps({"run": {"name": name, "mode": "sync", "preset": name.split("/")[1], "seed": 0,
                                     "steps": len(rows), "wall_s": 50.0, "update_s": 1.5},
                             "eval": {"k": 4, "final": per_task, "base": base or {}},
                             "steps": cols, "fp32": fp32 or {}}))


def _rows(reward, n=30, collapse_at=None, groups=None):
    out = []
    for i in range(1, n + 1):
        bad = collapse_at is not None and i >= collapse_at
        r = {"step": i, "rollout/reward": 0.1 if bad else reward, "precision/kl_k3": 1.0 if bad else 1e-3}
        for g, (kl, share, oob) in (groups or {}).items():
            r.update({f"precision/kl_k3/{g}": kl, f"share/samples/{g}": share, f"precision/tokens/{g}": 100.0,
                      f"precision/ratio_oob/{g}": oob})
        out.append(r)
    return out


P = {"reference/on-policy": 0.40, "mixed-sync/grpo": 0.08, "mixed-sync/sc+mis+top-p": 0.30,
     "mixed-async/grpo": 0.04, "mixed-async/sc+mis+top-p": 0.28}


@pytest.fixture
def study(tmp_path):
    rng = np.random.default_rng(0)
    tables = {}
    groups = {"a": (0.08, 0.4, 0.05), "b": (0.01, 0.2, 0.001), "c": (0.004, 0.4, 0.0)}
    for cell, p in P.items():
        for s in range(3):
            tables[(cell, s)] = _counts(rng, p)
            collapse = 12 if cell == "mixed-sync/grpo" and s < 2 else None
            _write(tmp_path, f"{cell}/seed{s}", tables[(cell, s)], _rows(0.6, collapse_at=collapse, groups=groups),
                   fp32={"0": {"mean_reward": 0.05}, "150": {"mean_reward": p + 0.01 * s}})
    return tmp_path, tables


def test_effects_equal_brute_force(study):
    out, tables = study
    res = design.judge(studydata.load(out), {"monitor": {"warmup_steps": 3, "early_steps": 5}})
    eff = res["fleets"]["mixed"]["effects"]

    def d(plus, minus, k=1):
        return [np.mean([sum(_pk(*tables[(c, s)][t], k) for c in plus) - sum(_pk(*tables[(c, s)][t], k) for c in minus)
                         for t in TASKS]) for s in range(3)]

    plus, minus = ["mixed-async/sc+mis+top-p", "mixed-sync/grpo"], ["mixed-sync/sc+mis+top-p", "mixed-async/grpo"]
    for k, got in ((1, eff["interaction"]["t"]), (4, eff["interaction"]["secondary"]["t"])):
        ref = paired.paired_t(d(plus, minus, k))
        assert (got["estimate"], got["lo"], got["hi"]) == pytest.approx((ref.estimate, ref.lo, ref.hi), abs=1e-12)
    assert res["k"] == 1 and res["k_secondary"] == 4  # pass@1 primary, pass@k secondary
    lag = d(["mixed-async/grpo"], ["mixed-sync/grpo"])
    assert eff["lag G"]["t"]["estimate"] == pytest.approx(np.mean(lag), abs=1e-12)
    assert eff["lag G"]["d_seed"] == pytest.approx(lag, abs=1e-12)
    assert eff["lag G"]["boot"]["method"] == paired.BOOT_METHOD and eff["lag G"]["tasks"] == len(TASKS)
    # the contrast's p is the paired t's over the per-seed differences
    tstat = np.mean(lag) / (np.std(lag, ddof=1) / math.sqrt(3))
    from scipy import stats as sps

    assert eff["lag G"]["p"] == pytest.approx(2 * sps.t.sf(abs(tstat), 2), rel=1e-9)
    # FP32-sampler reward of the last scored checkpoint, paired over seeds
    assert eff["precision G"]["reward_fp32"]["estimate"] == pytest.approx(0.08 - 0.40, abs=1e-12)


def test_verdicts(study):
    out, _ = study
    res = design.judge(studydata.load(out), {"monitor": {"warmup_steps": 3, "early_steps": 5}, "f3_margin": 0.05})
    m = res["fleets"]["mixed"]
    assert m["collapsed"]["mixed-sync/grpo"] == "2/3" and m["collapsed"]["mixed-sync/sc+mis+top-p"] == "0/3"
    assert m["F1"] == "reproduced"  # 0.08 vs 0.40 on every seed, 2 of 3 seeds collapsed
    assert m["F2"] == "reproduced"
    assert res["F3"]["verdict"] == "not run"  # no homogeneous cells
    # Holm over the family that ran: mixed F1 and F2 (no F3 without homogeneous cells)
    p = res["holm"]["p"]
    assert sorted(res["holm"]["family"]) == ["mixed: F1", "mixed: F2"]
    lo, hi = sorted(p.values())
    adj = res["holm"]["p_holm"]
    assert sorted(adj.values()) == pytest.approx([min(1, 2 * lo), max(min(1, 2 * lo), hi)])
    # Fisher's exact test of the collapse counts: 2/3 against 0/3 on-policy
    f = m["fisher"]["G sync vs on-policy"]
    assert f["collapsed"] == [2, 0] and f["p"] == pytest.approx(0.4, abs=1e-12)
    for e in m["effects"].values():  # each effect carries the verdict its two intervals give
        ivs = (e["t"], e["boot"])
        want = ("lower" if all(i["hi"] < 0 for i in ivs) else "higher" if all(i["lo"] > 0 for i in ivs)
                else "not distinguishable")
        assert e["verdict"] == want
    assert m["effects"]["precision G"]["verdict"] == "lower"  # 0.08 vs 0.40 on every seed
    # F4: 6 sync runs, groups' oob counts rise with their precision KL (a > b > c)
    assert m["F4"]["runs_increasing"] == [6, 6] and m["F4"]["verdict"] == "reproduced"
    text = design.markdown(res)
    assert "interaction" in text and paired.T_METHOD in text and "F1" in text and "Holm" in text


def test_a_collapse_seen_only_by_the_fp32_sampler_or_held_out_counts(study):
    out, _ = study
    runs = studydata.load(out)
    r = next(x for x in runs if x.name == "mixed-sync/sc+mis+top-p/seed0")
    r.config["fp32"] = {"0": {"mean_reward": 0.6}, "100": {"mean_reward": 0.7}, "150": {"mean_reward": 0.54}}
    assert design.outcome.reasons(r, {}, {}, 0.6) == ["fp32"]  # 0.70 -> 0.54: a drop of 0.16 >= 0.15
    r.config["fp32"]["150"] = {"mean_reward": 0.56}
    assert design.outcome.reasons(r, {}, {}, 0.6) == []  # 0.14 < 0.15
    base = {t: [16, 16] for t in TASKS}  # the base solved everything: the final policy fell
    assert design.outcome.reasons(r, {}, base, 0.6) == ["held-out"]


def test_a_sync_only_study_reports_only_what_it_ran(study):
    """The real model's study runs the sync cells and the reference only: no lag, async or
    interaction row (their cells were not run), and the precision and correction rows stay."""
    out, _ = study
    runs = [r for r in studydata.load(out) if "-async" not in r.fleet]
    m = design.judge(runs, {"monitor": {"warmup_steps": 3, "early_steps": 5}})["fleets"]["mixed"]
    assert sorted(m["effects"]) == ["correction sync", "precision C", "precision G"]
    assert m["effects"]["precision G"]["verdict"] == "lower" and m["F2"] == "reproduced"
    assert "lag G" not in design.markdown(design.judge(runs, {}))


def test_f4_count_test(tmp_path):
    for s in range(3):
        _write(tmp_path, f"stress-sync/grpo/seed{s}", {"t0": [4, 1], "t1": [4, 2]},
               _rows(0.3, groups={"a": (0.1, 0.5, 0.04), "b": (0.01, 0.3, 0.01), "c": (0.001, 0.2, 0.001)}))
    runs = studydata.load(tmp_path)
    res = design.f4(runs)
    # counts pooled over 3 runs x 30 steps x 100 tokens; groups in KL order c < b < a
    n = 3 * 30 * 100
    x = np.array([0.001, 0.01, 0.04]) * n
    assert [res["groups"][g]["oob"] for g in res["order"]] == pytest.approx(list(x))
    # brute force: z = sqrt(N) r, r the Pearson correlation of score and outcome over every token
    score = np.repeat([0.0, 1.0, 2.0], n)
    y = np.concatenate([np.r_[np.ones(int(round(v))), np.zeros(n - int(round(v)))] for v in x])
    assert res["z"] == pytest.approx(math.sqrt(3 * n) * np.corrcoef(score, y)[0, 1], rel=1e-9)
    assert res["runs_increasing"] == [3, 3] and res["p_sign"] == pytest.approx(1 / 8)
    assert res["verdict"] == "not distinguishable"  # 3 runs cannot pass a sign test at 0.05
    for r in runs:
        for row in r.rows:
            for g in "abc":
                row[f"precision/ratio_oob/{g}"] = 0.0
    assert design.f4(runs)["verdict"].startswith("untestable (no staleness-0")
    assert design.f4([])["verdict"].startswith("untestable (fewer than 2 groups")


def test_recompute_writes_tables(study, capsys):
    out, _ = study
    assert design.main(out, {}) == 0
    assert (out / "design.md").exists() and json.loads((out / "design.json").read_text())["k"] == 1
    assert "## mixed" in capsys.readouterr().out
    assert design.main(out / "empty", {}) == 2


def test_data_file_round_trip(tmp_path):
    run = tmp_path / "mixed-sync" / "grpo" / "seed0"
    run.mkdir(parents=True)
    rows = [{"step": i, "time": 100.0 + 1.5 * i, "rollout/reward": 0.123456 * i, "precision/kl_k3/g": 1e-3,
             "share/samples/g": 1.0, "other/unkept": 5} for i in range(1, 6)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "eval.json").write_text(json.dumps({"k": 4, "final": {"per_task": {"t0": [16, 3]}, "pass@4": 0.6},
                                               "base": {"per_task": {"t0": [16, 1]}}}))
    (run / "config.json").write_text(json.dumps({"runtime": {"mode": "sync", "seed": 7}, "loss": {"preset": "grpo"}}))
    f = studydata.export(tmp_path, run, {"5": {"mean_reward": 0.5}}, wall_s=20.0)
    assert f == tmp_path / "data" / "mixed-sync" / "grpo" / "seed0.json"
    back = studydata.load(tmp_path)[0]
    assert back.name == "mixed-sync/grpo/seed0" and back.cell == "mixed-sync/grpo" and back.seed == "seed0"
    assert back.eval["per_task"] == {"t0": [16, 3]} and back.base["per_task"] == {"t0": [16, 1]}
    assert [r["rollout/reward"] for r in back.rows] == [float(f"{0.123456 * i:.4g}") for i in range(1, 6)]
    assert "other/unkept" not in back.rows[0] and back.rows[0]["precision/kl_k3/g"] == 1e-3
    d = json.loads(f.read_text())["run"]
    assert d["update_s"] == 1.5 and d["mode"] == "sync" and d["steps"] == 5


def test_projection_from_measured_runs(tmp_path):
    done = tmp_path / "mixed-sync" / "grpo" / "seed0"
    done.mkdir(parents=True)
    (done / "summary.json").write_text(json.dumps({"interrupted": False}))
    _write(tmp_path, "mixed-sync/grpo/seed0", {"t0": [4, 1]}, _rows(0.3, n=10))  # update_s 1.5, wall 50
    todo = [tmp_path / "mixed-sync" / "grpo" / "seed1", tmp_path / "mixed-async" / "grpo" / "seed0"]
    p = studyrun.projection(tmp_path, [done, *todo], steps=100, jobs=2)
    assert [r["status"] for r in p["runs"]] == ["done", "todo", "todo"]
    fixed = 50.0 - 10 * 1.5
    assert p["runs"][1]["projected_s"] == pytest.approx(100 * 1.5 + fixed)
    assert p["runs"][2]["measured"].startswith("assumed")  # an unmeasured kind: the slowest measured
    assert p["wall_s"] == pytest.approx(2 * (100 * 1.5 + fixed) / 2)


def test_stop_after_starts_nothing_late(tmp_path, capsys):
    runs = [tmp_path / "mixed-sync" / "grpo" / f"seed{s}" for s in range(3)]
    assert studyrun.execute(tmp_path, runs, jobs=1, fp32={"enabled": False}, stop_after_min=-1) == []
    out = capsys.readouterr().out
    assert out.count("not started (--stop-after)") == 3 and not (tmp_path / "data").exists()


def test_fp32_score_runs_the_real_evaluation(tmp_path):
    """One common FP32 sampler, the run's own environment: ``mixrl eval`` in a subprocess."""
    import mixrl.config as runcfg
    from mixrl.lab.study.compare import default_config_path

    cfg = runcfg.load_config(default_config_path().with_name("demo.toml"))
    (tmp_path / "config.toml").write_text(runcfg.to_toml(cfg) + "\n")
    res = studydata.fp32_score("bundled", tmp_path, n_tasks=2, n=2, seed=5)
    assert res["profile"] == "fp32" and 0.0 <= res["mean_reward"] <= 1.0, res
    assert len(res["per_task"]) == 2 and all(v[0] == 2 for v in res["per_task"].values())
    assert "error" in studydata.fp32_score(tmp_path / "no-such-model", tmp_path, 2, 2, 5)
    nucleus = studydata.fp32_score("bundled", tmp_path, n_tasks=2, n=2, seed=5, top_p=0.9)  # the ablation's scoring
    assert set(nucleus["per_task"]) == set(res["per_task"]) and 0.0 <= nucleus["pass@1"] <= 1.0


def test_projection_scales_the_calibration_by_the_runs(tmp_path):
    """A kind measured only by the calibration is projected at its calibration times the median
    ratio finished runs / their calibration."""
    cal = tmp_path / "calibration"
    for kind, per in (("mixed-sync/grpo", 1.0), ("stress-sync/grpo", 2.0)):
        _write(cal, f"{kind}/seed0", {"t0": [4, 1]}, _rows(0.3, n=3))
        f = cal / "data" / kind / "seed0.json"
        d = json.loads(f.read_text())
        d["run"].update(update_s=per, wall_s=3 * per + 10.0)
        f.write_text(json.dumps(d))
    _write(tmp_path, "mixed-sync/grpo/seed0", {"t0": [4, 1]}, _rows(0.3, n=10))  # 1.5 s/update, wall 50
    m = studyrun.measured(tmp_path)
    assert m["mixed-sync/grpo"] == {"update_s": 1.5, "fixed_s": 50.0 - 15.0, "source": "runs"}
    assert m["stress-sync/grpo"]["update_s"] == pytest.approx(2.0 * 1.5)
    assert m["stress-sync/grpo"]["fixed_s"] == pytest.approx(10.0 * 35.0 / 10.0)
    assert m["stress-sync/grpo"]["source"].startswith("calibration x 1.50")
