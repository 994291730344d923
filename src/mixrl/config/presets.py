"""Named correction arms: a loss configuration plus how the sampler must sample.

The seed's six arms are ``grpo``, ``grpo+mis``, ``sc``, ``grpo+top-p``,
``sc+mis`` and ``sc+mis+top-p`` (MIS range [0.2, 5]); the others use the
defaults of CORRECTIONS.md section 6. A ``+top-p`` arm samples inside the
top-p set and replays that support in the trainer (exact SC); a full-vocabulary
SC arm records the head of ``q`` and models the tail (section 7).

To add a preset: add one entry to ``PRESETS`` below; ``tests/corrections``
constructs every entry.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mixrl.config.loss import (
    MIS,
    OPSM,
    TIS,
    GeoMask,
    GSPOObjective,
    LossConfig,
    PGObjective,
    PPOClipObjective,
    SeqMIS,
    Veto,
)

SEED_TOP_P = 0.9  # the "+top-p" arms' nucleus
SEED_MIS = MIS(lo=0.2, hi=5.0)  # the seed's MIS range


class Preset(BaseModel):
    """A named arm: the loss and the sampling it requires."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(default=..., min_length=1, description="the arm's name")
    description: str = Field(default="", description="one line on what the arm does")
    loss: LossConfig = Field(default_factory=LossConfig, description="the loss of the arm")
    sampler_top_p: float = Field(
        default=1.0, gt=0.0, le=1.0, description="sampler nucleus; 1.0 = full vocabulary"
    )
    head_k: int = Field(
        default=64, ge=1, le=4096, description="head size of q recorded for full-vocabulary SC"
    )

    @model_validator(mode="after")
    def _sampling(self) -> Preset:
        if self.loss.support_replay and self.sampler_top_p >= 1.0:
            raise ValueError(f"preset {self.name!r}: support_replay needs sampler_top_p < 1")
        if self.sampler_top_p < 1.0 and self.loss.score_centering and not self.loss.support_replay:
            raise ValueError(
                f"preset {self.name!r}: head+tail score centering needs full-vocabulary sampling "
                "(sampler_top_p=1) or support_replay=True"
            )
        return self

    @property
    def cand_kind(self) -> str:
        """What the sampler must record per token: 'support', 'head' or 'none'."""
        if self.loss.support_replay:
            return "support"
        return "head" if self.loss.score_centering else "none"


def _p(name: str, description: str, top_p: float = 1.0, **loss: object) -> Preset:
    return Preset(name=name, description=description, loss=LossConfig(**loss), sampler_top_p=top_p)  # type: ignore[arg-type]


_ALL = [
    _p("grpo", "policy gradient, no correction"),
    _p("grpo+mis", "token masked IS in [0.2, 5]", corrections=[SEED_MIS]),
    _p("sc", "score centering, head + modelled tail", score_centering=True),
    _p("grpo+top-p", "top-p sampling with support replay", SEED_TOP_P, support_replay=True),
    _p("sc+mis", "SC over MIS weights, head + tail", corrections=[SEED_MIS], score_centering=True),
    _p(
        "sc+mis+top-p",
        "SC over MIS weights, exact on the replayed top-p support",
        SEED_TOP_P,
        corrections=[SEED_MIS],
        score_centering=True,
        support_replay=True,
    ),
    _p("tis", "token truncated IS, C = 2", corrections=[TIS(cap=2.0)]),
    _p("icepop", "IcePop: token masked IS in [0.5, 5]", corrections=[MIS(lo=0.5, hi=5.0)]),
    _p("seq-mis", "sequence masked IS in [0.5, 2]", corrections=[SeqMIS(lo=0.5, hi=2.0)]),
    _p("geo-mask", "geometric sequence mask [0.99, 1.01]", corrections=[GeoMask(lo=0.99, hi=1.01)]),
    _p("veto", "drop sequences with a token ratio < 1e-4", corrections=[Veto(tau=1e-4)]),
    _p("opsm", "off-policy sequence masking, delta = 1e-4", corrections=[OPSM(delta=1e-4)]),
    _p("gspo", "GSPO sequence-ratio clipping", objective=GSPOObjective()),
    _p(
        "decoupled-ppo",
        "PPO clip against p_old with a truncated behaviour weight p_old/q (C = 2)",
        objective=PPOClipObjective(eps_low=0.2, eps_high=0.2),
        corrections=[TIS(cap=2.0)],
    ),
]
PRESETS: dict[str, Preset] = {p.name: p for p in _ALL}
SEED_ARMS: tuple[str, ...] = ("grpo", "grpo+mis", "sc", "grpo+top-p", "sc+mis", "sc+mis+top-p")
assert all(isinstance(p.loss.objective, PGObjective) for n, p in PRESETS.items() if n in SEED_ARMS)


def get_preset(name: str) -> Preset:
    """A deep copy of the named preset; unknown names raise ``ValueError`` listing the valid ones."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; valid presets: {', '.join(PRESETS)}")
    return PRESETS[name].model_copy(deep=True)
