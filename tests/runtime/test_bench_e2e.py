"""``mixrl bench e2e --json`` on a tiny policy: one JSON object with the headline ratios."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from mixrl.bench import e2e


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
