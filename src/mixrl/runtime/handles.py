"""The handles the orchestrator is written against (once, for every backend).

A backend only makes handles: ``SamplerHandle`` (``mixrl.fleet.handles``) for a
sampler replica and ``TrainerHandle`` for the trainer. The in-process backend
wraps objects in this process (the trainer's step runs in a worker thread, so
the samplers keep decoding while it trains); the Ray backend wraps actors.

What crosses the boundary is explicit: lists of ``Trajectory`` and advantages
in, a flat ``dict[str, float]`` of metrics out; weights as a stored reference
(a detached state dict in-process, an object reference with Ray).
"""

from __future__ import annotations

import abc
from typing import Any

from mixrl.fleet.handles import SamplerHandle
from mixrl.records.trajectory import Trajectory
from mixrl.weights.refs import WeightsRef

__all__ = ["Backend", "SamplerHandle", "TrainerHandle"]


class TrainerHandle(abc.ABC):
    @abc.abstractmethod
    async def step(self, trajectories: list[Trajectory], advantages: list[float]) -> dict[str, float]:
        """One update on a batch (G trajectories per prompt, in order); returns metrics."""

    @abc.abstractmethod
    async def version(self) -> int:
        """Weights version: 0 at start, +1 per update."""

    @abc.abstractmethod
    async def weights(self) -> WeightsRef:
        """The current weights for the samplers, as a reference the weight store holds.

        The reference is immutable: later updates never change it."""

    @abc.abstractmethod
    async def state(self) -> dict[str, Any]:
        """Everything a checkpoint needs from the trainer (model, optimizer, RNG)."""

    @abc.abstractmethod
    async def load_state(self, state: dict[str, Any]) -> None:
        """Restore ``state()``."""

    async def probe_logprobs(self, prompts: list[list[int]]) -> list[list[float]]:
        """``TrainerSurface.probe_logprobs`` (``fleet.check_loads``); a backend without it refuses."""
        raise NotImplementedError(f"{type(self).__name__}: fleet.check_loads needs trainer.world_size = 1")

    @abc.abstractmethod
    async def save_policy(self, out_dir: str) -> None:
        """Write the current policy as an HF model directory (for evaluation)."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources."""


class Backend(abc.ABC):
    """Makes handles; knows nothing of the training loop."""

    name: str = ""

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Bring the backend up (a Ray cluster)."""

    @abc.abstractmethod
    async def make_trainer(self) -> TrainerHandle: ...

    @abc.abstractmethod
    async def make_sampler(self, group: str, name: str) -> SamplerHandle: ...

    async def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Tear down what ``start`` brought up."""
