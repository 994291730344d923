"""Typed configuration of the RL loss (docs/corrections.md sections 5-9).

No torch here: the command line validates a config before importing torch.

    objective      one of pg | ppo_clip | gspo | cispo              (section 5)
    corrections    a list of behaviour corrections, composed         (section 6)
    score_centering                                                  (section 7)
    support_replay the trainer's log-probs are renormalised on S_t   (section 3)
    aggregation    how the caller's denominator D is formed          (section 9)
    advantage      GRPO group normalisation                          (section 8)

Composition rule: at most one *token* importance weight (``tis`` or ``mis``)
and at most one *sequence* importance weight (``seq_tis``, ``seq_mis`` or
``geo_mask`` with ``weight="ratio"``), never one of each (the product would
count every token's ratio twice); masks (``geo_mask`` with ``weight="one"``,
``veto``, ``opsm``) compose freely with anything.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Strict(BaseModel):
    """Base: unknown keys are errors, NaN is never a valid number."""

    model_config = ConfigDict(extra="forbid")

    @field_validator("*", mode="after")
    @classmethod
    def _no_nan(cls, v: Any, info: Any) -> Any:
        if isinstance(v, float) and math.isnan(v):
            raise ValueError(f"{info.field_name} must be a number, got NaN")
        return v


def _check_range(name: str, lo: float, hi: float) -> None:
    if lo > hi:
        raise ValueError(f"{name}.lo={lo} must not exceed {name}.hi={hi}")


# --------------------------------------------------------------------- objectives (section 5)


class PGObjective(_Strict):
    """REINFORCE / bypass: ``g_t = A_t log p_θ(y_t)``; one optimizer step per batch."""

    type: Literal["pg"] = Field(default="pg", description="policy gradient (the seed's GRPO)")


class PPOClipObjective(_Strict):
    """PPO clip (arXiv 1707.06347 eq. 7), asymmetric bounds (DAPO), optional dual clip."""

    type: Literal["ppo_clip"] = Field(default="ppo_clip", description="clipped policy ratio")
    eps_low: float = Field(default=0.2, ge=0.0, lt=1.0, description="lower clip: r >= 1 - eps_low")
    eps_high: float = Field(
        default=0.2, ge=0.0, le=10.0, description="upper clip: r <= 1 + eps_high"
    )
    dual_clip: float | None = Field(
        default=None,
        gt=1.0,
        le=100.0,
        description="dual clip c (arXiv 1912.09729): g >= c*A for A < 0",
    )


class GSPOObjective(_Strict):
    """GSPO (arXiv 2507.18071): clip the length-normalised sequence ratio."""

    type: Literal["gspo"] = Field(default="gspo", description="sequence-level clipped ratio")
    eps_low: float = Field(default=3e-4, ge=0.0, lt=1.0, description="lower clip of s_i")
    eps_high: float = Field(default=4e-4, ge=0.0, le=10.0, description="upper clip of s_i")


class CISPOObjective(_Strict):
    """CISPO (arXiv 2506.13585): ``g_t = sg(clip(r_t)) A_t log p_θ(y_t)``; no token loses its gradient."""

    type: Literal["cispo"] = Field(default="cispo", description="clipped IS weight on the score")
    eps_high: float = Field(
        default=0.2, ge=0.0, le=10.0, description="upper clip of r: 1 + eps_high"
    )
    eps_low: float | None = Field(
        default=None, ge=0.0, lt=1.0, description="lower clip 1 - eps_low; None = none"
    )


Objective = Annotated[
    PGObjective | PPOClipObjective | GSPOObjective | CISPOObjective, Field(discriminator="type")
]

# --------------------------------------------------------------------- corrections (section 6)


class TIS(_Strict):
    """Token truncated IS: ``w_t = min(ρ_t, C)``."""

    type: Literal["tis"] = Field(default="tis", description="token truncated importance sampling")
    cap: float = Field(default=2.0, gt=0.0, description="truncation C (may be inf)")


class MIS(_Strict):
    """Token masked IS (IcePop is the same rule): ``w_t = ρ_t 1[lo <= ρ_t <= hi]``."""

    type: Literal["mis"] = Field(default="mis", description="token masked importance sampling")
    lo: float = Field(default=0.5, ge=0.0, description="lowest kept ratio")
    hi: float = Field(default=5.0, gt=0.0, description="highest kept ratio (may be inf)")

    @model_validator(mode="after")
    def _range(self) -> MIS:
        _check_range("mis", self.lo, self.hi)
        return self


class SeqTIS(_Strict):
    """Sequence truncated IS: ``w_i = min(ρ_i, C)`` on every token of i."""

    type: Literal["seq_tis"] = Field(default="seq_tis", description="sequence truncated IS")
    cap: float = Field(default=5.0, gt=0.0, description="truncation C of the sequence ratio")


class SeqMIS(_Strict):
    """Sequence masked IS: ``w_i = ρ_i 1[lo <= ρ_i <= hi]``."""

    type: Literal["seq_mis"] = Field(default="seq_mis", description="sequence masked IS")
    lo: float = Field(default=0.5, ge=0.0, description="lowest kept sequence ratio")
    hi: float = Field(default=2.0, gt=0.0, description="highest kept sequence ratio")

    @model_validator(mode="after")
    def _range(self) -> SeqMIS:
        _check_range("seq_mis", self.lo, self.hi)
        return self


class GeoMask(_Strict):
    """Keep sequence i only if ``lo <= ρ̄_i <= hi`` (geometric-mean ratio)."""

    type: Literal["geo_mask"] = Field(
        default="geo_mask", description="geometric-mean sequence mask"
    )
    lo: float = Field(default=0.99, ge=0.0, description="lowest kept geometric ratio")
    hi: float = Field(default=1.01, gt=0.0, description="highest kept geometric ratio")
    weight: Literal["one", "ratio"] = Field(
        default="one", description="weight of kept sequences: 1 or ρ̄_i"
    )

    @model_validator(mode="after")
    def _range(self) -> GeoMask:
        _check_range("geo_mask", self.lo, self.hi)
        return self


class Veto(_Strict):
    """Worst-token reject sampling: drop i if ``min_t ρ_t < tau`` (or ``max_t ρ_t > tau_hi``)."""

    type: Literal["veto"] = Field(
        default="veto", description="drop sequences with an extreme token ratio"
    )
    tau: float = Field(default=1e-4, gt=0.0, le=1.0, description="lowest tolerated token ratio")
    tau_hi: float | None = Field(
        default=None, ge=1.0, description="highest tolerated token ratio; None = no upper veto"
    )


class OPSM(_Strict):
    """DeepSeek-V3.2 off-policy sequence masking: drop i if ``A_i < 0`` and its mean k1 KL > δ."""

    type: Literal["opsm"] = Field(default="opsm", description="off-policy sequence masking")
    delta: float = Field(
        default=1e-4, ge=0.0, description="threshold on mean_t (log q - log p_old)"
    )


Correction = Annotated[
    TIS | MIS | SeqTIS | SeqMIS | GeoMask | Veto | OPSM, Field(discriminator="type")
]

TOKEN_WEIGHTS = ("tis", "mis")
SEQ_WEIGHTS = ("seq_tis", "seq_mis")
# everything that multiplies a token's loss by a per-sequence factor (incompatible with SC)
SEQ_FACTORS = ("seq_tis", "seq_mis", "geo_mask", "veto", "opsm")

# --------------------------------------------------------------------- the loss


class AdvantageConfig(_Strict):
    """GRPO advantages ``(R - mean_g R) / (std_g R + eps)`` (section 8)."""

    use_std: bool = Field(default=True, description="divide by the group std (False: Dr. GRPO)")
    eps: float = Field(default=1e-6, gt=0.0, le=1.0, description="added to the std")


Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]


class RefKL(_Strict):
    """KL penalty against the initial policy (section 13): ``coef · KL`` with a k1 or k3 estimator."""

    coef: float = Field(default=..., gt=0.0, le=100.0, description="weight of the penalty")
    estimator: Literal["k1", "k3"] = Field(
        default="k3", description="k3: GRPO's low-variance form; k1: score-function form of KL(p_θ‖p_ref)"
    )


class LossConfig(_Strict):
    """The whole loss: objective, composed behaviour corrections, SC, replay, aggregation."""

    objective: Objective = Field(
        default_factory=PGObjective, description="base objective (section 5)"
    )
    corrections: list[Correction] = Field(
        default_factory=list, max_length=7, description="behaviour corrections (section 6), composed"
    )
    score_centering: bool = Field(
        default=False, description="subtract E_q of the weighted score (section 7)"
    )
    tail_eps: float = Field(
        default=1e-6, gt=0.0, le=0.5, description="clamp of 1-p(H), 1-q(H) in the tail model"
    )
    support_replay: bool = Field(
        default=False, description="trainer log-probs renormalised on the support (section 3)"
    )
    routing_replay: bool = Field(
        default=False, description="MoE: the trainer's routers use the sampler's recorded top-k experts"
    )
    aggregation: Aggregation = Field(
        default="token_mean", description="denominator convention (section 9)"
    )
    advantage: AdvantageConfig = Field(
        default_factory=AdvantageConfig, description="GRPO advantages"
    )
    ref_kl: RefKL | None = Field(
        default=None, description="KL penalty against the initial policy; None = off (section 13)"
    )
    entropy_coef: float = Field(
        default=0.0, ge=0.0, le=10.0, description="entropy bonus weight; 0 = off (section 13)"
    )
    # e^(2c) must stay below float32's 3.4e38 (Σw² of corr/ess): c <= 44; 40 leaves margin
    log_ratio_clamp: float = Field(
        default=20.0, gt=0.0, le=40.0, description="clamp of log-ratios before exp"
    )

    @model_validator(mode="after")
    def _compose(self) -> LossConfig:
        kinds = [c.type for c in self.corrections]
        for k in set(kinds):
            if kinds.count(k) > 1:
                raise ValueError(f"corrections lists {k!r} {kinds.count(k)} times; give it once")
        tok = [k for k in kinds if k in TOKEN_WEIGHTS]
        seq = [c.type for c in self.corrections if c.type in SEQ_WEIGHTS]
        seq += [c.type for c in self.corrections if isinstance(c, GeoMask) and c.weight == "ratio"]
        if len(tok) > 1:
            raise ValueError(f"corrections has two token weights {tok}; choose one of tis/mis")
        if len(seq) > 1:
            raise ValueError(f"corrections has two sequence weights {seq}; choose one")
        if tok and seq:
            raise ValueError(
                f"corrections combines token weight {tok[0]!r} with sequence weight {seq[0]!r}: "
                "the product counts every token ratio twice"
            )
        seq_factor = [c.type for c in self.corrections if c.type in SEQ_FACTORS]
        if self.score_centering and seq_factor:
            raise ValueError(
                f"loss.score_centering=True with loss.corrections {seq_factor[0]!r}: the centering "
                "term would be multiplied by a sequence factor that depends on the sampled token "
                "(drift returns); set score_centering=False or use a token correction (mis, tis)"
            )
        if self.score_centering and self.objective.type == "gspo":
            raise ValueError(
                "score_centering is defined for token objectives (pg, ppo_clip, cispo), not gspo"
            )
        return self

    def token_weight(self) -> TIS | MIS | None:
        """The token-level weight rule (used by SC for w(v)), or None."""
        for c in self.corrections:
            if isinstance(c, TIS | MIS):
                return c
        return None
