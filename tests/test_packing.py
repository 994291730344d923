"""Token-budget micro-batches and sequence packing: plans, masks, and equality with the padded path.

Float64 throughout where numbers are compared: packed and padded forwards run the
same arithmetic on differently shaped tensors, so they agree to rounding (~1e-15);
the tolerances below are far tighter than the 1e-6 the trainer needs.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from mixrl.config.presets import get_preset, needs
from mixrl.records.trajectory import Trajectory
from mixrl.train.batch import collate, prepare
from mixrl.train.packing import (
    ATTN_COST,
    block_mask,
    micro_batches,
    model_inputs,
    pack,
    pack_rows,
    plan_cost,
    row_caps,
    used_len,
)
from mixrl.train.trainer import Trainer

torch.set_num_threads(1)
V = 40


def tiny(seed: int = 0, attn: str = "sdpa") -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                      max_position_embeddings=128, tie_word_embeddings=True)
    cfg._attn_implementation = attn
    return Qwen3ForCausalLM(cfg).double()


def traj(g: torch.Generator, i: int, kind: str) -> Trajectory:
    """Prompt, generated, tool, generated, and sometimes trailing tool tokens; lengths 5..50."""
    r = lambda a, b: int(torch.randint(a, b, (1,), generator=g))  # noqa: E731
    spans = [(r(2, 10), 0), (r(1, 15), 1), (r(1, 6), 0), (r(1, 15), 1), (r(0, 2) * r(1, 5), 0)]
    mask = sum(([m] * n for n, m in spans), [])
    tokens = torch.randint(0, V, (len(mask),), generator=g).tolist()
    lq = [(-0.1 - 2 * float(torch.rand(1, generator=g))) if m else 0.0 for m in mask]
    offs, ids, clq = [0], [], []
    for t, m in enumerate(mask):
        if not m or kind == "none":
            continue
        cand = torch.randperm(V, generator=g)[: r(2, 8)].tolist()
        if kind == "support" and tokens[t] not in cand:
            cand[0] = tokens[t]
        q = torch.log_softmax(torch.randn(len(cand), generator=g, dtype=torch.float64), 0)
        q = q if kind == "support" else q - 0.3  # a head holds less than all the mass
        ids += cand
        clq += q.tolist()
        offs.append(len(ids))
        if kind == "support":
            lq[t] = float(q[cand.index(tokens[t])])
    return Trajectory(prompt_id=f"p{i // 4}", sample_idx=i % 4, tokens=tokens, loss_mask=mask,
                      sampler_logprobs=lq, versions=[0 if m else -1 for m in mask],
                      groups=[("a" if i % 3 else "b") if m else "" for m in mask], cand_kind=kind,
                      cand_offsets=offs if kind != "none" else [0], cand_ids=ids, cand_logprobs=clq,
                      reward=float(i % 2))


def batch(n: int, kind: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [traj(g, i, kind) for i in range(n)], torch.randn(n, generator=g).tolist()


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_equal(ga, gb, rel: float) -> None:
    assert ga.keys() == gb.keys() and ga
    for n in ga:
        scale = float(ga[n].abs().max()) + 1e-300
        torch.testing.assert_close(ga[n], gb[n], rtol=rel, atol=rel * scale, msg=n)


# ------------------------------------------------------------------ plans and masks


def test_block_mask_by_hand():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0]])  # a: 3 tokens, b: 2, padding: 1
    expect = torch.tensor([[1, 0, 0, 0, 0, 0],
                           [1, 1, 0, 0, 0, 0],
                           [1, 1, 1, 0, 0, 0],
                           [0, 0, 0, 1, 0, 0],
                           [0, 0, 0, 1, 1, 0],
                           [0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(block_mask(pos)[0, 0], expect)


def test_pack_layout_by_hand():
    trajs, adv = batch(12, "support", seed=3)
    records, _ = prepare(trajs, adv, vocab_size=V, cand_kind="support")
    mb = micro_batches(records, None, packed=True)[0]
    tb = pack(mb)
    assert len(mb.rows) < len(records)  # some row holds two trajectories
    i = 0
    for row, n in enumerate(mb.rows):  # each trajectory's trimmed tokens, positions from 0
        col = 0
        for r in mb.records[i:i + n]:
            m = used_len(r)
            assert torch.equal(tb.input_ids[row, col:col + m], r.tokens[:m])
            assert torch.equal(tb.position_ids[row, col:col + m], torch.arange(m))
            col += m
        assert not tb.attention_mask[row, col:].any()
        i += n
    # the hidden state read for y_t sits on token t - 1 of the same trajectory
    want = torch.cat([r.tokens[r.gen_pos - 1] for r in mb.records])
    assert torch.equal(tb.input_ids[tb.hidden_rows, tb.pred_cols], want)
    flat = collate(mb.records)  # per-position tensors in the same order as the padded path
    for f in ("targets", "seq_ids", "sampler_logprobs", "cand_offsets", "cand_ids", "cand_logprobs"):
        assert torch.equal(getattr(tb, f), getattr(flat, f)), f
    assert tb.num_seqs == 12


@pytest.mark.parametrize("packed,one_row", [(False, False), (True, False), (True, True)])
def test_plans_cover_every_record_once_within_budget(packed, one_row):
    trajs, adv = batch(40, "none", seed=1)
    records, _ = prepare(trajs, adv, vocab_size=V)
    longest = max(used_len(r) for r in records)
    for budget in (1, longest, 2 * longest + 3, 10 * longest, None):
        plan = micro_batches(records, budget, packed=packed, one_row=one_row)
        seen = sorted(r.index for mb in plan for r in mb.records)
        assert seen == sorted(r.index for r in records)
        for mb in plan:
            lens = [used_len(r) for r in mb.records]
            if budget is not None and len(mb.records) > 1:
                assert mb.tokens <= budget  # only a lone over-long trajectory may exceed it
            assert mb.row_len >= max(lens)
            if mb.rows is not None:
                assert sum(mb.rows) == len(mb.records)
                i = 0
                for n in mb.rows:
                    assert sum(lens[i:i + n]) <= mb.row_len
                    i += n
            if one_row:
                assert mb.rows is not None and len(mb.rows) == 1
        if budget is not None and budget >= 10 * longest:
            assert len(plan) < len(records) // 4  # a budget that holds several rows uses them
    padded = micro_batches(records, 3 * longest, packed=False)
    assert [r.index for mb in padded for r in mb.records] == [r.index for r in records]
    assert max(len(mb.records) for mb in micro_batches(records, None, packed=False, max_seqs=7)) == 7


def test_packing_removes_padding():
    trajs, adv = batch(64, "none", seed=2)
    records, _ = prepare(trajs, adv, vocab_size=V)
    need = sum(used_len(r) for r in records)
    padded = sum(mb.tokens for mb in micro_batches(records, 512, packed=False))
    packed = sum(mb.tokens for mb in micro_batches(records, 512, packed=True))
    assert need <= packed < padded and packed <= 1.25 * need


def test_flash_inputs_are_one_row_without_mask():
    trajs, adv = batch(6, "none", seed=4)
    records, _ = prepare(trajs, adv, vocab_size=V)
    (mb,) = micro_batches(records, 10_000, packed=True, one_row=True)
    kw = model_inputs(pack(mb), "flash_attention_2")
    assert set(kw) == {"input_ids", "position_ids", "use_cache"} and kw["input_ids"].shape[0] == 1
    assert "attention_mask" in model_inputs(pack(mb), "sdpa")


# ------------------------------------------------------------------ equality with the padded path


def _per_record(records, lp, ent, clp):
    n = [int(r.gen_pos.numel()) for r in records]
    k = [int(r.cand_ids.numel()) for r in records]
    return {r.index: (a, e, c) for r, a, e, c in zip(records, lp.split(n), ent.split(n), clp.split(k), strict=True)}


@pytest.mark.parametrize("preset,kind", [("sc+mis+top-p", "support"), ("sc+mis", "head"), ("grpo", "none")])
@pytest.mark.parametrize("attn,mode,one_row", [("sdpa", "auto", False), ("eager", "auto", False),
                                               ("sdpa", "position_ids", False), ("sdpa", "position_ids", True)])
def test_packed_logprobs_candidates_and_replay_match_unpacked(preset, kind, attn, mode, one_row):
    cfg = get_preset(preset).loss
    assert needs(cfg).cand_kind == kind
    trajs, adv = batch(16, kind, seed=5)
    tr = Trainer(tiny(0, attn), cfg, lr=1e-3, precision="fp64", chunk_size=7)
    records, _ = tr._prepare(trajs, adv, strict=True)
    with torch.no_grad():
        ref = tr._forward(collate(records))
        want = _per_record(records, ref.logprobs, ref.entropy, ref.cand_logprobs)
        plan = micro_batches(records, 120, packed=True, one_row=one_row)
        assert len(plan) > 1 and any(len(mb.records) > (1 if one_row else len(mb.rows)) for mb in plan)
        for mb in plan:
            tb = pack(mb)
            h = tr.model.model(**model_inputs(tb, attn, mode, torch.float64)).last_hidden_state
            from mixrl.models.chunked import chunked_logprobs
            out = chunked_logprobs(h[tb.hidden_rows, tb.pred_cols], tr.model.lm_head.weight, tb.targets,
                                   temperature=tb.temperature, cand_kind=kind,
                                   cand_offsets=tb.cand_offsets if kind != "none" else None,
                                   cand_ids=tb.cand_ids if kind != "none" else None, chunk_size=7)
            for i, (a, e, c) in _per_record(mb.records, out.logprobs, out.entropy, out.cand_logprobs).items():
                wa, we, wc = want[i]
                assert a.dtype == torch.float64
                torch.testing.assert_close(a, wa, rtol=0, atol=1e-10)
                torch.testing.assert_close(e, we, rtol=0, atol=1e-10)
                torch.testing.assert_close(c, wc, rtol=0, atol=1e-10)
    if kind == "support":  # replay: the sampled token's log p̃ sits among its support's
        assert bool(torch.isfinite(ref.logprobs).all())


@pytest.mark.parametrize("preset,kind", [("sc+mis+top-p", "support"), ("grpo", "none")])
def test_packed_micro_batches_gradient_equals_padded_batch(preset, kind):
    cfg = get_preset(preset).loss
    trajs, adv = batch(11, kind, seed=6)
    a, b = tiny(1), tiny(1)
    ta = Trainer(a, cfg, lr=1e-3, precision="fp64", chunk_size=5)
    tb_ = Trainer(b, cfg, lr=1e-3, precision="fp64", chunk_size=5, packing=True, micro_batch_tokens=64)
    assert len(tb_._micro(tb_._prepare(trajs, adv, True)[0])) >= 3
    ma, mb = ta.backward(trajs, adv), tb_.backward(trajs, adv)
    assert_grads_equal(grads(a), grads(b), 1e-9)
    assert ma["loss"] == pytest.approx(mb["loss"], rel=1e-9, abs=1e-12)
    for key in ("policy/entropy", "mismatch/kl_k3", "corr/ess", "mismatch/kl_k3/b"):
        assert ma[key] == pytest.approx(mb[key], rel=1e-9, abs=1e-12), key


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("packing", [False, True])
def test_token_budget_micro_batches_equal_one_batch_float64(aggregation, packing):
    """k micro-batches with the caller's denominator == one batch, to 1e-12 in float64."""
    cfg = get_preset("sc+mis+top-p").loss.model_copy(update={"aggregation": aggregation})
    trajs, adv = batch(10, "support", seed=7)
    a, b = tiny(2), tiny(2)
    one = Trainer(a, cfg, lr=1e-3, precision="fp64", packing=packing)
    many = Trainer(b, cfg, lr=1e-3, precision="fp64", packing=packing, micro_batch_tokens=50)
    records = one._prepare(trajs, adv, True)[0]
    assert len(one._micro(records)) == 1 and len(many._micro(records)) >= 4
    ma, mb = one.backward(trajs, adv, max_len=40), many.backward(trajs, adv, max_len=40)
    assert_grads_equal(grads(a), grads(b), 1e-12)
    assert ma["loss"] == pytest.approx(mb["loss"], rel=1e-12, abs=1e-15)


