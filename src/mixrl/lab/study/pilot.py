"""A study's pilot: does an arm degrade, and from which update? (one seed, from ``OUT/data`` alone)

    python -m mixrl.lab.study.pilot OUT [--arm mixed-sync/grpo] [--reference reference/on-policy] [--config C]

Per run: the study's collapse outcome (``lab/study/outcome.py``, with the first update the
monitor flags), held-out pass@1 of the base and final policies, the FP32-sampler score of each
scored checkpoint, the training reward's 5-update moving average every 10 updates, and per
sampler group the precision KL (k3) and out-of-range share over the first and last 10 updates.
Between the arm and the reference: the first update from which the arm's moving average stays
below the reference's, and the final held-out pass@1 difference paired over the held-out
tasks (95% paired t over tasks: one seed, so it covers the tasks, not seeds). Writes
``OUT/pilot.json`` and prints it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

from mixrl.lab.study import outcome, studydata
from mixrl.lab.study.paired import t_quantile
from mixrl.lab.study.runs import Run
from mixrl.lab.study.settings import saved_config, study_table
from mixrl.telemetry.monitor import monitor_config, replay

WINDOW = 5


def moving_average(ys: list[float], w: int = WINDOW) -> list[float]:
    """Trailing mean of the last ``w`` values (fewer at the start)."""
    return [float(np.mean(ys[max(0, i + 1 - w): i + 1])) for i in range(len(ys))]


def stays_below(a: list[float], b: list[float]) -> int | None:
    """The first 1-based index from which ``a < b`` at every later index; None if never."""
    n = min(len(a), len(b))
    first = None
    for i in range(n):
        below = a[i] < b[i]
        first = None if not below else (first or i + 1)
    return first


def paired_over_tasks(a: dict[str, Any], b: dict[str, Any], level: float = 0.95) -> dict[str, Any] | None:
    """Per-task pass@1 (c / n) of ``a`` minus ``b`` on their common tasks: mean and t-interval."""
    tasks = sorted(set(a) & set(b))
    d = np.array([a[t][1] / a[t][0] - b[t][1] / b[t][0] for t in tasks], dtype=np.float64)
    if d.size < 2:
        return None
    half = t_quantile(1 - (1 - level) / 2, d.size - 1) * float(d.std(ddof=1)) / math.sqrt(d.size)
    est = float(d.mean())
    return {"estimate": est, "lo": est - half, "hi": est + half, "level": level,
            "method": "paired t over held-out tasks (one seed)", "tasks": int(d.size)}


def describe(r: Run, study: dict[str, Any], base_held: dict[str, Any], base_fp32: float) -> dict[str, Any]:
    _, events = replay(r.rows, monitor_config(study.get("monitor", {})))
    flags = [int(e["step"]) for e in events if e.get("signal") == "collapse" and e.get("active")]
    steps, rew = r.series("rollout/reward")
    ma = moving_average(rew)
    groups = {g: {f"{k}_{part}": r.mean(f"precision/{k}/{g}", **{part: 10})
                  for k in ("kl_k3", "ratio_oob") for part in ("first", "last")} for g in r.groups()}
    return {"run": r.name, "updates": len(r.rows),
            "collapsed": outcome.reasons(r, study, base_held, base_fp32), "monitor_first_flag": min(flags, default=None),
            "held_out_pass1": {"base": outcome.pass1(base_held), "final": outcome.pass1(r.eval.get("per_task"))},
            "fp32_reward": dict(outcome.fp32_scores(r)),
            "reward_ma5": {s: round(v, 4) for s, v in zip(steps, ma, strict=True) if s % 10 == 0 or s == 1},
            "clipped_frac_first_last": [r.mean("rollout/clipped_frac", first=10), r.mean("rollout/clipped_frac", last=10)],
            "groups": groups, "_ma": ma}


def pilot(out: Path, arm: str, reference: str, study: dict[str, Any]) -> dict[str, Any]:
    runs = studydata.load(out)
    held, fp32 = outcome.base_policy(runs)
    by = {r.cell: r for r in runs}
    missing = [c for c in (arm, reference) if c not in by]
    if missing:
        raise SystemExit(f"mixrl.lab.study.pilot: no data for {missing} in {out / 'data'} (have {sorted(by)})")
    a, b = describe(by[arm], study, held, fp32), describe(by[reference], study, held, fp32)
    below = stays_below(a.pop("_ma"), b.pop("_ma"))
    return {"arm": a, "reference": b, "arm_ma5_below_reference_from": below,
            "final_pass1_arm_minus_reference": paired_over_tasks(by[arm].eval["per_task"], by[reference].eval["per_task"]),
            "final_pass1_arm_minus_base": paired_over_tasks(by[arm].eval["per_task"], held) if held else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mixrl.lab.study.pilot", description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--arm", default="mixed-sync/grpo")
    p.add_argument("--reference", default="reference/on-policy")
    p.add_argument("--config", type=Path, default=None, help="the study config (default: the one OUT was run with)")
    a = p.parse_args(argv)
    study = study_table(a.config if a.config is not None else saved_config(a.out))
    res = pilot(a.out, a.arm, a.reference, study)
    text = json.dumps(res, indent=1, default=float)
    (a.out / "pilot.json").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
