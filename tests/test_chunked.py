"""Chunked log-probs equal the naive full-logits computation (CORRECTIONS.md §11 property 8).

Reference: brute force over the whole vocabulary with ``log_softmax`` and a dense
support mask, differentiated by autograd. Gradients are compared through a
random linear functional of every output, so every output's backward counts.
"""

from __future__ import annotations

import pytest
import torch

from mixrl.models.chunked import chunked_logprobs, naive_logprobs

torch.set_num_threads(1)

TOL = {torch.float64: dict(rtol=1e-9, atol=1e-11), torch.float32: dict(rtol=2e-4, atol=2e-5)}


def assert_close(a, b, dtype):
    torch.testing.assert_close(a, b, **TOL[dtype])


def make_problem(dtype, n=9, v=13, d=6, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g, dtype=dtype) * 1.5
    w = torch.randn(v, d, generator=g, dtype=dtype)
    b = torch.randn(v, generator=g, dtype=dtype) if bias else None
    y = torch.randint(0, v, (n,), generator=g)
    t = 0.5 + torch.rand(n, generator=g, dtype=torch.float64)  # per-position temperature
    return h, w, b, y, t


def make_cands(y, v, seed=0, include_y=True, empty_row=None, missing_row=None):
    """Ragged unique candidates per position; optionally a row without y and an empty row."""
    g = torch.Generator().manual_seed(seed + 1)
    offs, ids = [0], []
    for r, yr in enumerate(y.tolist()):
        k = int(torch.randint(1, v // 2, (1,), generator=g))
        perm = torch.randperm(v, generator=g)[:k].tolist()
        if include_y and r != missing_row and yr not in perm:
            perm[0] = yr
        if r == missing_row:
            perm = [c for c in perm if c != yr] or [(yr + 1) % v]
        if r == empty_row:
            perm = []
        ids += perm
        offs.append(len(ids))
    return torch.tensor(offs), torch.tensor(ids, dtype=torch.long)


def reference(h, w, b, y, t, kind, offs, ids, replay):
    """Float brute force: dense [N, V] logits, log_softmax and a dense support mask."""
    n, v = h.shape[0], w.shape[0]
    s = torch.nn.functional.linear(h, w, b) / t.to(h.dtype)[:, None]  # [N, V]
    logp = torch.log_softmax(s, -1)
    ent = -(logp.exp() * logp).sum(-1).detach()
    rows = torch.repeat_interleave(torch.arange(n), offs.diff())
    mask = torch.zeros(n, v, dtype=torch.bool)
    mask[rows, ids] = True
    has = mask.any(-1)
    lse_s = torch.logsumexp(s.masked_fill(~mask, -torch.inf), -1)
    lse_s = torch.where(has, lse_s, torch.zeros_like(lse_s))  # keep empty rows NaN-free
    lp = logp.gather(1, y[:, None]).squeeze(1)
    if kind == "support" and replay:
        in_s = mask.gather(1, y[:, None]).squeeze(1)
        lp = torch.where(in_s, s.gather(1, y[:, None]).squeeze(1) - lse_s, -torch.inf)
    if kind == "support":
        clp = s[rows, ids] - lse_s[rows]
    elif kind == "head":
        clp = logp[rows, ids]
    else:
        clp = s.new_zeros(0)
    return lp, ent, clp


def run_both(dtype, kind, replay=True, chunk=4, bias=True, use_lp=True, use_c=True, **cand_kw):
    h, w, b, y, t = make_problem(dtype, bias=bias)
    offs, ids = make_cands(y, w.shape[0], **cand_kw) if kind != "none" else (None, None)
    g = torch.Generator().manual_seed(7)
    a_lp = torch.randn(h.shape[0], generator=g, dtype=dtype)
    a_c = torch.randn(0 if ids is None else ids.numel(), generator=g, dtype=dtype)
    results = []
    for impl in ("chunked", "reference"):
        leaves = [x.clone().requires_grad_(True) for x in (h, w) + ((b,) if bias else ())]
        hh, ww, bb = leaves[0], leaves[1], leaves[2] if bias else None
        if impl == "chunked":
            out = chunked_logprobs(hh, ww, y, bias=bb, temperature=t, cand_kind=kind,
                                   cand_offsets=offs, cand_ids=ids, replay=replay, chunk_size=chunk)
            lp, ent, clp = out.logprobs, out.entropy, out.cand_logprobs
        else:
            lp, ent, clp = reference(hh, ww, bb, y, t, kind,
                                     offs if offs is not None else torch.zeros(h.shape[0] + 1, dtype=torch.long),
                                     ids if ids is not None else torch.zeros(0, dtype=torch.long), replay)
        fin = torch.isfinite(lp)
        loss = (a_lp * torch.where(fin, lp, 0.0)).sum() * use_lp + (a_c * clp).sum() * use_c
        loss.backward()
        results.append((lp.detach(), ent, clp.detach(), [x.grad for x in leaves]))
    return results


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunk", [1, 4, 100])
def test_full_vocab_matches_naive(dtype, chunk):
    (lp, ent, _, grads), (lp_r, ent_r, _, grads_r) = run_both(dtype, "none", chunk=chunk)
    assert_close(lp, lp_r, dtype)
    assert_close(ent, ent_r, dtype)
    for g, g_r in zip(grads, grads_r, strict=True):
        assert_close(g, g_r, dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_support_replay_matches_brute_force(dtype):
    (lp, ent, clp, grads), (lp_r, ent_r, clp_r, grads_r) = run_both(
        dtype, "support", empty_row=2, missing_row=5)
    assert torch.isneginf(lp[2]) and torch.isneginf(lp[5])  # data errors stay visible
    assert_close(lp, lp_r, dtype)
    assert_close(ent, ent_r, dtype)
    assert_close(clp, clp_r, dtype)
    for g, g_r in zip(grads, grads_r, strict=True):
        assert_close(g, g_r, dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind,replay", [("head", True), ("support", False)])
def test_head_and_unreplayed_support(dtype, kind, replay):
    (lp, ent, clp, grads), (lp_r, ent_r, clp_r, grads_r) = run_both(dtype, kind, replay=replay)
    assert_close(lp, lp_r, dtype)
    assert_close(clp, clp_r, dtype)
    for g, g_r in zip(grads, grads_r, strict=True):
        assert_close(g, g_r, dtype)


@pytest.mark.parametrize("use_lp,use_c", [(True, False), (False, True)])
def test_only_one_output_used(use_lp, use_c):
    (_, _, _, grads), (_, _, _, grads_r) = run_both(torch.float64, "head", use_lp=use_lp, use_c=use_c)
    for g, g_r in zip(grads, grads_r, strict=True):
        assert_close(g, g_r, torch.float64)


def test_replay_support_sums_to_one_and_no_gradient_outside():
    """Property 5: p̃ sums to 1 on S_t; W rows outside every support get exactly 0 gradient."""
    torch.manual_seed(3)
    v, d = 17, 5
    h = torch.randn(3, d, dtype=torch.float64)
    w = torch.randn(v, d, dtype=torch.float64, requires_grad=True)
    supports = [[2, 5, 7], [5, 9], [1, 2, 3, 4]]
    y = torch.tensor([5, 9, 1])
    offs = torch.tensor([0, 3, 5, 9])
    ids = torch.tensor(sum(supports, []))
    out = chunked_logprobs(h, w, y, temperature=0.7, cand_kind="support", cand_offsets=offs,
                           cand_ids=ids, chunk_size=2)
    rows = torch.repeat_interleave(torch.arange(3), offs.diff())
    mass = torch.zeros(3, dtype=torch.float64).index_add_(0, rows, out.cand_logprobs.exp())
    torch.testing.assert_close(mass, torch.ones(3, dtype=torch.float64))
    (out.logprobs.sum() + (out.cand_logprobs * torch.randn(9, dtype=torch.float64)).sum()).backward()
    outside = sorted(set(range(v)) - set(ids.tolist()))
    assert torch.equal(w.grad[outside], torch.zeros(len(outside), d, dtype=torch.float64))
    assert bool((w.grad[ids].abs().sum(-1) > 0).all())


@pytest.mark.parametrize("kind", ["none", "support", "head"])
def test_bf16_close_to_float32_and_grads_dtype(kind):
    """bf16 logits carry ~2^-8 relative error; the float32 reductions add nothing visible."""
    h, w, _, y, t = make_problem(torch.float32, n=20, v=64, d=16, bias=False)
    offs, ids = make_cands(y, 64)
    hb, wb = h.bfloat16().requires_grad_(True), w.bfloat16().requires_grad_(True)
    h32 = hb.detach().float().requires_grad_(True)  # same rounded inputs in float32
    w32 = wb.detach().float().requires_grad_(True)
    outs = []
    for hh, ww in ((hb, wb), (h32, w32)):
        out = chunked_logprobs(hh, ww, y, temperature=t, cand_kind=kind, cand_offsets=offs,
                               cand_ids=ids, chunk_size=8)
        (out.logprobs.sum() + out.cand_logprobs.sum() * 0.1).backward()
        outs.append(out)
    assert outs[0].logprobs.dtype == torch.float32 and hb.grad.dtype == torch.bfloat16
    for a, b in ((outs[0].logprobs, outs[1].logprobs), (outs[0].entropy, outs[1].entropy),
                 (hb.grad, h32.grad), (wb.grad, w32.grad)):
        scale = float(b.detach().abs().max())
        torch.testing.assert_close(a.detach().float(), b.detach(), rtol=0.02, atol=0.03 * scale)


@pytest.mark.parametrize("unit_t", [False, True])
def test_naive_helper_matches_chunked(unit_t):
    h, w, b, y, t = make_problem(torch.float64)
    t = 1.0 if unit_t else t
    a = naive_logprobs(h, w, y, bias=b, temperature=t)
    c = chunked_logprobs(h, w, y, bias=b, temperature=t, chunk_size=2)
    assert_close(a.logprobs, c.logprobs, torch.float64)
    assert_close(a.entropy, c.entropy, torch.float64)


def test_entropy_has_no_gradient():
    h, w, _, y, _ = make_problem(torch.float32, bias=False)
    out = chunked_logprobs(h.requires_grad_(True), w, y)
    assert not out.entropy.requires_grad and out.logprobs.requires_grad


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=0.0), "temperature"),
    (dict(cand_kind="topk"), "cand_kind"),
    (dict(cand_kind="support"), "cand_offsets"),
    (dict(cand_kind="head", cand_offsets=torch.tensor([0, 1]), cand_ids=torch.tensor([0])), "cand_offsets"),
    (dict(chunk_size=0), "chunk_size"),
])
def test_bad_input_named(kwargs, match):
    h, w, _, y, _ = make_problem(torch.float32, bias=False)
    with pytest.raises(ValueError, match=match):
        chunked_logprobs(h, w, y, **kwargs)


def test_bad_targets_named():
    h, w, _, y, _ = make_problem(torch.float32, bias=False)
    with pytest.raises(ValueError, match="targets"):
        chunked_logprobs(h, w, y + 100)