def test_decoupled_epochs_with_forward_budget_match_one_pass():
    cfg = get_preset("decoupled-ppo").loss
    trajs, adv = batch(12, "none", seed=8)
    a = Trainer(tiny(3), cfg, lr=1e-2, precision="fp64", epochs=2, minibatches=2)
    b = Trainer(tiny(3), cfg, lr=1e-2, precision="fp64", epochs=2, minibatches=2, packing=True,
                micro_batch_tokens=40, forward_micro_batch_tokens=90)
    assert b.forward_micro_batch_tokens == 90
    ma, mb = a.step(trajs, adv), b.step(trajs, adv)
    assert ma["optim/steps"] == mb["optim/steps"] == 4
    for key in ("loss", "optim/grad_norm", "policy/tv", "mismatch/kl_k3"):
        assert ma[key] == pytest.approx(mb[key], rel=1e-9, abs=1e-12), key
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-9, atol=1e-12)


def test_bad_settings_are_rejected():
    cfg = get_preset("grpo").loss
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        Trainer(tiny(), cfg, lr=1e-3, micro_batch_tokens=0)
    with pytest.raises(ValueError, match="micro_batch_size"):
        Trainer(tiny(), cfg, lr=1e-3, packing=True, micro_batch_size=2)
    from pydantic import ValidationError

    from mixrl.config import OptimConfig

    with pytest.raises(ValidationError, match="micro_batch_tokens"):
        OptimConfig(micro_batch_tokens=0)
    ref = copy.deepcopy(OptimConfig())
    assert ref.packing and ref.micro_batch_tokens >= 1024


