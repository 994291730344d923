"""The metric names the study reads (``metrics.jsonl``, docs/corrections.md): one place, so a
renamed metric is a one-line change here.

Per sampler group a metric is ``<name>/<group>``; ``precision/`` covers staleness-0 tokens
(the samplers' numerics), ``lag/`` stale tokens (policy lag), ``mismatch/`` both.
"""

REWARD = "rollout/reward"
LENGTH = "rollout/length"
FORMAT_END = "rollout/format_error_end"  # share of episodes ended by repeated format errors
EMPTY_END = "rollout/empty_last_reply"  # share of episodes whose last reply is empty
CLIPPED = "rollout/clipped_frac"  # share of episodes cut at max_new_tokens or the token budget
STALENESS = "rollout/staleness_mean"
STALENESS_MAX = "rollout/staleness_max"
GRAD_NORM = "optim/grad_norm"
ENTROPY = "policy/entropy"
COST = "cost/cumulative"
TIME = "time"

PRECISION, LAG, MISMATCH, SHARE = "precision", "lag", "mismatch", "share"
KL_EXACT, KL_K3, RATIO_OOB, TOKENS = "kl_exact", "kl_k3", "ratio_oob", "tokens"
SAMPLE_SHARE = "share/samples"  # per group: its share of the step's samples


def split(name: str, stat: str) -> str:
    """``split("precision", "kl_k3")`` -> ``"precision/kl_k3"``."""
    return f"{name}/{stat}"


# The KL a run is read by, first present wins: exact where the support was recorded, else k3;
# ``mismatch/`` only for metrics written before the precision / lag split.
PRECISION_KL = tuple(split(s, e) for s in (PRECISION, MISMATCH) for e in (KL_EXACT, KL_K3))
LAG_KL = tuple(split(LAG, e) for e in (KL_EXACT, KL_K3))
PRECISION_OOB = split(PRECISION, RATIO_OOB)
LAG_OOB = split(LAG, RATIO_OOB)
