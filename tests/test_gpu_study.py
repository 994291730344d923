"""The real model's study on a GPU (``scripts/gpu_study.sh``, ``mixrl.lab.gpu.study``), in its CPU mode.

The same steps as on a GPU: the timing run (3 updates of each cell, ``mixrl compare --plan
--calibrate 3``), the gate, the runs that fit, the report; on the bundled model, tiny sizes.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from mixrl.lab.gpu import study

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("gpu-study") / "study"
    p = subprocess.run([str(ROOT / "scripts" / "gpu_study.sh"), "--cpu", "--model", "bundled", "--out", str(out),
                        "--steps", "3", "--eval-tasks", "4", "--eval-n", "2", "--arms", "grpo,on-policy",
                        "--seeds", "1", "--minutes", "14"], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout), out


def test_the_timing_run_then_the_runs_then_the_report(finished: tuple[dict, Path]) -> None:
    res, out = finished
    assert res["ok"] and res["failed"] is None and list(res["steps"]) == ["setup", "timing", "runs"]
    timing, runs = res["steps"]["timing"], res["steps"]["runs"]
    assert timing["calibrate_updates"] == 3 and set(timing["measured"]) == {"mixed-sync/grpo", "reference/on-policy"}
    assert all(m["source"] == "calibration" and m["update_s"] > 0 for m in timing["measured"].values())
    assert 0 < timing["slowest_run_s"] < timing["seconds_left"]
    assert runs["complete"] and runs["runs_done"] == ["mixed-sync/grpo/seed0.json", "reference/on-policy/seed0.json"]
    assert (out / "design.md").is_file() and runs["next"] is None
    cfg = (out / "configs" / "mixed-sync" / "grpo" / "seed0.toml").read_text()
    assert "cuda_devices" not in cfg and 'compute_dtype = "float32"' in cfg  # the CPU mode keeps the config's fleet


def test_too_slow_stops_before_any_run(finished: tuple[dict, Path]) -> None:
    _, out = finished
    plan = json.loads((out / "plan.json").read_text())
    slowest = max(r["projected_s"] for r in plan["runs"])
    assert study.too_slow(plan, slowest + 1) is None
    why = study.too_slow(plan, slowest - 1)
    assert why and why.startswith("too slow: the slowest cell's run is projected at") and "s/update" in why
    done = {**plan, "runs": [{**r, "status": "done"} for r in plan["runs"]]}
    assert study.too_slow(done, 0.0) is None


def test_on_a_gpu_every_group_and_the_trainer_go_to_gpu_0() -> None:
    sets = study.gpu_sets(ROOT / "examples" / "real_model" / "study.toml")
    groups = sets[0]
    assert groups.startswith("fleet.groups=[") and groups.count("cuda_devices = [0]") == 4
    assert "compute_dtype" not in groups and "b200-nvfp4" in groups
    assert sets[1:] == ["trainer.num_gpus=1", "optim.precision=fp32"]


def test_the_reference_fleet_runs_where_the_mixed_fleet_does() -> None:
    from mixrl.config import FleetConfig, GroupConfig
    from mixrl.lab.study.compare import homogeneous_fleet, single_profile_fleet, stress_fleet

    mixed = FleetConfig(groups=[GroupConfig(name=p, profile=p, cuda_devices=[0], num_gpus=0.25)
                                for p in ("b200-nvfp4", "h100-bf16")])
    for fleet in (single_profile_fleet(mixed, "fp32"), homogeneous_fleet(mixed), stress_fleet(mixed)):
        assert all(g.cuda_devices == [0] and g.num_gpus == 0.25 for g in fleet.groups)


def test_a_timing_run_of_fewer_than_3_updates_is_refused() -> None:
    with pytest.raises(SystemExit):
        study.parse(["--calibrate", "2"])
