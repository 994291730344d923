"""The handle a backend makes for one sampler replica.

The fleet and the router talk only to this interface; the in-process backend
wraps a ``BatchingSampler`` in this process, the Ray backend an actor. A handle
raises ``ReplicaFailure`` when the replica itself is gone (engine crash, dead
actor), never for a bad request: a bad request comes back as a result with an
error ``finish_reason``.
"""

from __future__ import annotations

import abc

from mixrl.records.generation import GenerationRequest, GenerationResult
from mixrl.weights.refs import WeightsRef


class Superseded(Exception):
    """A load whose version the source no longer holds (a newer one evicted it before this
    replica's turn): not a failure; the fleet loads the newest version instead."""


class SamplerHandle(abc.ABC):
    name: str  # unique replica name, "<group>/<index>"
    group: str  # sampler group

    @abc.abstractmethod
    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """One request; ``ReplicaFailure`` if the replica died."""

    @abc.abstractmethod
    async def load_weights(self, ref: WeightsRef, version: int) -> None:
        """Load a stored version (``ref`` from the weight store); quantize on load.
        ``Superseded`` if the version is gone and a newer one should be loaded."""

    async def alive(self) -> None:
        """Return if the replica is alive, raise ``ReplicaFailure`` if it is gone. Asked
        periodically of idle replicas too, so one that dies between requests fails over
        at once. Default: nothing to ask (a replica whose death its requests reveal)."""
        return None

    @abc.abstractmethod
    async def close(self) -> None:
        """Release the replica (idempotent)."""
