"""Metric sinks: ``metrics.jsonl`` (one JSON object per step), TensorBoard, W&B, trackio.

W&B (``observe.wandb = {project = "..."}``) and trackio (``observe.trackio =
{...}``) are optional extras (``pip install 'mixrl[tracking]'``); the table's
keywords go to their ``init`` (``WANDB_MODE=offline`` works as usual). A
missing package is a user error naming the extra.

Every record is ``{"step": int, "time": seconds since the run started, ...metrics}``
with flat, namespaced keys (docs/corrections.md §10; per sampler group as
``<metric>/<group>``). Non-finite values are written as JSON ``null`` in the
JSONL file (JSON has no NaN) and skipped in TensorBoard.

``REQUIRED`` lists the §10 metrics a training run reports every step and
``PER_GROUP`` those also reported per sampler group; ``missing()`` says which
are absent from a record (tests use it on real runs).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mixrl.records.run_dir import RunDir

PER_GROUP = (
    "mismatch/kl_k1",
    "mismatch/kl_k3",
    "mismatch/tv",
    "mismatch/ratio_oob",
    "rollout/reward",
    "rollout/length",
    "rollout/turns",
    "share/samples",
    "share/oob_tokens",
)
REQUIRED = tuple(m for m in PER_GROUP if not m.startswith("share/")) + (  # shares exist per group only
    "policy/tv",
    "corr/masked_frac",
    "corr/truncated_frac",
    "corr/seq_dropped_frac",
    "corr/ess",
    "policy/entropy",
    "optim/grad_norm",
    "rollout/format_error_end",
    "rollout/staleness_mean",
    "rollout/staleness_max",
)
# with the support recorded (top-p < 1) the exact KL is reported too
EXACT = "mismatch/kl_exact"


def missing(record: Mapping[str, Any], groups: list[str], exact: bool = False) -> list[str]:
    """Names of required metrics absent from one step's record."""
    want = list(REQUIRED) + [f"{m}/{g}" for m in PER_GROUP for g in groups]
    if exact:
        want += [EXACT] + [f"{EXACT}/{g}" for g in groups]
    return [k for k in want if k not in record]


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class JsonlSink:
    """``metrics.jsonl``: each record flushed as written (a crashed run loses none), synced
    to disk at most every ``SYNC_S`` seconds and at close (an fsync per step stalled the
    run's event loop ~40 ms a step; a lost machine loses at most the last ``SYNC_S`` s)."""

    SYNC_S = 10.0

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", buffering=1)  # noqa: SIM115 - held open for the run
        self._synced = time.monotonic()

    def write(self, step: int, time_s: float, metrics: Mapping[str, Any]) -> None:
        rec = {"step": step, "time": round(time_s, 4)}
        rec.update({k: _clean(v) for k, v in sorted(metrics.items())})
        self._f.write(json.dumps(rec, allow_nan=False) + "\n")
        self._f.flush()
        if time.monotonic() - self._synced >= self.SYNC_S:
            os.fsync(self._f.fileno())
            self._synced = time.monotonic()

    def close(self) -> None:
        if not self._f.closed:
            self._f.flush()
            os.fsync(self._f.fileno())
        self._f.close()


class TensorBoardSink:
    def __init__(self, log_dir: str | Path):
        from torch.utils.tensorboard import SummaryWriter

        self._w = SummaryWriter(log_dir=str(log_dir))

    def write(self, step: int, time_s: float, metrics: Mapping[str, Any]) -> None:
        for k, v in metrics.items():
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                continue
            self._w.add_scalar(k, float(v), global_step=step)
        self._w.add_scalar("time/elapsed_s", float(time_s), global_step=step)
        self._w.flush()

    def close(self) -> None:
        self._w.close()


def _finite(metrics: Mapping[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}


class SinkUnavailable(ValueError):
    """A configured tracking package is not installed (user error)."""


class WandbSink:
    def __init__(self, run_dir: Path, options: Mapping[str, Any], config: Mapping[str, Any] | None = None):
        try:
            import wandb
        except ImportError:
            raise SinkUnavailable("observe.wandb: the wandb package is not installed (pip install 'mixrl[tracking]')") from None
        kw = {"dir": str(run_dir), "config": dict(config or {}), **options}
        self._run = wandb.init(**kw)

    def write(self, step: int, time_s: float, metrics: Mapping[str, Any]) -> None:
        self._run.log({**_finite(metrics), "time/elapsed_s": float(time_s)}, step=step)

    def close(self) -> None:
        self._run.finish()


class TrackioSink:
    def __init__(self, run_dir: Path, options: Mapping[str, Any], config: Mapping[str, Any] | None = None):
        try:
            import trackio
        except ImportError:
            raise SinkUnavailable("observe.trackio: the trackio package is not installed (pip install 'mixrl[tracking]')") from None
        self._t = trackio
        self._run = trackio.init(**{"config": dict(config or {}), **options})

    def write(self, step: int, time_s: float, metrics: Mapping[str, Any]) -> None:
        self._t.log({**_finite(metrics), "time/elapsed_s": float(time_s)}, step=step)

    def close(self) -> None:
        self._t.finish()


class Sinks:
    """Fan-out to the configured sinks."""

    def __init__(self, run_dir: str | Path, tensorboard: bool = True, *, wandb: Mapping[str, Any] | None = None,
                 trackio: Mapping[str, Any] | None = None, config: Mapping[str, Any] | None = None):
        run_dir = Path(run_dir)
        self.sinks: list[Any] = [JsonlSink(RunDir(run_dir).metrics)]
        if tensorboard:
            self.sinks.append(TensorBoardSink(run_dir / "tb"))
        if wandb is not None:
            self.sinks.append(WandbSink(run_dir, wandb, config))
        if trackio is not None:
            self.sinks.append(TrackioSink(run_dir, trackio, config))

    def write(self, step: int, time_s: float, metrics: Mapping[str, Any]) -> None:
        for s in self.sinks:
            s.write(step, time_s, metrics)

    def close(self) -> None:
        for s in self.sinks:
            s.close()
