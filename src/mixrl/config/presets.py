"""Named correction arms: a loss configuration plus how the sampler must sample.

The seed's six arms are ``grpo``, ``grpo+mis``, ``sc``, ``grpo+top-p``,
``sc+mis`` and ``sc+mis+top-p`` (MIS range [0.2, 5]); the others use the
defaults of docs/corrections.md section 6. The study's two reference arms,
``on-policy`` (FP32 sampler, sync: no mismatch) and ``fp16`` (sampler and trainer
in FP16), are GRPO whose fleet, mode and trainer precision ``mixrl compare`` sets
(``fleet_profile``, ``mode``, ``trainer_precision``). A ``+top-p`` arm samples inside the
top-p set and replays that support in the trainer (exact SC); a full-vocabulary
SC arm records the head of ``q`` and models the tail (section 7).

What a loss needs from the run (:func:`needs`, one row per preset in
``REQUIREMENTS``) is the single source of the guard rails: :func:`check_run`
rejects every run setting that would make the loss silently wrong or a no-op
(docs/corrections.md section 12), the trainer takes its candidate kind and its
updates rule (:func:`check_updates`) from it, and the run screens trajectories
for that candidate kind::

    needs         candidates   sampler top-p   ratio objective   updates per batch
    grpo          none         = 1             no (pg)           1
    sc            head         = 1             no (pg)           1
    grpo+top-p    support      < 1             no (pg)           1
    decoupled-ppo none         = 1             yes (ppo_clip)    any

To add a preset: add one entry to ``PRESETS`` below; ``tests/corrections``
constructs every entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mixrl.config.loss import (
    MIS,
    OPSM,
    TIS,
    AdvantageConfig,
    GeoMask,
    GSPOObjective,
    LossConfig,
    PGObjective,
    PPOClipObjective,
    SeqMIS,
    Veto,
)
from mixrl.records.generation import parse_record

# candidates of q recorded per token when sampling the full vocabulary (record "head:K")
HEAD_K = 64

SEED_TOP_P = 0.9  # the "+top-p" arms' nucleus
SEED_MIS = MIS(lo=0.2, hi=5.0)  # the seed's MIS range
TRL_CLIP = PPOClipObjective(eps_low=0.2, eps_high=0.2)  # TRL: epsilon, epsilon_high
VERL_CLIP = PPOClipObjective(eps_low=0.2, eps_high=0.2, dual_clip=3.0)  # verl: clip_ratio_low/high, clip_ratio_c


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
        default=HEAD_K, ge=1, le=4096, description="head size of q recorded for full-vocabulary SC"
    )
    # Reference arms of the study fix the numerics, not only the loss: ``mixrl compare``
    # replaces the fleet by one group of this profile (same replicas), the scheduling
    # mode and the trainer precision. None: the study's fleet / the base config's value.
    fleet_profile: str | None = Field(
        default=None, description="study arms: every sampler group uses this profile"
    )
    mode: Literal["async", "sync"] | None = Field(
        default=None, description="study arms: runtime.mode the arm needs"
    )
    trainer_precision: Literal["fp32", "bf16", "fp16"] | None = Field(
        default=None, description="study arms: optim.precision the arm needs"
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
        """What the sampler must record per token: 'support', 'head' or 'none' (:func:`needs`)."""
        return needs(self.loss).cand_kind


def _p(name: str, description: str, top_p: float = 1.0, run: dict[str, str] | None = None,
       **loss: object) -> Preset:
    return Preset(name=name, description=description, loss=LossConfig(**loss), sampler_top_p=top_p,  # type: ignore[arg-type]
                  **(run or {}))


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
    # The study's references: no mismatch at all, and 16-bit floats on both sides.
    _p("on-policy", "GRPO, FP32 sampler with the trainer's numerics, sync: zero mismatch",
       run={"fleet_profile": "fp32", "mode": "sync", "trainer_precision": "fp32"}),
    _p("fp16", "GRPO with sampler and trainer in FP16 (weights, activations, KV)",
       run={"fleet_profile": "fp16", "trainer_precision": "fp16"}),
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
    # Other frameworks' defaults (docs/migrating.md): TRL 1.9 GRPOConfig, verl 0.7 ppo_trainer.yaml
    # with algorithm.adv_estimator=grpo. Both clip the policy ratio, so epochs/minibatches > 1 work.
    _p("trl-grpo", "TRL GRPOTrainer defaults: PPO clip 0.2, token mean over the batch, std + 1e-4",
       objective=TRL_CLIP, advantage=AdvantageConfig(eps=1e-4)),
    _p("trl-grpo+vllm", "trl-grpo with TRL's vLLM correction: sequence ratio masked above 3",
       objective=TRL_CLIP, advantage=AdvantageConfig(eps=1e-4), corrections=[SeqMIS(lo=0.0, hi=3.0)]),
    _p("verl-grpo", "verl GRPO defaults: PPO clip 0.2, dual clip 3, token mean, std + 1e-6",
       objective=VERL_CLIP),
    _p("verl-grpo+tis", "verl-grpo with rollout_is=token: token ratio truncated at 2",
       objective=VERL_CLIP, corrections=[TIS(cap=2.0)]),
]
PRESETS: dict[str, Preset] = {p.name: p for p in _ALL}
SEED_ARMS: tuple[str, ...] = ("grpo", "grpo+mis", "sc", "grpo+top-p", "sc+mis", "sc+mis+top-p")
REFERENCE_ARMS: tuple[str, ...] = ("on-policy", "fp16")  # fixed numerics: one run per seed, not per fleet
assert all(isinstance(p.loss.objective, PGObjective) for n, p in PRESETS.items() if n in SEED_ARMS)


def get_preset(name: str) -> Preset:
    """A deep copy of the named preset; unknown names raise ``ValueError`` listing the valid ones."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; valid presets: {', '.join(PRESETS)}")
    return PRESETS[name].model_copy(deep=True)


