"""Shared prompt prefixes in packed rows: layout, mask, and equality with padded rows in float64."""

from __future__ import annotations

import pytest
import torch
from test_packing import V, tiny  # the same tiny float64 Qwen3

from mixrl.config.presets import get_preset, needs
from mixrl.models.chunked import chunked_logprobs
from mixrl.records.trajectory import Trajectory
from mixrl.train import prefix
from mixrl.train.batch import collate, prepare
from mixrl.train.packing import micro_batches, model_inputs, pack, used_len
from mixrl.train.trainer import Trainer

torch.set_num_threads(1)


def grouped(prompts: int, G: int, kind: str, seed: int = 0, multi_turn: bool = False):
    """G samples per prompt; within a prompt some samples also agree on their first generated tokens."""
    g = torch.Generator().manual_seed(seed)
    r = lambda a, b: int(torch.randint(a, b, (1,), generator=g))  # noqa: E731
    out = []
    for p in range(prompts):
        prompt = torch.randint(0, V, (r(2, 9),), generator=g).tolist()
        opening = torch.randint(0, V, (2,), generator=g).tolist()  # shared by the even samples
        for i in range(G):
            gen = (opening if i % 2 == 0 else []) + torch.randint(0, V, (r(1, 8),), generator=g).tolist()
            tokens, mask = prompt + gen, [0] * len(prompt) + [1] * len(gen)
            if multi_turn:  # tool output, then a second turn
                tool, more = torch.randint(0, V, (r(1, 4),), generator=g).tolist(), torch.randint(0, V, (r(1, 5),), generator=g).tolist()
                tokens, mask = tokens + tool + more, mask + [0] * len(tool) + [1] * len(more)
            lq = [(-0.1 - 2 * float(torch.rand(1, generator=g))) if m else 0.0 for m in mask]
            offs, ids, clq = [0], [], []
            for t, m in enumerate(mask):
                if not m or kind == "none":
                    continue
                cand = torch.randperm(V, generator=g)[: r(2, 6)].tolist()
                if kind == "support" and tokens[t] not in cand:
                    cand[0] = tokens[t]
                q = torch.log_softmax(torch.randn(len(cand), generator=g, dtype=torch.float64), 0)
                q = q if kind == "support" else q - 0.3
                ids += cand
                clq += q.tolist()
                offs.append(len(ids))
                if kind == "support":
                    lq[t] = float(q[cand.index(tokens[t])])
            out.append(Trajectory(prompt_id=f"p{p}", sample_idx=i, tokens=tokens, loss_mask=mask,
                                  sampler_logprobs=lq, versions=[0 if m else -1 for m in mask],
                                  groups=["a" if m else "" for m in mask], cand_kind=kind,
                                  cand_offsets=offs if kind != "none" else [0], cand_ids=ids,
                                  cand_logprobs=clq, reward=float(i % 2)))
    return out, torch.randn(len(out), generator=g).tolist()


