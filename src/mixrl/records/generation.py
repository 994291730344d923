"""What a sampler returns, and how a request asks for it: the records that cross from
an engine to the fleet, the rollout and the trainer (token ids and log-probs, never text).

``SamplingParams.record`` is the one home of the candidate-recording spec
(``"support"``, ``"head:K"``, ``"none"``): ``parse_record`` reads it for every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "context_exceeded", "numerical_error", "error"]
CandKind = Literal["support", "head", "none"]


def parse_record(spec: str, where: str = "record") -> tuple[CandKind, int]:
    """``"support"`` -> ("support", 0), ``"head:K"`` -> ("head", K) with K >= 1, ``"none"`` ->
    ("none", 0); anything else raises ``ValueError`` naming ``where``. The one parser of the spec."""
    if spec in ("support", "none"):
        return spec, 0  # type: ignore[return-value]
    if isinstance(spec, str) and spec.startswith("head:") and spec[5:].isdigit() and int(spec[5:]) >= 1:
        return "head", int(spec[5:])
    raise ValueError(f"{where} must be 'support', 'none' or 'head:K' (K >= 1), got {spec!r}")


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
        parse_record(self.record, "SamplingParams.record")

    @property
    def head_k(self) -> int:
        """K of ``record = "head:K"``; 0 otherwise."""
        return parse_record(self.record)[1]


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
