"""What a trajectory must say about how it was sampled, and which ones the trainer will drop.

Sampling parameters per result. Every generation result a session appends
records the temperature, top-p and top-k it was drawn with, in
``traj.info["sampling"]`` (one entry per result) and, for the trainer,
``traj.info["temperature"]``. The trainer reads them instead of assuming the
run-wide values (:func:`sampling_error`):

- the trainer divides its logits by the trajectory's own temperature;
- results of one trajectory drawn at different temperatures are malformed
  (the batch carries one temperature per trajectory);
- a result drawn with top-p < 1 or top-k > 0 is malformed unless the loss
  replays the recorded support: otherwise every ratio is biased by the log of
  the kept mass (docs/corrections.md section 3).

Screening before advantages (:func:`malformed`): GRPO statistics must be taken
over the trajectories the trainer will actually train on, so the same checks
the trainer applies are run first and the malformed trajectories are left out
of their group's mean and std (docs/corrections.md section 8).
"""

from __future__ import annotations

import math
from typing import Any

from mixrl.rollout.types import UNREWARDED, Trajectory


def record_sampling(traj: Trajectory, params: Any) -> None:
    """Append the sampling parameters of one result (a ``SamplingParams``) to ``traj.info``."""
    entry = {"temperature": float(params.temperature), "top_p": float(params.top_p),
             "top_k": int(params.top_k)}
    traj.info.setdefault("sampling", []).append(entry)
    traj.info["temperature"] = entry["temperature"]


def sampling_error(traj: Trajectory, cand_kind: str) -> str | None:
    """Why the trainer cannot use ``traj`` as sampled (None if it can), from ``info["sampling"]``."""
    entries = traj.info.get("sampling") or []
    temps = {e["temperature"] for e in entries}
    if len(temps) > 1:
        return f"Trajectory.info['sampling'] mixes temperatures {sorted(temps)} within one trajectory"
    for e in entries:
        if not (math.isfinite(e["temperature"]) and e["temperature"] > 0):
            return f"Trajectory.info['sampling'] temperature must be > 0, got {e['temperature']}"
        truncated = e["top_p"] < 1.0 or e["top_k"] > 0
        if truncated and cand_kind != "support":
            return (f"Trajectory.info['sampling'] has top_p={e['top_p']}, top_k={e['top_k']} but the loss "
                    "does not replay the support: every ratio would be biased by the kept mass")
    return None


def malformed(trajs: list[Trajectory], *, vocab_size: int, cand_kind: str) -> list[str | None]:
    """Per trajectory: the reason the trainer will drop it as malformed, or None."""
    from mixrl.train.batch import _check  # the trainer's own structural checks

    out: list[str | None] = []
    for t in trajs:
        if t.status in UNREWARDED:
            out.append(None)  # excluded as infra, not malformed
            continue
        try:
            _check(t, vocab_size, cand_kind)
        except ValueError as e:
            out.append(str(e))
            continue
        out.append(sampling_error(t, cand_kind))
    return out