# ------------------------------------------------------------------ the packer: row length by modelled cost


def records_of(lens: list[int]):
    """Records whose used length (last generated position) is each of ``lens``."""
    trajs = []
    for i, n in enumerate(lens):
        mask = [0] * 3 + [1] * (n - 2)  # L = n + 1 tokens, last generated position n
        trajs.append(Trajectory(prompt_id=f"p{i}", sample_idx=0, tokens=[(i + t) % V for t in range(n + 1)],
                                loss_mask=mask, sampler_logprobs=[-1.0 if m else 0.0 for m in mask],
                                versions=[0 if m else -1 for m in mask], groups=["a" if m else "" for m in mask],
                                reward=1.0))
    records, _ = prepare(trajs, [1.0] * len(trajs), vocab_size=V)
    assert [used_len(r) for r in records] == lens
    return records


def check_plan(records, plan, budget):
    """Every record once, every token once, rows within their length, micro-batches within budget."""
    assert sorted(r.index for mb in plan for r in mb.records) == [r.index for r in records]
    for mb in plan:
        lens = [used_len(r) for r in mb.records]
        if budget is not None and len(mb.records) > 1:
            assert mb.tokens <= budget
        assert mb.rows is not None and sum(mb.rows) == len(mb.records)
        i = 0
        for n in mb.rows:
            assert sum(lens[i:i + n]) <= mb.row_len
            i += n
        tb = pack(mb)
        assert tb.input_ids.shape == (len(mb.rows), mb.row_len)
        assert int(tb.attention_mask.sum()) == sum(lens)  # each token of each record placed once
        assert sorted(tb.input_ids[tb.attention_mask.bool()].tolist()) == sorted(
            torch.cat([r.tokens[:used_len(r)] for r in mb.records]).tolist())


