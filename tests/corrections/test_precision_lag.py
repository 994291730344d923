"""Precision vs lag: the mismatch metrics split by token staleness, against float64 loops.

Also the counters of what the ±clamp does (``corr/clamped_tokens``) and the
overflow-free ``corr/ess`` (docs/corrections.md sections 4 and 10).
"""

from __future__ import annotations

import math

import pytest
import torch

from corrections.reference import make_batch, to_inputs
from mixrl.config.loss import MIS, LossConfig
from mixrl.corrections import compute_loss
from mixrl.corrections.metrics import mismatch_metrics

KEYS = ("kl_k1", "kl_k3", "kl_exact", "tv", "ratio_oob")


def _ref(b, inp, keep) -> dict[str, float]:
    """Means over the kept positions by explicit loops, in float64 probability space."""
    p_old, q = b.p_old().detach(), b.q().detach()
    vals: dict[str, list[float]] = {k: [] for k in KEYS}
    for t in range(p_old.shape[0]):
        if not keep[t]:
            continue
        y = int(b.y[t])
        rho = float(p_old[t, y] / q[t, y])
        vals["kl_k1"].append(math.log(q[t, y]) - math.log(p_old[t, y]))
        vals["kl_k3"].append(rho - 1 - math.log(rho))
        vals["tv"].append(0.5 * abs(1 - rho))
        vals["ratio_oob"].append(float(rho < 0.2 or rho > 5))
        vals["kl_exact"].append(sum(float(q[t, v] * math.log(q[t, v] / p_old[t, v]))
                                    for v in range(q.shape[1]) if q[t, v] > 0))
    out = {k: sum(v) / len(v) for k, v in vals.items() if v}
    out["tokens"] = float(sum(bool(k) for k in keep))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_split_by_staleness_matches_loops(seed):
    b = make_batch(seed, [3, 4, 2, 5], 7, mismatch=0.8, top_p=0.95)
    inp = to_inputs(b, "support")
    g = torch.Generator().manual_seed(seed)
    st = torch.randint(-1, 3, (inp.num_tokens,), generator=g)  # -1 unknown, 0 fresh, 1-2 stale
    st[0], st[1] = 0, 2  # both splits non-empty
    inp.staleness = st
    m = mismatch_metrics(inp)
    names = b.group_names
    for split, keep in (("precision", st == 0), ("lag", st > 0)):
        ref = _ref(b, inp, keep.tolist())
        for k, v in ref.items():
            assert m[f"{split}/{k}"] == pytest.approx(v, rel=1e-9, abs=1e-12), (split, k)
        for gi, gname in enumerate(names):
            gk = (keep & (b.groups == gi)).tolist()
            ref_g = _ref(b, inp, gk)
            assert m[f"{split}/tokens/{gname}"] == ref_g["tokens"]
            for k in KEYS:
                key = f"{split}/{k}/{gname}"
                if ref_g["tokens"] == 0:
                    assert key not in m  # a mean over nothing is left out, not written as 0
                else:
                    assert m[key] == pytest.approx(ref_g[k], rel=1e-9, abs=1e-12), key
    # the plain mismatch/ metrics still cover every token, unknown versions included
    all_ref = _ref(b, inp, [True] * inp.num_tokens)
    assert m["mismatch/kl_k3"] == pytest.approx(all_ref["kl_k3"], rel=1e-9)


def test_no_staleness_no_split_and_empty_split_left_out():
    b = make_batch(3, [3, 3], 5)
    inp = to_inputs(b)
    assert not any(k.startswith(("precision/", "lag/")) for k in mismatch_metrics(inp))
    inp.staleness = torch.zeros(inp.num_tokens, dtype=torch.long)  # sync run: nothing is stale
    m = mismatch_metrics(inp)
    assert m["lag/tokens"] == 0 and "lag/kl_k3" not in m
    assert m["precision/kl_k3"] == pytest.approx(m["mismatch/kl_k3"], rel=1e-12)
    assert m["precision/tokens"] == inp.num_tokens


def test_clamped_tokens_counted_and_ess_finite_at_the_bound():
    b = make_batch(4, [4, 4], 6)
    inp = to_inputs(b)
    inp.old_logprobs = inp.old_logprobs.clone()
    inp.trainer_logprobs = inp.trainer_logprobs.detach().clone()
    inp.sampler_logprobs = inp.sampler_logprobs.clone()
    inp.sampler_logprobs[2] = inp.old_logprobs[2] - 25.0  # log ρ = 25 > 20: clamped
    inp.sampler_logprobs[5] = inp.old_logprobs[5] + 21.0  # log ρ = -21: clamped
    inp.trainer_logprobs.requires_grad_()
    _, m = compute_loss(inp, LossConfig(), 8.0)
    assert m["corr/clamped_tokens"] == 2.0
    assert m["mismatch/log_ratio_max"] == pytest.approx(25.0, rel=1e-6)
    # every weight at e^40 (the largest clamp allowed): Σw² = 8192·e^80 > 3.4e38 overflows
    # float32 unless the weights are scaled first
    n = 8192
    f32 = dict(dtype=torch.float32)
    lq = torch.full((n,), -45.0, **f32)
    lp = torch.zeros(n, **f32, requires_grad=True)
    from mixrl.corrections import LossInputs

    big = LossInputs(trainer_logprobs=lp, old_logprobs=lp.detach().clone(), sampler_logprobs=lq,
                     advantages=torch.ones(n, **f32), loss_mask=torch.ones(n, dtype=torch.bool),
                     seq_ids=torch.arange(n), num_seqs=n)
    cfg = LossConfig(corrections=[MIS(lo=0.0, hi=math.inf)], log_ratio_clamp=40.0)
    _, m = compute_loss(big, cfg, float(n))
    assert m["corr/ess"] == pytest.approx(1.0, rel=1e-5)  # equal weights: ESS 1
    assert m["corr/clamped_tokens"] == n


def test_collapse_monitor_reads_the_precision_kl():
    from mixrl.telemetry.monitor import CollapseMonitor, MonitorConfig

    mon = CollapseMonitor(MonitorConfig(early_steps=2, warmup_steps=0))
    mon.update(1, {"precision/kl_exact": 1e-3, "mismatch/kl_exact": 5e-3, "rollout/reward": 0.5})
    assert mon.kl_key == "precision/kl_exact" and mon.kl_ema == 1e-3
    mon.update(2, {"mismatch/kl_exact": 9e-3, "rollout/reward": 0.5})  # no staleness-0 token this step
    assert mon.kl_ema == 1e-3  # policy lag alone never moves the precision signal
    old = CollapseMonitor()
    old.update(1, {"mismatch/kl_k3": 2e-3})  # metrics written without the split
    assert old.kl_key == "mismatch/kl_k3"
