"""The ``Engine`` interface: token ids in, token ids and log-probs out.

Every engine (the built-in torch engine, vLLM) implements ``Engine``: a
synchronous, batched ``generate_batch``. ``BatchingSampler``
(``sampling/batching.py``) is the async replica over any engine: it turns
concurrent ``generate`` calls into batches. The fleet talks to every replica,
in this process or another, through one interface: ``fleet.handles.SamplerHandle``.

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


class ReplicaFailure(RuntimeError):
    """The replica (not the request) failed: the session must continue elsewhere."""
