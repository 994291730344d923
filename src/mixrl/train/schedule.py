"""Learning-rate schedules: the multiplier of ``optim.lr`` at each trainer update.

``u`` counts completed updates (the trainer's version), ``W`` = ``warmup_steps``,
``T`` = ``runtime.steps``, ``m`` = ``min_lr_ratio``::

    warm-up   u < W:  f = (u + 1) / W                      (first update at lr/W, never 0)
    then      x = (u − W) / max(T − W − 1, 1), clipped to [0, 1]
              constant  f = 1
              linear    f = 1 − (1 − m) · x
              cosine    f = m + (1 − m) · ½ (1 + cos(π x))

So the last update (u = T − 1) runs at ``m · lr`` for linear and cosine. The
multiplier depends only on ``u``: a resumed run continues the same schedule
(the version is in the checkpoint). Updates past ``T`` keep the last value.
"""

from __future__ import annotations

import math

SCHEDULES = ("constant", "linear", "cosine")


def lr_factor(update: int, *, schedule: str, total: int, warmup: int = 0, min_ratio: float = 0.0) -> float:
    """Multiplier of the base learning rate for update ``update`` (0-based)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"optim.schedule {schedule!r} is not one of {SCHEDULES}")
    if update < 0 or total < 1 or warmup < 0 or not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"bad schedule arguments: update={update}, total={total}, "
                         f"warmup={warmup}, min_ratio={min_ratio}")
    if update < warmup:
        return (update + 1) / warmup
    if schedule == "constant":
        return 1.0
    x = min(max((update - warmup) / max(total - warmup - 1, 1), 0.0), 1.0)
    if schedule == "linear":
        return 1.0 - (1.0 - min_ratio) * x
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * x))