def padding(plan, records) -> float:
    return 1 - sum(used_len(r) for r in records) / sum(mb.tokens for mb in plan)


@pytest.mark.parametrize("cost", [0.0, ATTN_COST, 0.05, 10.0])
@pytest.mark.parametrize("budget", [40, 97, 512, 4096, None])
def test_packer_places_everything_once_within_budget(cost, budget):
    g = torch.Generator().manual_seed(11)
    for lens in (torch.randint(16, 46, (200,), generator=g).tolist(),  # short, alike
                 torch.randint(8, 160, (150,), generator=g).tolist(),  # a wide mix
                 [30] * 64):  # uniform
        records = records_of(lens)
        plan = micro_batches(records, budget, packed=True, attn_cost=cost)
        check_plan(records, plan, budget)


def test_short_alike_episodes_pack_with_almost_no_padding():
    """Episodes of 16-45 tokens rarely pair in rows of the longest; in longer rows they do."""
    g = torch.Generator().manual_seed(12)
    records = records_of(torch.randint(16, 46, (256,), generator=g).tolist())
    lens = [used_len(r) for r in records]
    padded = padding(micro_batches(records, 4096, packed=False), records)
    at_longest = pack_rows(records, lens, max(lens), 4096)
    chosen = micro_batches(records, 4096, packed=True)
    free = micro_batches(records, 4096, packed=True, attn_cost=0.0)  # attention free: padding is all that costs
    assert padded > 0.2 and padding(chosen, records) < 0.1
    assert plan_cost(chosen, ATTN_COST) <= plan_cost(at_longest, ATTN_COST)
    assert padding(free, records) < 0.02 < padding(at_longest, records)
    assert max(mb.row_len for mb in free) > max(lens)
    uniform = records_of([30] * 63 + [31])  # rows of the longest hold one each and pad 1 in 31
    one_each = pack_rows(uniform, [30] * 63 + [31], 31, 4096)
    assert padding(micro_batches(uniform, 4096, packed=True, attn_cost=0.0), uniform) < 0.02 < padding(one_each, uniform)


