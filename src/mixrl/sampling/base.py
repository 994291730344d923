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
from dataclasses import dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length", "context_exceeded", "numerical_error", "error"]
CandKind = Literal["support", "head", "none"]


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples (validated on construction; fields in the comments)."""

    temperature: float = 1.0  # > 0
    top_p: float = 1.0  # in (0, 1]
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 64  # >= 1
    stop_ids: tuple[int, ...] = ()  # generation ends after emitting one of these (kept in output)
    record: str = "support"  # "support" | "head:K" | "none": which candidates of q to return
    seed: int | None = None  # per-request seed; None = engine's generator

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"SamplingParams.temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.record != "support" and self.record != "none" and not (
            self.record.startswith("head:") and self.record[5:].isdigit()
        ):
            raise ValueError(
                f"SamplingParams.record must be 'support', 'none' or 'head:K', got {self.record!r}"
            )

    @property
    def head_k(self) -> int:
        """K of ``record = "head:K"``; 0 otherwise."""
        return int(self.record[5:]) if self.record.startswith("head:") else 0


@dataclass
class GenerationRequest:
    """One generation request: the whole prefix as token ids and its sampling parameters."""

    prompt_ids: list[int]  # the whole prefix (a partial rollout continues any prefix)
    params: SamplingParams
    request_id: str = ""
    session: str = ""  # the conversation it continues: an engine may keep its KV between requests


# Largest positive log-probability accepted as float rounding (a log-probability is <= 0). One
# tolerance for every layer: the fleet's check of a result and the trajectory's own check.
LOGPROB_TOL = 1e-4


@dataclass
class GenerationResult:
    """One request's output. Per generated token j:

    - ``token_ids[j]`` the sampled id; ``logprobs[j]`` = log q(y_j | s_j) under the
      distribution actually sampled from (after temperature, top-k, top-p);
    - candidates ``cand_ids[cand_offsets[j]:cand_offsets[j+1]]`` with their log q
      in ``cand_logprobs``: the whole support (``cand_kind == "support"``: every
      token that survived top-k/top-p; the log q there sum to 1 in prob space),
      or the k most likely tokens (``"head"``), or nothing (``"none"``);
    - MoE models: ``routed_experts[j]`` ``[layers][k]``, the experts each layer routed the
      position whose logits drew token j to (None when the engine records none).
    """

    token_ids: list[int]
    logprobs: list[float]
    cand_offsets: list[int]  # len(token_ids) + 1
    cand_ids: list[int]
    cand_logprobs: list[float]
    cand_kind: CandKind
    version: int  # weights version that produced every token of this result
    group: str  # sampler group name
    finish_reason: FinishReason
    num_nonfinite: int = 0  # non-finite logits seen (finish_reason == "numerical_error")
    error: str = ""  # human-readable reason when finish_reason is an error status
    timings: dict[str, float] = field(default_factory=dict)
    routed_experts: list[list[list[int]]] | None = None  # [n][layers][k] (MoE only)

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if self.routed_experts is not None and len(self.routed_experts) != n:
            raise ValueError(f"GenerationResult.routed_experts has {len(self.routed_experts)} entries for {n} tokens")
        if len(self.logprobs) != n:
            raise ValueError(f"GenerationResult.logprobs has {len(self.logprobs)} entries for {n} tokens")
        if len(self.cand_offsets) != n + 1:
            raise ValueError(
                f"GenerationResult.cand_offsets has {len(self.cand_offsets)} entries, expected {n + 1}"
            )
        if len(self.cand_ids) != len(self.cand_logprobs):
            raise ValueError(
                f"GenerationResult.cand_ids ({len(self.cand_ids)}) and cand_logprobs "
                f"({len(self.cand_logprobs)}) differ in length"
            )


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


def extend_routing(
    routed: list[list[list[int]]] | None, n_before: int, res: GenerationResult
) -> list[list[list[int]]] | None:
    """A trajectory's ``routed_experts`` after appending ``res``'s tokens (``n_before``
    generated tokens already in it). Tokens of a result that recorded no routing (another
    engine, a partial rollout) get -1 sets, which the trainer routes freely."""
    new = res.routed_experts
    if new is None and routed is None:
        return None
    shape = (new or routed or [[[]]])[0]
    hole = [[-1] * len(shape[0]) for _ in shape]
    before = routed if routed is not None else [hole] * n_before
    return before + (new if new is not None else [hole] * len(res.token_ids))
