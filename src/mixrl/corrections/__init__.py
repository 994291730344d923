"""mixrl.corrections: pure tensor math of the off-policy corrections (docs/corrections.md).

No processes, ranks or Ray here: every function maps tensors to tensors.

    types        LossInputs, the typed input record of the loss
    ratios       log-space ratios (±20 clamp) and segment reductions over seq_ids
    behaviour    tis, mis (IcePop), seq_tis, seq_mis, geo_mask, veto, opsm    (section 6)
    objectives   pg, ppo_clip (+dual clip), gspo, cispo                      (section 5)
    centering    score centering, exact on a support or head + modelled tail  (section 7)
    replay       support (top-p/top-k) mask replay reference                 (section 3)
    advantages   GRPO group advantages, infra failures excluded              (section 8)
    aggregation  the caller's denominator D                                  (section 9)
    metrics      mismatch metrics, per sampler group                         (section 10)
    loss         compute_loss: everything above assembled

Adding a behaviour correction: a config class in ``mixrl.config.loss`` (added to
the ``Correction`` union) and a rule in ``behaviour.RULES``. Adding an
objective: a config class in the ``Objective`` union and an entry in
``objectives.OBJECTIVES``. Then a hand-computed and a brute-force test in
``tests/corrections``.
"""

from mixrl.corrections.advantages import GroupAdvantages, grpo_advantages
from mixrl.corrections.aggregation import AGGREGATIONS, aggregation_denominator
from mixrl.corrections.behaviour import Behaviour, apply_corrections, token_rule_weight
from mixrl.corrections.centering import centering_coefficients, centering_term
from mixrl.corrections.loss import compute_loss
from mixrl.corrections.metrics import GROUP_METRICS, group_means, masked_mean, mismatch_metrics
from mixrl.corrections.objectives import ObjectiveInputs, surrogate
from mixrl.corrections.ratios import LOG_RATIO_CLAMP, candidate_positions, ratio, seq_log_ratio
from mixrl.corrections.replay import gather_candidates, replay_logprobs
from mixrl.corrections.types import LossInputs

__all__ = [
    "AGGREGATIONS",
    "GROUP_METRICS",
    "LOG_RATIO_CLAMP",
    "Behaviour",
    "GroupAdvantages",
    "LossInputs",
    "ObjectiveInputs",
    "aggregation_denominator",
    "apply_corrections",
    "candidate_positions",
    "centering_coefficients",
    "centering_term",
    "compute_loss",
    "gather_candidates",
    "group_means",
    "grpo_advantages",
    "masked_mean",
    "mismatch_metrics",
    "ratio",
    "replay_logprobs",
    "seq_log_ratio",
    "surrogate",
    "token_rule_weight",
]
