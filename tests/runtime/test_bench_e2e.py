"""``mixrl bench e2e --json`` on a tiny policy: one JSON object with the headline ratios."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from mixrl.lab.bench import e2e


def test_bench_e2e_json(tiny_policy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = argparse.ArgumentParser()
    e2e.configure(p)
    args = p.parse_args(["--json", "--steps", "3", "--prompts", "2", "--group-size", "2", "--no-trl",
                         "--model", str(tiny_policy), "--out", str(tmp_path)])
    assert e2e.main(args) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("async_over_sync", "trainer_idle_frac", "mixrl_over_trl", "publish_over_copy", "publish_over_floor"):
        assert key in res
    assert res["publish_floor_s"] >= res["copy_s"] and res["publish_over_floor"] > 0
    # the floor at the workers' thread count, and the older definition side by side
    mixed = res["publish"]["mixed_fleet"]
    assert mixed["quantize_threads"]["worker"] == 1 and set(mixed["quantize_s"]) == set(mixed["formats"])
    from mixrl.runtime.backends.embedded.slots import usable_cores
    assert mixed["quantize_threads"]["default"] == usable_cores()  # torch's fresh-process count, not the runs' 1
    assert set(mixed["quantize_s_default_threads"]) == set(mixed["formats"]) and mixed["shm_copy_s"] > 0
    assert res["publish_floor_default_threads_s"] >= res["copy_s"] and res["publish_over_floor_default_threads"] > 0
    assert res["async_over_sync"] > 0 and 0 <= res["trainer_idle_frac"] <= 1
    assert res["publish_s"] > 0 and res["copy_s"] > 0
    assert res["trl"]["available"] is False and res["mixrl_over_trl"] is None
    assert res["sync"]["steps"] == res["async"]["steps"] == 3
    for side in ("sync", "async"):  # where the time goes: the update's CPU, both processes' CPU per step
        r = res[side]
        assert 0 < r["train_step_cpu_s"] <= r["train_step_s"] * 1.05 + 1e-3
        per = r["cpu_s_per_step"]
        assert per["orchestrator"] >= per["trainer"] > 0 and per["samplers"] > 0
    ceil = res["cpu_ceiling"]
    assert ceil["async"]["utilization"] > 0 and ceil["async_over_sync_cpu_ceiling"] > 0
    floor = res["tensor_floor"]  # the trainer's tensors and each replica's weights, measured
    assert set(floor["replica_weights_mb"]) == set(mixed["worker_memory_mb"]) and floor["trainer_mb"] > 0
    assert all(v > 0 for v in floor["replica_weights_mb"].values())  # the tiny policy's GB rounds to 0.0


def test_tensor_floor_against_a_hand_computed_case() -> None:
    """Trainer 100 + 100 + 200 MB (params, gradients, Adam moments); two replicas of 300 and
    150 MB: 850 MB = 0.830 GB; a peak of 2.49 GB is 3.0x it. Missing measurements: no floor."""
    res = {"async": {"trainer_tensor_mb": {"params": 100.0, "grads_in_step": 100.0, "optimizer": 200.0,
                                           "master": 0.0, "ref_model": 0.0}},
           "publish": {"mixed_fleet": {"worker_memory_mb": {"a/0": {"weights_owned": 300.0, "pss": 400.0},
                                                            "b/0": {"weights_owned": 150.0}}}},
           "peak_pss_gb": 2.49}
    f = e2e.tensor_floor(res)
    assert f["gb"] == round(850 / 1024, 2) and f["trainer_mb"] == 400.0
    assert f["replica_weights_mb"] == {"a/0": 300.0, "b/0": 150.0}
    assert f["peak_over_tensor_floor"] == round(2.49 / (850 / 1024), 2)
    assert e2e.tensor_floor({"peak_pss_gb": 1.0})["gb"] is None


def test_cpu_ceiling_against_a_hand_computed_case() -> None:
    """2 cores; sync: 10 steps in 4 s at 0.5 CPU s/step (utilization 0.625); async: 10 steps
    in 2.5 s at 0.45 CPU s/step (0.9). Async's ceiling: 0.45 s of CPU per step over 2 cores
    = 0.225 s/step, i.e. 4.4444 steps/s = 284.44 samples/s of 64; over sync's 160: 1.7778."""
    sync = {"cpu_s_per_step": {"orchestrator": 0.2, "trainer": 0.15, "samplers": 0.3},
            "elapsed_s": 4.0, "steps": 10, "samples_per_s": 640 / 4.0}
    asyn = {"cpu_s_per_step": {"orchestrator": 0.25, "trainer": 0.15, "samplers": 0.2},
            "elapsed_s": 2.5, "steps": 10, "samples_per_s": 640 / 2.5}
    c = e2e.cpu_ceiling(sync, asyn, cores=2)
    assert c["sync"]["utilization"] == pytest.approx(0.5 / (2 * 0.4), rel=1e-12)
    assert c["async"]["utilization"] == pytest.approx(0.45 / (2 * 0.25), rel=1e-12)
    assert c["async_ceiling_samples_per_s"] == pytest.approx(64 * 2 / 0.45, rel=1e-12)
    assert c["async_over_sync_cpu_ceiling"] == pytest.approx((64 * 2 / 0.45) / 160, rel=1e-12)
