"""The record that crosses every boundary: one trajectory, aligned per token.

A trajectory is a whole (possibly multi-turn) episode. ``tokens`` is exactly the
concatenation of prompt, generated and tool-output tokens, never re-tokenized.
Per-token fields are aligned with ``tokens``; sampler fields are meaningful only
where ``loss_mask == 1``. Candidates (support or head of q) are ragged over the
generated tokens only, in order.

A trajectory grows only through :meth:`Trajectory.append_env` (prompt, tool output)
and :meth:`Trajectory.append_generated` (one generation result and the sampling
parameters it was drawn with, kept in ``info["sampling"]``, one entry per result).

Whether the trainer can use it is one verdict, :meth:`Trajectory.check`: the
structure (:meth:`structure_error`: lengths, ids inside the vocabulary, the
candidates the loss needs, log q <= ``LOGPROB_TOL``) and the sampling
(:meth:`sampling_error`): the trainer divides its logits by the trajectory's own
temperature, so results of one trajectory drawn at different temperatures are
malformed, and a result drawn with top-p < 1 or top-k > 0 is malformed unless
the loss replays the recorded support (otherwise every ratio is biased by the
log of the kept mass, docs/corrections.md section 3). :meth:`screen` computes
the verdict once, where the trajectory is completed, and keeps it in
``verdict``; every later reader (advantages, the trainer) reads it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from mixrl.records.generation import LOGPROB_TOL, GenerationResult, extend_routing

Status = Literal["ok", "format_error", "max_turns", "truncated", "infra_failed", "reward_failed", "agent_failed",
                 "failed", "reward_hacked"]
STATUSES: tuple[str, ...] = ("ok", "format_error", "max_turns", "truncated", "infra_failed", "reward_failed",
                             "agent_failed", "failed", "reward_hacked")
# "failed": the model's work could not be checked in its time or disk (reward 0);
# "reward_hacked": a grader's canary was reported passed (reward 0, counted).
# Episodes without a reward (reward None): an infrastructure failure, or a user
# reward function that raised / returned NaN or None. Never reward 0: they are
# left out of advantages and of the loss, and counted.
# An agent episode whose code raised, hung or never sampled (``agent_failed``) is one too.
UNREWARDED: tuple[str, ...] = ("infra_failed", "reward_failed", "agent_failed")


@dataclass
class Trajectory:
    """One whole episode, aligned per token: what crosses every process boundary (fields in the comments)."""

    prompt_id: str  # the task instance; G trajectories share it
    sample_idx: int  # 0..G-1 within its group
    tokens: list[int] = field(default_factory=list)  # [L] prompt + generated + tool tokens
    loss_mask: list[int] = field(default_factory=list)  # [L] 1 on generated tokens
    sampler_logprobs: list[float] = field(default_factory=list)  # [L] log q(y_t); 0.0 off-mask
    versions: list[int] = field(default_factory=list)  # [L] weights version; -1 off-mask
    groups: list[str] = field(default_factory=list)  # [L] sampler group; "" off-mask
    cand_kind: str = "none"  # "support" | "head" | "none"
    cand_offsets: list[int] = field(default_factory=lambda: [0])  # [n_gen + 1]
    cand_ids: list[int] = field(default_factory=list)  # [K] candidates of q, all gen tokens
    cand_logprobs: list[float] = field(default_factory=list)  # [K] log q(v)
    # MoE: per generated token, [layers][k] experts the sampler routed its predicting position to
    routed_experts: list[list[list[int]]] | None = None  # [n_gen] or None (not recorded)
    reward: float | None = None  # None until the episode ends (and for UNREWARDED statuses)
    status: str = "ok"  # one of STATUSES
    turns: int = 0  # assistant turns taken
    num_malformed: int = 0  # malformed tool calls
    num_nonfinite: int = 0  # sampler tokens masked as non-finite
    task: str = ""  # task family
    timings: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    # the answer of ``check`` for the run's vocabulary and loss, kept by ``screen``:
    # "" usable, else why not; None: not checked yet
    verdict: str | None = None

    # ------------------------------------------------------------------ growing

    def append_env(self, ids: Sequence[int]) -> None:
        """Append tokens the model did not generate (prompt, tool output): loss_mask 0."""
        n = len(ids)
        self.tokens += ids
        self.loss_mask += [0] * n
        self.sampler_logprobs += [0.0] * n
        self.versions += [-1] * n
        self.groups += [""] * n

    def append_generated(self, res: GenerationResult, params: Any) -> None:
        """Append one generation result and the ``SamplingParams`` it was drawn with: each token
        keeps its log q, version and group; candidates, non-finite counts and MoE routing follow."""
        n = len(res.token_ids)
        self.tokens += res.token_ids
        self.loss_mask += [1] * n
        self.sampler_logprobs += map(float, res.logprobs)  # extend; map: ~2x the comprehension
        self.versions += [res.version] * n
        self.groups += [res.group] * n
        base = self.cand_offsets[-1]
        self.cand_offsets += [base + o for o in res.cand_offsets[1:]]
        self.cand_ids += res.cand_ids
        self.cand_logprobs += map(float, res.cand_logprobs)
        if self.cand_kind == "none" and res.cand_kind != "none":
            self.cand_kind = res.cand_kind
        self.num_nonfinite += res.num_nonfinite
        # MoE: the experts each generated token was routed to (routing replay in the trainer)
        self.routed_experts = extend_routing(self.routed_experts, self.num_generated - n, res)
        self.record_sampling(params)

    def record_sampling(self, params: Any) -> None:
        """Keep the temperature, top-p and top-k of one result in ``info["sampling"]`` and, for the
        trainer, ``info["temperature"]``."""
        entry = {"temperature": float(params.temperature), "top_p": float(params.top_p),
                 "top_k": int(params.top_k)}
        self.info.setdefault("sampling", []).append(entry)
        self.info["temperature"] = entry["temperature"]

    # ------------------------------------------------------------------ reading

    @property
    def num_generated(self) -> int:
        """Tokens the model generated (the loss mask's ones)."""
        return sum(self.loss_mask)

    def staleness(self, trainer_version: int) -> list[int]:
        """Per generated token: ``trainer_version`` (the version the update consuming it starts
        from) minus the version that generated it (docs/corrections.md section 10)."""
        return [trainer_version - v for m, v in zip(self.loss_mask, self.versions, strict=True) if m]

    # ------------------------------------------------------------------ checks

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field if the record is inconsistent."""
        n = len(self.tokens)
        for name in ("loss_mask", "sampler_logprobs", "versions", "groups"):
            got = len(getattr(self, name))
            if got != n:
                raise ValueError(f"Trajectory.{name} has length {got}, tokens has {n}")
        n_gen = self.num_generated
        if len(self.cand_offsets) != n_gen + 1 and self.cand_kind != "none":
            raise ValueError(
                f"Trajectory.cand_offsets has length {len(self.cand_offsets)}, expected {n_gen + 1}"
            )
        if len(self.cand_ids) != len(self.cand_logprobs):
            raise ValueError("Trajectory.cand_ids and cand_logprobs differ in length")
        if self.routed_experts is not None and len(self.routed_experts) != n_gen:
            raise ValueError(f"Trajectory.routed_experts has length {len(self.routed_experts)}, expected {n_gen}")
        worst = max(_positive(lp for lp, m in zip(self.sampler_logprobs, self.loss_mask, strict=True) if m),
                    _positive(self.cand_logprobs))
        if worst > LOGPROB_TOL:
            raise ValueError(f"Trajectory.sampler_logprobs / cand_logprobs has a positive log-probability "
                             f"({worst:.3g} > {LOGPROB_TOL:g}): log q must be <= 0")
        if self.status not in STATUSES:
            raise ValueError(f"Trajectory.status {self.status!r} is not one of {STATUSES}")

    def structure_error(self, vocab_size: int, cand_kind: str) -> str | None:
        """Why the tokens and candidates cannot be aligned for a loss needing ``cand_kind``
        candidates over a ``vocab_size`` vocabulary (None if they can)."""
        try:
            self.validate()
        except ValueError as e:
            return str(e)
        if not set(self.loss_mask) <= {0, 1}:
            return f"Trajectory.loss_mask holds values other than 0/1: {sorted(set(self.loss_mask))}"
        if self.tokens and (min(self.tokens) < 0 or max(self.tokens) >= vocab_size):
            return (f"Trajectory.tokens has ids outside [0, {vocab_size}): "
                    f"range [{min(self.tokens)}, {max(self.tokens)}]")
        if self.loss_mask and self.loss_mask[0] == 1:
            return "Trajectory.loss_mask[0] is 1: the first token has no context to predict it"
        if cand_kind == "none":
            return None
        if self.cand_kind != cand_kind:
            return f"Trajectory.cand_kind is {self.cand_kind!r}; the loss needs {cand_kind!r}"
        offs, k = self.cand_offsets, len(self.cand_ids)
        if offs[0] != 0 or offs[-1] != k or any(b < a for a, b in zip(offs, offs[1:], strict=False)):
            return (f"Trajectory.cand_offsets must rise from 0 to len(cand_ids)={k}, "
                    f"got first={offs[0]}, last={offs[-1]}")
        if k and (min(self.cand_ids) < 0 or max(self.cand_ids) >= vocab_size):
            return f"Trajectory.cand_ids has ids outside [0, {vocab_size})"
        for t, (a, b) in enumerate(zip(offs, offs[1:], strict=False)):
            if len(set(self.cand_ids[a:b])) != b - a:
                return f"Trajectory.cand_ids repeats a token at generated position {t}"
        return None

    def sampling_error(self, cand_kind: str) -> str | None:
        """Why the trainer cannot score the trajectory as sampled (None if it can), from
        ``info["sampling"]`` and ``info["temperature"]`` (see the module docstring)."""
        entries = self.info.get("sampling") or []
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
        temp = self.info.get("temperature")
        if temp is not None and not (math.isfinite(float(temp)) and float(temp) > 0):
            return f"Trajectory.info['temperature'] must be > 0, got {temp}"
        return None

    def check(self, vocab_size: int, cand_kind: str) -> str | None:
        """The one verdict: why the trainer will drop this trajectory as malformed, or None."""
        return self.structure_error(vocab_size, cand_kind) or self.sampling_error(cand_kind)

    def screen(self, vocab_size: int, cand_kind: str) -> str | None:
        """``check``, computed once and kept in ``verdict`` (later calls read it)."""
        if self.verdict is None:
            self.verdict = self.check(vocab_size, cand_kind) or ""
        return self.verdict or None

    def to_dict(self) -> dict[str, Any]:
        """A plain dict of every field (JSON- and pickle-friendly)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trajectory:
        """The inverse of ``to_dict``."""
        return cls(**d)


def _positive(values: Iterable[float]) -> float:
    """The largest of ``values`` and 0.0 (NaN is not positive: it is masked and counted later)."""
    return max((v for v in values if v > 0), default=0.0)
