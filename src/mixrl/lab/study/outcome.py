"""The study's collapse outcome: what counts as a collapsed run, from its committed data alone.

A run is **collapsed** when any of three things happened (pre-registered in docs/study.md):

- ``monitor``: the collapse monitor, replayed on its per-step metrics with the study's
  ``[study.monitor]`` settings, flags it (training reward drop together with growth of
  the precision KL, the lag KL or the format errors: telemetry/monitor.py);
- ``fp32``: the FP32-sampler reward (one common sampler scores every arm's checkpoints)
  of its last scored checkpoint is ``drop`` or more below the best earlier score, the
  base policy's included;
- ``held-out``: the final policy's held-out pass@1 is ``drop`` or more below the base
  policy's.

``drop`` is ``[study] collapse_drop`` (default: the monitor's ``reward_drop``, 0.15).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from mixrl.lab.study.runs import Run
from mixrl.lab.study.stats import passk_matrix
from mixrl.telemetry.monitor import monitor_config, replay


def pass1(per_task: dict[str, Any] | None, tasks: list[str] | None = None) -> float:
    """Mean held-out pass@1 over ``tasks`` (default: all of ``per_task``)."""
    if not per_task:
        return math.nan
    ts = sorted(per_task) if tasks is None else [t for t in tasks if t in per_task]
    return float(np.nanmean(passk_matrix([per_task], ts, 1))) if ts else math.nan


def base_policy(runs: list[Run]) -> tuple[dict[str, Any], float]:
    """The starting policy's held-out ``per_task`` and FP32-sampler scores (step 0), from the
    study's first run (the only one that evaluates it)."""
    held = next((r.base.get("per_task") for r in runs if (r.base or {}).get("per_task")), None) or {}
    fp32 = next((float(v["mean_reward"]) for r in runs for s, v in (r.config.get("fp32") or {}).items()
                 if int(s) == 0 and "mean_reward" in v), math.nan)
    return held, fp32


def fp32_scores(r: Run) -> list[tuple[int, float]]:
    return sorted((int(s), float(v["mean_reward"])) for s, v in (r.config.get("fp32") or {}).items()
                  if "mean_reward" in v)


def reasons(r: Run, study: dict[str, Any], base_held: dict[str, Any], base_fp32: float) -> list[str]:
    """Why ``r`` counts as collapsed ([] when it does not)."""
    mon = study.get("monitor", {})
    drop = float(study.get("collapse_drop", mon.get("reward_drop", 0.15)))
    out = []
    if replay(r.rows, monitor_config(mon))[0].collapsed:
        out.append("monitor")
    scores = fp32_scores(r)
    if scores and scores[-1][0] > 0:
        earlier = [v for s, v in scores[:-1]] + ([base_fp32] if math.isfinite(base_fp32) else [])
        if earlier and scores[-1][1] <= max(earlier) - drop:
            out.append("fp32")
    tasks = sorted(set(base_held) & set(r.eval.get("per_task") or {}))
    if tasks and pass1(r.eval["per_task"], tasks) <= pass1(base_held, tasks) - drop:
        out.append("held-out")
    return out


def collapsed(runs: list[Run], study: dict[str, Any]) -> dict[str, list[str]]:
    """Run name -> its reasons, for every collapsed run."""
    held, fp32 = base_policy(runs)
    return {r.name: why for r in runs if (why := reasons(r, study, held, fp32))}
