"""``mixrl compare`` end to end on a tiny 2 x 2 plan: real ``mixrl train`` runs, the data files,
the report with the study's section, ``--resume`` and ``--recompute``."""

import argparse
import json

import pytest

from mixrl.lab.study import compare


def _args(*argv):
    p = argparse.ArgumentParser()
    compare.configure(p)
    return p.parse_args(list(argv))


@pytest.mark.slow  # 6 real runs: ~2 CPU-minutes
def test_tiny_study_produces_the_report(tmp_path, capsys):
    # the bundled compare.toml, FP32 scoring shrunk to 2 tasks x 2 samples
    text = compare.default_config_path().read_text()
    assert "\nn_tasks = 16\nn = 8\n" in text
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(text.replace("\nn_tasks = 16\nn = 8\n", "\nn_tasks = 2\nn = 2\n"))
    out = tmp_path / "study"
    common = ["--set", "rollout.prompts_per_step=4", "--set", "rollout.group_size=4"]
    rc = compare.main(_args(str(cfg), "--fleets", "stress", "--arms", "grpo,on-policy", "--modes", "sync,async",
                            "--seeds", "2", "--steps", "2", "--eval-tasks", "4", "--eval-n", "5", "--jobs", "2",
                            "--out", str(out), *common))
    assert rc == 0, capsys.readouterr().out
    cells = ("stress-sync/grpo", "stress-async/grpo", "reference/on-policy")
    for cell in cells:
        for s in range(2):
            d = json.loads((out / "data" / cell / f"seed{s}.json").read_text())
            assert d["run"]["steps"] == 2 and len(d["eval"]["final"]) == 4
            assert d["fp32"]["2"]["mean_reward"] >= 0 and "rollout/staleness_mean" in d["steps"]
    res = json.loads((out / "design.json").read_text())
    eff = res["fleets"]["stress"]["effects"]
    for name in ("precision G", "lag G"):  # both intervals over the 2 paired seeds
        assert eff[name]["t"]["seeds"] == 2 and eff[name]["boot"]["tasks"] == 4
    report = (out / "report.md").read_text()
    assert "## The 2 x 2 study" in report and "| lag G |" in report and "(figures/study_stress.png)" in report
    assert (out / "figures" / "study_stress.png").exists() and (out / "report.html").exists()
    # a second sitting: every run is done, nothing trains again
    capsys.readouterr()
    assert compare.main(_args("--resume", str(out), "--no-report")) == 0
    assert capsys.readouterr().out.count("already done") == 6
    # the data files alone give the same intervals
    before = (out / "design.json").read_text()
    for kind in ("stress-sync", "stress-async", "reference"):
        for f in (out / kind).glob("*/seed*/metrics.jsonl"):
            f.unlink()
    assert compare.main(_args("--recompute", str(out))) == 0
    assert (out / "design.json").read_text() == before


@pytest.mark.slow  # one real run, stopped after its first updates
def test_sigterm_stops_the_study_cleanly(tmp_path, capsys):
    import os
    import signal
    import threading
    import time

    from mixrl.lab.study import studyrun
    from mixrl.train.checkpoint import list_checkpoints

    out = tmp_path / "study"
    args = _args("--budget", "study", "--fleets", "mixed", "--arms", "grpo", "--modes", "sync", "--seeds", "2",
                 "--steps", "150", "--eval-tasks", "2", "--eval-n", "5", "--out", str(out),
                 "--set", "rollout.prompts_per_step=4", "--set", "rollout.group_size=4")
    runs = [d for _, _, d in compare.plan(args)][:2]  # mixed-sync/grpo seed0, seed1
    assert [r.name for r in runs] == ["seed0", "seed1"]
    seen = {}

    def stop_after_two_updates():
        end = time.time() + 600
        m = runs[0] / "metrics.jsonl"
        while time.time() < end:
            if m.exists() and len(m.read_text().splitlines()) >= 2:
                seen["steps"] = len(m.read_text().splitlines())
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.5)

    before = signal.getsignal(signal.SIGTERM)
    threading.Thread(target=stop_after_two_updates, daemon=True).start()
    failed = studyrun.execute(out, runs, jobs=1, fp32={"enabled": False})
    text = capsys.readouterr().out
    assert failed == [] and seen["steps"] >= 2, text
    assert "interrupted after" in text and "not started (stopped)" in text
    summary = json.loads((runs[0] / "summary.json").read_text())
    assert summary["interrupted"] is True and not studyrun.finished(runs[0])
    assert list_checkpoints(runs[0]) and not runs[1].exists()
    assert signal.getsignal(signal.SIGTERM) == before  # the study's handlers are gone afterwards
