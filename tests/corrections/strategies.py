"""Hypothesis strategies for loss configurations and small batches."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from mixrl.config.loss import (
    MIS,
    OPSM,
    TIS,
    CISPOObjective,
    GeoMask,
    GSPOObjective,
    LossConfig,
    PGObjective,
    PPOClipObjective,
    SeqMIS,
    SeqTIS,
    Veto,
)

token_rules = st.one_of(
    st.none(),
    st.builds(TIS, cap=st.sampled_from([0.8, 1.0, 2.0, float("inf")])),
    st.builds(
        MIS,
        lo=st.sampled_from([0.0, 0.2, 0.5, 0.9]),
        hi=st.sampled_from([1.1, 2.0, 5.0, float("inf")]),
    ),
)
seq_rules = st.one_of(
    st.none(),
    st.builds(SeqTIS, cap=st.sampled_from([0.5, 1.0, 5.0])),
    st.builds(SeqMIS, lo=st.sampled_from([0.1, 0.5]), hi=st.sampled_from([1.5, 2.0, 10.0])),
    st.builds(
        GeoMask,
        lo=st.sampled_from([0.5, 0.9]),
        hi=st.sampled_from([1.1, 2.0]),
        weight=st.sampled_from(["one", "ratio"]),
    ),
)
masks = st.lists(
    st.one_of(
        st.builds(Veto, tau=st.sampled_from([0.05, 0.3]), tau_hi=st.sampled_from([None, 3.0])),
        st.builds(OPSM, delta=st.sampled_from([0.0, 0.05])),
    ),
    max_size=2,
    unique_by=lambda c: c.type,
)
objectives = st.one_of(
    st.just(PGObjective()),
    st.builds(
        PPOClipObjective,
        eps_low=st.sampled_from([0.1, 0.2]),
        eps_high=st.sampled_from([0.2, 0.28]),
        dual_clip=st.sampled_from([None, 1.5, 3.0]),
    ),
    st.builds(
        GSPOObjective, eps_low=st.sampled_from([0.05, 0.3]), eps_high=st.sampled_from([0.05, 0.4])
    ),
    st.builds(
        CISPOObjective, eps_high=st.sampled_from([0.1, 0.3]), eps_low=st.sampled_from([None, 0.2])
    ),
)
aggregations = st.sampled_from(["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])


@st.composite
def loss_configs(
    draw, *, score_centering: bool | None = None, support_replay: bool = False
) -> LossConfig:
    """Any valid composition: one token weight or one sequence weight, plus masks (none with SC)."""
    tok = draw(token_rules)
    seq = None if tok is not None else draw(seq_rules)
    corr = [c for c in (tok, seq) if c is not None] + draw(masks)
    sc = draw(st.booleans()) if score_centering is None else score_centering
    obj = draw(objectives)
    if sc and obj.type == "gspo":
        obj = PGObjective()
    if sc:  # score centering rejects every per-sequence factor (docs/corrections.md section 12)
        corr = [c for c in corr if c.type in ("tis", "mis")]
    return LossConfig(
        objective=obj,
        corrections=corr,
        score_centering=sc,
        support_replay=support_replay,
        aggregation=draw(aggregations),
    )


lengths = st.lists(st.integers(1, 4), min_size=1, max_size=4)
seeds = st.integers(0, 2**31 - 1)

# applied per test, so other test suites keep their own hypothesis settings
SETTINGS = settings(
    max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
