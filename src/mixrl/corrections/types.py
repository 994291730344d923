"""The typed input record of the loss (docs/corrections.md sections 1-2).

All per-token tensors are flattened over the generated (loss-masked) positions
of a batch, ``N`` of them; candidates of ``q`` (support or head) are ragged over
those positions, ``K`` in all, delimited by ``cand_offsets``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

CAND_KINDS = ("support", "head", "none")
_TOKEN_FLOAT = ("trainer_logprobs", "old_logprobs", "sampler_logprobs", "advantages")
_CAND_FLOAT = ("cand_trainer_logprobs", "cand_old_logprobs", "cand_sampler_logprobs")


@dataclass
class LossInputs:
    # N = generated (loss-masked) positions of the batch, flattened over trajectories
    """Everything the loss reads, flattened over the batch's generated positions (shapes in the comments)."""
    trainer_logprobs: Tensor  # [N] log p_θ(y_t) (p̃ when support replay is on); carries grad
    old_logprobs: (
        Tensor  # [N] log p_old(y_t), no grad (== trainer_logprobs.detach() at 1 step/batch)
    )
    sampler_logprobs: Tensor  # [N] log q(y_t)
    advantages: Tensor  # [N] per token (GRPO: the trajectory advantage broadcast)
    loss_mask: Tensor  # [N] bool, False for padding / excluded episodes
    seq_ids: Tensor  # [N] long, trajectory index 0..S-1
    num_seqs: int  # S
    cand_kind: str = "none"  # "support" | "head" | "none"
    cand_offsets: Tensor | None = (
        None  # [N+1] long, candidates of position t: offsets[t]:offsets[t+1]
    )
    cand_trainer_logprobs: Tensor | None = None  # [K] log p_θ(v) (p̃ with support replay), grad
    cand_old_logprobs: Tensor | None = None  # [K] log p_old(v), no grad
    cand_sampler_logprobs: Tensor | None = None  # [K] log q(v)
    entropy: Tensor | None = None  # [N] full-vocabulary entropy of p_θ, no grad needed
    group_ids: Tensor | None = None  # [N] long sampler-group index into group_names
    group_names: list[str] | None = None  # names of the sampler groups
    # [N] long, trainer version − token version (0 = sampled by the weights being
    # scored); negative = unknown. None: no precision/ vs lag/ split in the metrics.
    staleness: Tensor | None = None
    ref_logprobs: Tensor | None = None  # [N] log p_ref(y_t) of the initial policy (loss.ref_kl), no grad

    @property
    def num_tokens(self) -> int:
        """N: generated positions in the batch."""
        return int(self.trainer_logprobs.shape[0])

    @property
    def has_candidates(self) -> bool:
        """Whether candidates of q (support or head) were recorded."""
        return self.cand_kind != "none"

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field and both shapes on any inconsistency.

        Only shapes, dtypes and index ranges are checked; non-finite *values*
        are legal here (they are masked and counted by the loss, section 4).
        """
        n = self.num_tokens
        if self.trainer_logprobs.dim() != 1:
            raise ValueError(
                f"LossInputs.trainer_logprobs must be 1-D [N], got shape {tuple(self.trainer_logprobs.shape)}"
            )
        for name in _TOKEN_FLOAT:
            _check(name, getattr(self, name), (n,), float_=True)
        _check("loss_mask", self.loss_mask, (n,), dtype=torch.bool)
        _check("seq_ids", self.seq_ids, (n,), dtype=torch.long)
        if self.num_seqs < 0:
            raise ValueError(f"LossInputs.num_seqs must be >= 0, got {self.num_seqs}")
        if self.entropy is not None:
            _check("entropy", self.entropy, (n,), float_=True)
        if self.group_ids is not None:
            _check("group_ids", self.group_ids, (n,), dtype=torch.long)
            if self.group_names is None:
                raise ValueError("LossInputs.group_names is None but group_ids is given")
        if self.ref_logprobs is not None:
            _check("ref_logprobs", self.ref_logprobs, (n,), float_=True)
        if self.staleness is not None:
            _check("staleness", self.staleness, (n,), dtype=torch.long)
        if self.cand_kind not in CAND_KINDS:
            raise ValueError(
                f"LossInputs.cand_kind is {self.cand_kind!r}, expected one of {CAND_KINDS}"
            )
        if self.has_candidates:
            self._validate_candidates(n)
        self._validate_ranges(n)

    def _validate_candidates(self, n: int) -> None:
        if self.cand_offsets is None:
            raise ValueError(f"LossInputs.cand_offsets is None but cand_kind is {self.cand_kind!r}")
        _check("cand_offsets", self.cand_offsets, (n + 1,), dtype=torch.long)
        k = None
        for name in _CAND_FLOAT:
            t = getattr(self, name)
            if t is None:
                raise ValueError(f"LossInputs.{name} is None but cand_kind is {self.cand_kind!r}")
            k = t.shape[0] if k is None else k
            _check(name, t, (k,), float_=True, origin=" (K from cand_trainer_logprobs)")

    def _validate_ranges(self, n: int) -> None:
        # one host sync for all index checks
        checks = []
        if n:
            checks += [self.seq_ids.min(), self.seq_ids.max()]
            if self.group_ids is not None:
                checks += [self.group_ids.min(), self.group_ids.max()]
        if self.has_candidates:
            assert self.cand_offsets is not None
            checks += [self.cand_offsets[0], self.cand_offsets[-1]]
            checks += [
                (self.cand_offsets[1:] - self.cand_offsets[:-1]).min()
                if n
                else self.cand_offsets[0]
            ]
        if not checks:
            return
        vals = torch.stack([c.reshape(()) for c in checks]).tolist()
        if n:
            lo, hi = vals[0], vals[1]
            if lo < 0 or hi >= self.num_seqs:
                raise ValueError(
                    f"LossInputs.seq_ids range [{lo}, {hi}] is outside [0, num_seqs={self.num_seqs})"
                )
            if self.group_ids is not None:
                assert self.group_names is not None
                glo, ghi = vals[2], vals[3]
                if glo < 0 or ghi >= len(self.group_names):
                    raise ValueError(
                        f"LossInputs.group_ids range [{glo}, {ghi}] is outside "
                        f"[0, len(group_names)={len(self.group_names)})"
                    )
        if self.has_candidates:
            assert self.cand_trainer_logprobs is not None
            first, last, min_count = vals[-3], vals[-2], vals[-1]
            k = self.cand_trainer_logprobs.shape[0]
            if first != 0 or last != k or min_count < 0:
                raise ValueError(
                    f"LossInputs.cand_offsets must rise from 0 to K={k}, got first={first}, "
                    f"last={last}, smallest count={min_count}"
                )


def _check(
    name: str,
    t: Tensor | None,
    shape: tuple[int, ...],
    *,
    dtype: torch.dtype | None = None,
    float_: bool = False,
    origin: str = " (N from trainer_logprobs)",
) -> None:
    if t is None:
        raise ValueError(f"LossInputs.{name} is None, expected a tensor of shape {shape}")
    if not isinstance(t, Tensor):
        raise ValueError(f"LossInputs.{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ValueError(f"LossInputs.{name} has shape {tuple(t.shape)}, expected {shape}{origin}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"LossInputs.{name} has dtype {t.dtype}, expected {dtype}")
    if float_ and not t.is_floating_point():
        raise ValueError(f"LossInputs.{name} has dtype {t.dtype}, expected a floating dtype")
