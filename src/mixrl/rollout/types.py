"""The record that crosses every boundary: one trajectory, aligned per token.

A trajectory is a whole (possibly multi-turn) episode. ``tokens`` is exactly the
concatenation of prompt, generated and tool-output tokens, never re-tokenized.
Per-token fields are aligned with ``tokens``; sampler fields are meaningful only
where ``loss_mask == 1``. Candidates (support or head of q) are ragged over the
generated tokens only, in order.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

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
LOGPROB_TOL = 1e-6  # largest positive log-probability accepted as float rounding


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

    @property
    def num_generated(self) -> int:
        """Tokens the model generated (the loss mask's ones)."""
        return sum(self.loss_mask)

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
        # a log-probability is <= 0; a positive one means a broken sampler record (1e-6: rounding)
        worst = max((lp for lp, m in zip(self.sampler_logprobs, self.loss_mask, strict=True) if m),
                    default=0.0)
        worst = max([worst, *self.cand_logprobs])
        if worst > LOGPROB_TOL:
            raise ValueError(f"Trajectory.sampler_logprobs / cand_logprobs has a positive log-probability "
                             f"({worst:.3g}): log q must be <= 0")
        if self.status not in STATUSES:
            raise ValueError(f"Trajectory.status {self.status!r} is not one of {STATUSES}")

    def to_dict(self) -> dict[str, Any]:
        """A plain dict of every field (JSON- and pickle-friendly)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trajectory:
        """The inverse of ``to_dict``."""
        return cls(**d)