def test_row_length_is_the_modelled_cheapest():
    g = torch.Generator().manual_seed(13)
    records = records_of(torch.randint(8, 160, (120,), generator=g).tolist())
    lens = [used_len(r) for r in records]
    for cost in (0.0, ATTN_COST, 0.05):
        chosen = plan_cost(micro_batches(records, 2048, packed=True, attn_cost=cost), cost)
        costs = [plan_cost(pack_rows(records, lens, cap, 2048), cost) for cap in row_caps(lens, 2048)]
        assert chosen <= costs[0] and chosen <= min(costs[:5])  # never worse than rows of the longest
        if cost == 0.0:  # free attention: the cheapest plan is the one with the least padding
            assert chosen == pytest.approx(min(costs))
    # attention expensive: rows no longer than the longest trajectory (the plan of the first cap)
    big = micro_batches(records, 2048, packed=True, attn_cost=10.0)
    assert max(mb.row_len for mb in big) == max(lens)
    assert row_caps([5, 7], None) == [7, 8, 9, 10, 11, 12] and row_caps([50], 30) == [30]


def test_attn_pair_cost_from_config():
    from mixrl.train.packing import CPU_MASK_FACTOR, attn_pair_cost

    m = tiny()
    c = m.config  # d 32, 2 heads x 16, 1 kv head, ff 64: pair 4*2*16, token 2*(32*(4+2)*16 + 3*32*64)
    assert attn_pair_cost(c) == pytest.approx(CPU_MASK_FACTOR * 128 / (2 * (32 * 6 * 16 + 3 * 32 * 64)))
    assert attn_pair_cost(None) == ATTN_COST
    big = Qwen3Config(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128)
    assert attn_pair_cost(big) < attn_pair_cost(c) / 10  # a wide model affords far longer rows


@pytest.mark.parametrize("preset,kind", [("sc+mis+top-p", "support"), ("grpo", "none")])
def test_long_packed_rows_match_unpacked(preset, kind):
    """Free attention (attn_cost 0): many trajectories per row, log-probs still aligned to 1e-10."""
    from mixrl.models.chunked import chunked_logprobs

    cfg = get_preset(preset).loss
    trajs, adv = batch(24, kind, seed=9)
    tr = Trainer(tiny(0), cfg, lr=1e-3, precision="fp64", chunk_size=7)
    records, _ = tr._prepare(trajs, adv, strict=True)
    with torch.no_grad():
        ref = tr._forward(collate(records))
        want = _per_record(records, ref.logprobs, ref.entropy, ref.cand_logprobs)
        plan = micro_batches(records, 400, packed=True, attn_cost=0.0)
        check_plan(records, plan, 400)
        assert max(n for mb in plan for n in mb.rows) >= 3
        for mb in plan:
            tb = pack(mb)
            h = tr.model.model(**model_inputs(tb, "sdpa", "auto", torch.float64)).last_hidden_state
            out = chunked_logprobs(h[tb.hidden_rows, tb.pred_cols], tr.model.lm_head.weight, tb.targets,
                                   temperature=tb.temperature, cand_kind=kind,
                                   cand_offsets=tb.cand_offsets if kind != "none" else None,
                                   cand_ids=tb.cand_ids if kind != "none" else None, chunk_size=7)
            for i, (a, e, c) in _per_record(mb.records, out.logprobs, out.entropy, out.cand_logprobs).items():
                for got, exp in zip((a, e, c), want[i], strict=True):
                    torch.testing.assert_close(got, exp, rtol=0, atol=1e-10)
