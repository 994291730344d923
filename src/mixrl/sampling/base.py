"""The ``Sampler`` interface: token ids in, token ids and log-probs out.

Every engine (the built-in torch engine, vLLM) implements ``Engine``: a
synchronous, batched ``generate_batch``. ``Sampler`` is the async face the
rollout workers and the router talk to; ``BatchingSampler`` in
``sampling/batching.py`` turns concurrent ``generate`` calls into batches.

Nothing here is ever re-tokenized: prompts and outputs are token ids.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any

from mixrl.records.generation import GenerationRequest, GenerationResult


class Engine(abc.ABC):
    """A synchronous batched generator in one precision profile."""

    group: str = ""
    version: int = -1

    @abc.abstractmethod
    def generate_batch(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Generate for every request; a bad request fails alone (error finish_reason)."""

    @abc.abstractmethod
    def load_weights(self, state_dict: Mapping[str, Any], version: int) -> None:
        """Take the trainer's weights (its own precision) and quantize on load."""


class Sampler(abc.ABC):
    """Async face of one sampler replica (what the router and sessions use)."""

    group: str = ""

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """The weights version this replica serves."""

    @abc.abstractmethod
    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """Generate one reply, recording per token log q, version and candidates."""

    @abc.abstractmethod
    async def load_weights(self, state_dict: Mapping[str, Any], version: int) -> None:
        """Take the trainer's weights of ``version`` and quantize them on load."""


class ReplicaFailure(RuntimeError):
    """The replica (not the request) failed: the session must continue elsewhere."""