def test_mask_and_layout_by_hand():
    a = Trajectory(prompt_id="p", sample_idx=0, tokens=[5, 6, 7, 8, 9], loss_mask=[0, 0, 1, 1, 1],
                   sampler_logprobs=[0, 0, -1, -1, -1], versions=[-1, -1, 0, 0, 0], groups=["", "", "a", "a", "a"])
    b = Trajectory(prompt_id="p", sample_idx=1, tokens=[5, 6, 7, 3], loss_mask=[0, 0, 1, 1],
                   sampler_logprobs=[0, 0, -1, -1], versions=[-1, -1, 0, 0], groups=["", "", "a", "a"])
    records, _ = prepare([a, b], [1.0, -1.0], vocab_size=V)
    (mb,) = micro_batches(records, None, packed=True, share_prefix=True)
    assert mb.shared == [0, 3] and mb.rows == [2] and mb.row_len == 4  # a: 5 6 7 8, b: nothing of its own
    tb = pack(mb)
    assert tb.input_ids.tolist() == [[5, 6, 7, 8]] and tb.position_ids.tolist() == [[0, 1, 2, 3]]
    # a predicts 7 8 9 at columns 1 2 3; b predicts 7 3 from the shared columns 1 2
    assert tb.pred_cols.tolist() == [1, 2, 3, 1, 2] and tb.hidden_rows.tolist() == [0] * 5
    # two samples whose own suffixes must not see each other
    c = Trajectory(prompt_id="q", sample_idx=0, tokens=[1, 2, 3, 4], loss_mask=[0, 1, 1, 1],
                   sampler_logprobs=[0, -1, -1, -1], versions=[-1, 0, 0, 0], groups=["", "a", "a", "a"])
    d = Trajectory(prompt_id="q", sample_idx=1, tokens=[1, 9, 9], loss_mask=[0, 1, 1],
                   sampler_logprobs=[0, -1, -1], versions=[-1, 0, 0], groups=["", "a", "a"])
    records, _ = prepare([c, d], [1.0, -1.0], vocab_size=V)
    (mb,) = micro_batches(records, None, packed=True, share_prefix=True)
    tb = pack(mb)
    assert tb.input_ids.tolist() == [[1, 2, 3, 9]] and tb.position_ids.tolist() == [[0, 1, 2, 1]]
    expect = torch.tensor([[1, 0, 0, 0],
                           [1, 1, 0, 0],
                           [1, 1, 1, 0],
                           [1, 0, 0, 1]], dtype=torch.bool)  # d's 9 sees the prompt token 1 and itself
    assert torch.equal(tb.shared_mask[0, 0], expect)
    assert tb.pred_cols.tolist() == [0, 1, 2, 0, 3]


@pytest.mark.parametrize("budget", [None, 200, 30])
def test_plans_place_every_record_once_and_save_tokens(budget):
    trajs, adv = grouped(6, 8, "none", seed=1)
    records, _ = prepare(trajs, adv, vocab_size=V)
    plain = micro_batches(records, budget, packed=True)
    shared = micro_batches(records, budget, packed=True, share_prefix=True)
    assert sorted(r.index for mb in shared for r in mb.records) == list(range(len(records)))
    for mb in shared:
        if budget is not None and len(mb.records) > 1:
            assert mb.tokens <= budget
        tb = pack(mb)  # the tokens laid out: each shared prefix once, no padding
        assert mb.real_tokens == int(tb.attention_mask.sum()) <= mb.tokens
    assert sum(mb.tokens for mb in shared) < 0.8 * sum(mb.tokens for mb in plain)
    lens = [used_len(r) for r in records]
    for members, s in prefix.groups(records, lens):  # S: the longest prefix the whole group shares
        toks = [records[i].tokens[:lens[i]] for i in members]
        assert all(torch.equal(t[:s], toks[0][:s]) for t in toks)
        assert s == min(lens[i] for i in members) or len({int(t[s]) for t in toks}) > 1


@pytest.fixture
def rmsnorm_in_input_dtype(monkeypatch):
    """transformers' Qwen3 RMSNorm rounds its input to float32 even in a float64 model. Shared
    hidden states receive the sum of their members' gradients *before* that rounding in the
    backward, separate copies after it, which moves gradients by float32 rounding (~1e-8
    relative); in the input dtype both are float64 sums and agree to ~1e-15."""
    from transformers.models.qwen3 import modeling_qwen3

    def forward(self, h):
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(modeling_qwen3.Qwen3RMSNorm, "forward", forward)


def _per_record(records, out):
    n = [int(r.gen_pos.numel()) for r in records]
    k = [int(r.cand_ids.numel()) for r in records]
    return {r.index: x for r, *x in zip(records, out.logprobs.split(n), out.entropy.split(n),
                                        out.cand_logprobs.split(k), strict=True)}


