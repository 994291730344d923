"""Online collapse monitor: the three signals seen before every collapse.

The signals (docs/corrections.md section 10, "Collapse signals"):

1. ``reward_drop``: the smoothed training reward falls ``reward_drop`` below
   its running best (an exponential moving average, so one bad batch of a
   noisy small-batch run does not fire it);
2. ``kl_growth``: the smoothed sampler-trainer KL reaches ``kl_factor`` x its
   early-run level. The KL is the *precision* KL, over staleness-0 tokens only
   (``precision/kl_exact`` where the support is recorded, else
   ``precision/kl_k3``): in an asynchronous run ``mismatch/*`` also contains
   policy lag, which grows and shrinks with the schedule, not with the
   samplers' numerics. ``mismatch/kl_exact`` / ``mismatch/kl_k3`` are used
   only for metrics written without the split. Never k1, which is too noisy at
   small batches and can turn negative. A step with no staleness-0 token has
   no precision KL and leaves the average unchanged. The early level is the
   mean of the first ``early_steps`` measurements after the ``warmup_steps`` first steps;
3. ``lag_kl_growth``: the same test on the *lag* KL (``lag/kl_exact`` or
   ``lag/kl_k3``: stale tokens, the trainer against the policy that sampled them).
   An asynchronous run whose policy runs away from its samplers shows it here,
   and at its end it may have almost no staleness-0 token left to measure a
   precision KL on (stress-async/grpo seed 2 of the committed study: precision
   KL on no token in the last 25 updates, lag KL 0.1 -> 1.7);
4. ``format_errors``: the smoothed share of episodes ending on repeated format
   errors (``rollout/format_error_end``) exceeds ``format_error_frac``.

A step is flagged ``collapse`` when the reward has dropped and at least one of
the other signals is active. Every transition of a signal is an event,
appended to ``collapse.jsonl`` in the run directory by the caller.

Example::

    mon = CollapseMonitor(MonitorConfig(early_steps=3, warmup_steps=3))   # or replay(rows, cfg)
    for step, m in enumerate(metrics, 1):
        for ev in mon.update(step, m):
            print(ev)            # {"step": 12, "signal": "kl_growth", "active": True, ...}
        if mon.collapsed and cfg.stop_on_collapse: break
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mixrl.records import keys as K

KL_KEYS = K.PRECISION_KL
REWARD_KEY = K.REWARD
FORMAT_KEY = K.FORMAT_END
SIGNALS = ("reward_drop", "kl_growth", "lag_kl_growth", "format_errors")


@dataclass(frozen=True)
class MonitorConfig:
    # 0.1: at 8 prompts x 8 samples a step's mean reward has a std of ~0.06; the
    # average then moves ~0.015, so a 0.15 fall is a trend, not one bad batch.
    ema: float = 0.1  # weight of the newest value in the moving averages, in (0, 1]
    reward_drop: float = 0.15  # absolute fall below the running best of the smoothed reward
    kl_factor: float = 3.0  # smoothed KL >= kl_factor x early level
    # Sized so a collapse can be flagged within a few tens of updates: the earliest
    # possible flag is at step warmup_steps + early_steps + 1 (a KL signal needs its
    # early level first). A step without staleness-0 tokens adds nothing to the level.
    early_steps: int = 5  # precision-KL measurements (after warm-up) that define the early level
    warmup_steps: int = 3  # no signal fires, and no early level is taken, up to this step
    format_error_frac: float = 0.5  # "most episodes" end on format errors
    kl_floor: float = 1e-8  # early KL below this is treated as this (avoids 0 x 3 = 0)

    def __post_init__(self) -> None:
        if not 0 < self.ema <= 1:
            raise ValueError(f"MonitorConfig.ema must be in (0, 1], got {self.ema}")
        if self.kl_factor <= 1:
            raise ValueError(f"MonitorConfig.kl_factor must be > 1, got {self.kl_factor}")
        if self.early_steps < 1 or self.warmup_steps < 0:
            raise ValueError("MonitorConfig.early_steps must be >= 1 and warmup_steps >= 0")
        if not 0 < self.format_error_frac <= 1:
            raise ValueError(
                f"MonitorConfig.format_error_frac must be in (0, 1], got {self.format_error_frac}"
            )


@dataclass
class CollapseMonitor:
    cfg: MonitorConfig = field(default_factory=MonitorConfig)
    steps: int = 0
    reward_ema: float | None = None
    reward_best: float = -math.inf
    kl_key: str | None = None
    kl_early: list[float] = field(default_factory=list)
    kl_ema: float | None = None
    fmt_ema: float | None = None
    lag_key: str | None = None
    lag_early: list[float] = field(default_factory=list)
    lag_ema: float | None = None
    active: dict[str, bool] = field(default_factory=lambda: dict.fromkeys(SIGNALS, False))
    first_collapse_step: int | None = None

    @property
    def collapsed(self) -> bool:
        return self.first_collapse_step is not None

    def _ema(self, old: float | None, x: float) -> float:
        return x if old is None else (1 - self.cfg.ema) * old + self.cfg.ema * x

    def update(self, step: int, metrics: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Feed one step's metrics; return the events (signal switched on/off, collapse)."""
        self.steps += 1
        r = _finite(metrics.get(REWARD_KEY))
        if r is not None:
            self.reward_ema = self._ema(self.reward_ema, r)
            if self.steps >= self.cfg.warmup_steps:  # the EMA has settled by then
                self.reward_best = max(self.reward_best, self.reward_ema)
        if self.kl_key is None:
            self.kl_key = next((k for k in KL_KEYS if _finite(metrics.get(k)) is not None), None)
        kl = _finite(metrics.get(self.kl_key)) if self.kl_key else None
        if kl is not None:
            if self.steps > self.cfg.warmup_steps and len(self.kl_early) < self.cfg.early_steps:
                self.kl_early.append(kl)
            self.kl_ema = self._ema(self.kl_ema, kl)
        if self.lag_key is None:
            self.lag_key = next((k for k in K.LAG_KL if _finite(metrics.get(k)) is not None), None)
        lag = _finite(metrics.get(self.lag_key)) if self.lag_key else None
        if lag is not None:
            if self.steps > self.cfg.warmup_steps and len(self.lag_early) < self.cfg.early_steps:
                self.lag_early.append(lag)
            self.lag_ema = self._ema(self.lag_ema, lag)
        f = _finite(metrics.get(FORMAT_KEY))
        if f is not None:
            self.fmt_ema = self._ema(self.fmt_ema, f)

        now = self.signals()
        events = []
        for name in SIGNALS:
            if now[name] != self.active[name]:
                events.append({"step": step, "signal": name, "active": now[name], **self.levels()})
        self.active = now
        if self.first_collapse_step is None and now["reward_drop"] and (
            now["kl_growth"] or now["lag_kl_growth"] or now["format_errors"]
        ):
            self.first_collapse_step = step
            events.append({"step": step, "signal": "collapse", "active": True, **self.levels()})
        return events

    def signals(self) -> dict[str, bool]:
        warm = self.steps > self.cfg.warmup_steps
        reward = (
            warm
            and self.reward_ema is not None
            and self.reward_ema < self.reward_best - self.cfg.reward_drop
        )
        kl = (
            warm
            and len(self.kl_early) >= self.cfg.early_steps
            and self.kl_ema is not None
            and self.kl_ema >= self.cfg.kl_factor * self.kl_early_level
        )
        lag = (
            warm
            and len(self.lag_early) >= self.cfg.early_steps
            and self.lag_ema is not None
            and self.lag_ema >= self.cfg.kl_factor * _level(self.lag_early, self.cfg.kl_floor)
        )
        fmt = warm and self.fmt_ema is not None and self.fmt_ema > self.cfg.format_error_frac
        return {"reward_drop": bool(reward), "kl_growth": bool(kl), "lag_kl_growth": bool(lag),
                "format_errors": bool(fmt)}

    @property
    def kl_early_level(self) -> float:
        return _level(self.kl_early, self.cfg.kl_floor)

    def levels(self) -> dict[str, Any]:
        growth = (self.kl_ema / self.kl_early_level) if self.kl_ema is not None and self.kl_early else None
        return {
            "reward_ema": self.reward_ema,
            "reward_best": None if self.reward_best == -math.inf else self.reward_best,
            "kl_key": self.kl_key,
            "kl_ema": self.kl_ema,
            "kl_early": self.kl_early_level if self.kl_early else None,
            "kl_growth": growth,
            "lag_kl_ema": self.lag_ema,
            "lag_kl_early": _level(self.lag_early, self.cfg.kl_floor) if self.lag_early else None,
            "format_error_ema": self.fmt_ema,
        }

    def summary(self) -> dict[str, Any]:
        return {"collapsed": self.collapsed, "first_collapse_step": self.first_collapse_step,
                "active": dict(self.active), **self.levels()}

    def state_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in (
            "steps", "reward_ema", "reward_best", "kl_key", "kl_early", "kl_ema", "fmt_ema",
            "lag_key", "lag_early", "lag_ema", "active", "first_collapse_step")}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for k, v in state.items():
            setattr(self, k, v)
        # a state saved before a signal existed: that signal starts off
        self.active = {**dict.fromkeys(SIGNALS, False), **dict(self.active)}


def monitor_config(fields: Mapping[str, Any] | None) -> MonitorConfig:
    """A ``MonitorConfig`` from a table of its fields (e.g. ``[study.monitor]`` of
    compare.toml); an unknown field raises ValueError naming it."""
    known = set(MonitorConfig.__dataclass_fields__)
    bad = sorted(set(fields or {}) - known)
    if bad:
        raise ValueError(f"collapse monitor: unknown field(s) {bad}; valid: {sorted(known)}")
    return MonitorConfig(**dict(fields or {}))


def replay(rows: list[Mapping[str, Any]],
           cfg: MonitorConfig | None = None) -> tuple[CollapseMonitor, list[dict[str, Any]]]:
    """Run the monitor over recorded per-step metrics (``metrics.jsonl`` rows, in order):
    the verdict and events the run would have produced online with these settings."""
    mon, events = CollapseMonitor(cfg or MonitorConfig()), []
    for i, row in enumerate(rows, 1):
        events += mon.update(int(row.get("step", i)), row)
    return mon, events


def _level(early: list[float], floor: float) -> float:
    """The early level of a KL: the mean of its first measurements, at least ``floor``."""
    return max(sum(early) / len(early), floor) if early else math.nan


def _finite(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None