# --------------------------------------------------------------------- what a loss needs


@dataclass(frozen=True)
class Needs:
    """What a loss requires of the sampler and the optimizer (docs/corrections.md section 12)."""

    cand_kind: str  # candidates of q recorded per token: "support" | "head" | "none"
    top_p: str  # sampler nucleus: "<1" (support replay) or "=1" (full vocabulary)
    ratio_objective: bool  # the objective has a policy ratio p_θ/p_old (not pg)
    single_update: bool  # defined only for one optimizer step per batch


def needs(loss: LossConfig) -> Needs:
    """The row of the guard-rail table for ``loss``."""
    kind = "support" if loss.support_replay else ("head" if loss.score_centering else "none")
    ratio = loss.objective.type != "pg"
    return Needs(kind, "<1" if loss.support_replay else "=1", ratio,
                 single_update=loss.score_centering or not ratio)


REQUIREMENTS: dict[str, Needs] = {n: needs(p.loss) for n, p in PRESETS.items()}


def check_run(loss: LossConfig, *, preset: str, top_p: float, record: str,
              epochs: int = 1, minibatches: int = 1) -> None:
    """Raise ``ValueError`` (one line: both fields and the fix) if the run cannot train ``loss``.

    ``top_p`` and ``record`` are the resolved sampler settings (``Derived``).
    """
    n = needs(loss)
    arm = f"loss.preset={preset!r}"
    if n.top_p == "<1" and top_p >= 1.0:
        raise ValueError(f"rollout.top_p={top_p} with {arm}: support replay needs top-p sampling; "
                         "set rollout.top_p < 1 or choose a preset without support replay")
    if n.top_p == "=1" and top_p < 1.0:
        what = ("head+tail score centering needs full-vocabulary sampling" if n.cand_kind == "head"
                else "without support replay every ratio is biased by the log of the kept top-p mass")
        raise ValueError(f"rollout.top_p={top_p} with {arm}: {what}; set rollout.top_p=1.0 "
                         "or use a '+top-p' preset (support replay)")
    rec_kind = record if record == "auto" else parse_record(record)[0]
    if n.cand_kind != "none" and rec_kind != n.cand_kind:
        want = "'support'" if n.cand_kind == "support" else "'head:K' (or 'auto')"
        raise ValueError(f"rollout.record={record!r} with {arm}: the loss needs the {n.cand_kind} of q "
                         f"recorded per token (every trajectory would be dropped); set rollout.record={want}")
    check_updates(loss, epochs, minibatches, arm=arm)


def check_updates(loss: LossConfig, epochs: int, minibatches: int = 1, *, arm: str = "") -> None:
    """Raise ``ValueError`` if ``loss`` is undefined for ``epochs`` × ``minibatches`` optimizer
    steps per batch (``needs(loss).single_update``); ``arm`` names the preset in the message.

    Score centering and the ``pg`` objective assume ``p_θ == p_old`` where the gradient is
    taken (one step per batch, section 7); with several steps per batch they would silently
    drop the policy ratio, so they are errors, not guesses."""
    for name, n in (("optim.epochs", epochs), ("optim.minibatches", minibatches)):
        if n < 1:
            raise ValueError(f"{name} must be >= 1, got {n}")
    if epochs * minibatches == 1 or not needs(loss).single_update:
        return
    field, value = ("optim.epochs", epochs) if epochs > 1 else ("optim.minibatches", minibatches)
    if loss.score_centering:
        why = "score centering (loss.score_centering=True) needs p_θ == p_old where the gradient is taken"
        fix = f"set {field}=1"
    else:
        why = "the pg objective has no policy ratio, so later updates take uncorrected off-policy steps"
        fix = f"set {field}=1 or loss.overrides.objective={{type=\"ppo_clip\"}}"
    where = f" with {arm}" if arm else ""
    raise ValueError(f"{field}={value}{where} (loss.objective.type={loss.objective.type!r}): {why}; {fix}")