@pytest.mark.parametrize("preset,kind", [("sc+mis+top-p", "support"), ("sc+mis", "head"), ("grpo", "none")])
@pytest.mark.parametrize("attn,budget,multi_turn", [("sdpa", None, False), ("eager", 60, False), ("sdpa", 45, True)])
def test_shared_logprobs_match_separate_rows_float64(preset, kind, attn, budget, multi_turn):
    cfg = get_preset(preset).loss
    assert needs(cfg).cand_kind == kind
    trajs, adv = grouped(4, 6, kind, seed=2, multi_turn=multi_turn)
    tr = Trainer(tiny(0, attn), cfg, lr=1e-3, precision="fp64", chunk_size=7)
    records, _ = tr._prepare(trajs, adv, strict=True)
    with torch.no_grad():
        want = _per_record(records, tr._forward(collate(records)))
        plan = micro_batches(records, budget, packed=True, share_prefix=True)
        assert any(any(mb.shared) for mb in plan)
        for mb in plan:
            tb = pack(mb)
            h = tr.model.model(**model_inputs(tb, attn, dtype=torch.float64)).last_hidden_state
            out = chunked_logprobs(h[tb.hidden_rows, tb.pred_cols], tr.model.lm_head.weight, tb.targets,
                                   temperature=tb.temperature, cand_kind=kind,
                                   cand_offsets=tb.cand_offsets if kind != "none" else None,
                                   cand_ids=tb.cand_ids if kind != "none" else None, chunk_size=7)
            # transformers' eager attention takes its softmax in float32 even for float64
            # inputs, so the masked columns between a prefix and a suffix move its sums by
            # float32 rounding; SDPA runs in float64 throughout
            tol = 1e-10 if attn == "sdpa" else 1e-6
            for i, got in _per_record(mb.records, out).items():
                for a, b in zip(got, want[i], strict=True):
                    torch.testing.assert_close(a, b, rtol=0, atol=tol)


@pytest.mark.parametrize("preset,kind", [("sc+mis+top-p", "support"), ("grpo", "none")])
@pytest.mark.parametrize("budget", [None, 40])
def test_shared_prefix_gradient_and_metrics_equal_padded_batch(preset, kind, budget, rmsnorm_in_input_dtype):
    cfg = get_preset(preset).loss
    trajs, adv = grouped(5, 8, kind, seed=3, multi_turn=kind == "none")
    a, b = tiny(1), tiny(1)
    ta = Trainer(a, cfg, lr=1e-3, precision="fp64", chunk_size=5)
    tb_ = Trainer(b, cfg, lr=1e-3, precision="fp64", chunk_size=5, packing=True, micro_batch_tokens=budget)
    assert tb_.share_prefix and any(any(mb.shared) for mb in tb_._micro(tb_._prepare(trajs, adv, True)[0]))
    ma, mb = ta.backward(trajs, adv), tb_.backward(trajs, adv)
    ga = {n: p.grad for n, p in a.named_parameters()}
    for n, p in b.named_parameters():
        scale = float(ga[n].abs().max()) + 1e-300
        torch.testing.assert_close(p.grad, ga[n], rtol=1e-9, atol=1e-9 * scale, msg=n)
    for key in ("loss", "policy/entropy", "mismatch/kl_k3", "corr/ess"):
        assert ma[key] == pytest.approx(mb[key], rel=1e-9, abs=1e-12), key


def test_sharing_only_where_a_4d_mask_carries_it():
    cfg = get_preset("grpo").loss
    assert not Trainer(tiny(0), cfg, lr=1e-3, precision="fp64").share_prefix  # padded rows
    assert not Trainer(tiny(0), cfg, lr=1e-3, precision="fp64", packing=True, share_prefix=False).share_prefix
    flash = tiny(0)
    flash.config._attn_implementation = "flash_attention_2"
    assert not Trainer(flash, cfg, lr=1e-3, precision="fp64", packing=True).share_prefix
    trajs, adv = grouped(2, 4, "none", seed=4)
    records, _ = prepare(trajs, adv, vocab_size=V)
    (mb,) = micro_batches(records, None, packed=True, share_prefix=True)
    with pytest.raises(ValueError, match="4D attention mask"):
        model_inputs(pack(mb), "sdpa", mode="position_ids")
