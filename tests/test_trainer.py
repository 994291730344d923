"""Trainer: gradient vs a naive full-logits reference, accumulation, bf16, malformed records."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from mixrl.config.presets import get_preset, needs
from mixrl.corrections import LossInputs, aggregation_denominator, compute_loss
from mixrl.records.trajectory import Trajectory
from mixrl.train.batch import collate, prepare
from mixrl.train.trainer import Trainer

torch.set_num_threads(1)
V = 48


def tiny_model(seed: int = 0, tie: bool = True) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                      max_position_embeddings=64, tie_word_embeddings=tie)
    return Qwen3ForCausalLM(cfg).float()


def make_traj(g: torch.Generator, i: int, kind: str, group: str = "a") -> Trajectory:
    """Prompt, generated span, tool span (mask 0), generated span; ragged candidates."""
    spans = [(int(torch.randint(2, 5, (1,), generator=g)), 0), (int(torch.randint(2, 6, (1,), generator=g)), 1),
             (2, 0), (int(torch.randint(1, 4, (1,), generator=g)), 1)]
    mask = sum(([m] * n for n, m in spans), [])
    tokens = torch.randint(0, V, (len(mask),), generator=g).tolist()
    lq = [(-0.1 - 3 * float(torch.rand(1, generator=g))) if m else 0.0 for m in mask]
    offs, ids, clq = [0], [], []
    for t, m in enumerate(mask):
        if not m or kind == "none":
            continue
        k = int(torch.randint(2, 7, (1,), generator=g))
        cand = torch.randperm(V, generator=g)[:k].tolist()
        if tokens[t] not in cand:
            cand[0] = tokens[t]
        logits = torch.randn(k, generator=g, dtype=torch.float64)
        q = torch.log_softmax(logits, 0) if kind == "support" else torch.log_softmax(logits, 0) - 0.5
        ids += cand
        clq += q.tolist()
        offs.append(len(ids))
        if kind == "support":
            lq[t] = float(q[cand.index(tokens[t])])
    return Trajectory(prompt_id=f"p{i // 4}", sample_idx=i % 4, tokens=tokens, loss_mask=mask,
                      sampler_logprobs=lq, versions=[0 if m else -1 for m in mask],
                      groups=[group if m else "" for m in mask], cand_kind=kind,
                      cand_offsets=offs if kind != "none" else [0], cand_ids=ids, cand_logprobs=clq,
                      reward=float(i % 2))


def make_batch(n: int, kind: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    trajs = [make_traj(g, i, kind, group="a" if i % 3 else "b") for i in range(n)]
    adv = torch.randn(n, generator=g).tolist()
    return trajs, adv


def naive_loss(model, trajs, adv, cfg, temperature=1.0):
    """Reference: full [B, L, V] logits + log_softmax, dense support mask, compute_loss."""
    kind = needs(cfg).cand_kind
    records, stats = prepare(trajs, adv, vocab_size=V, cand_kind=kind)
    tb = collate(records)
    logits = model(input_ids=tb.input_ids, attention_mask=tb.attention_mask).logits / temperature
    logp = torch.log_softmax(logits.float(), -1)[tb.seq_ids, tb.pred_cols]  # [N, V]
    s = (logits.float())[tb.seq_ids, tb.pred_cols]
    lp = logp.gather(1, tb.targets[:, None]).squeeze(1)
    rows = torch.repeat_interleave(torch.arange(lp.shape[0]), tb.cand_offsets.diff())
    clp = torch.zeros(0)
    if kind == "support":
        mask = torch.zeros_like(s, dtype=torch.bool)
        mask[rows, tb.cand_ids] = True
        lse = torch.logsumexp(s.masked_fill(~mask, -torch.inf), -1)
        lp = s.gather(1, tb.targets[:, None]).squeeze(1) - lse
        clp = s[rows, tb.cand_ids] - lse[rows]
    elif kind == "head":
        clp = logp[rows, tb.cand_ids]
    ent = -(logp.exp() * logp).sum(-1).detach()
    inp = LossInputs(lp, lp.detach(), tb.sampler_logprobs, tb.advantages,
                     torch.ones_like(lp, dtype=torch.bool), tb.seq_ids, tb.num_seqs, cand_kind=kind,
                     cand_offsets=tb.cand_offsets if kind != "none" else None,
                     cand_trainer_logprobs=clp if kind != "none" else None,
                     cand_old_logprobs=clp.detach() if kind != "none" else None,
                     cand_sampler_logprobs=tb.cand_logprobs if kind != "none" else None,
                     entropy=ent, group_ids=tb.group_ids, group_names=stats.group_names)
    denom = aggregation_denominator(cfg.aggregation, inp.loss_mask, tb.seq_ids, tb.num_seqs)
    return compute_loss(inp, cfg, denom)


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("preset,kind,temp", [("grpo", "none", 1.0), ("sc+mis+top-p", "support", 1.0),
                                              ("sc+mis", "head", 1.0), ("sc+mis+top-p", "support", 0.7)])
def test_gradient_matches_naive_reference(preset, kind, temp):
    cfg = get_preset(preset).loss
    trajs, adv = make_batch(6, kind)
    model = tiny_model(tie=kind != "head")
    ref_model = copy.deepcopy(model)
    tr = Trainer(model, cfg, lr=1e-3, chunk_size=5, temperature=temp)
    m = tr.backward(trajs, adv)
    loss_ref, m_ref = naive_loss(ref_model, trajs, adv, cfg, temperature=temp)
    loss_ref.backward()
    assert m["loss"] == pytest.approx(float(loss_ref.detach()), rel=1e-5, abs=1e-7)
    g, g_ref = grads(model), grads(ref_model)
    assert g.keys() == g_ref.keys() and g
    for name in g:
        scale = float(g_ref[name].abs().max()) + 1e-12
        torch.testing.assert_close(g[name], g_ref[name], rtol=1e-4, atol=1e-5 * scale, msg=name)
    for key in ("policy/entropy", "mismatch/kl_k3", "corr/ess"):
        assert m[key] == pytest.approx(m_ref[key], rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_micro_batches_equal_one_batch(aggregation):
    cfg = get_preset("sc+mis+top-p").loss.model_copy(update={"aggregation": aggregation})
    trajs, adv = make_batch(7, "support", seed=1)
    a, b = tiny_model(1), tiny_model(1)
    ta = Trainer(a, cfg, lr=1e-2, chunk_size=4)
    tb_ = Trainer(b, cfg, lr=1e-2, chunk_size=4, micro_batch_size=2)  # 4 micro-batches
    # gradients (not post-AdamW weights: its first step is ~lr·sign(g), unstable where g ≈ 0)
    ta.backward(trajs, adv)
    tb_.backward(trajs, adv)
    ga, gb = grads(a), grads(b)
    for n in ga:
        scale = float(ga[n].abs().max()) + 1e-12
        torch.testing.assert_close(ga[n], gb[n], rtol=1e-5, atol=1e-6 * scale, msg=n)
    ma, mb = ta.step(trajs, adv), tb_.step(trajs, adv)  # step() starts from zeroed gradients
    assert ma["optim/grad_norm"] == pytest.approx(mb["optim/grad_norm"], rel=1e-5)
    assert ma["optim/grad_norm"] == pytest.approx(
        float(torch.cat([g.flatten() for g in ga.values()]).norm()), rel=1e-5)
    assert ma["loss"] == pytest.approx(mb["loss"], rel=1e-5, abs=1e-7)
    for key in ("policy/entropy", "mismatch/kl_k3", "corr/ess", "mismatch/kl_k3/b"):
        assert ma[key] == pytest.approx(mb[key], rel=1e-5, abs=1e-7), key
    assert ma["train/version"] == mb["train/version"] == 1.0


def test_steps_reduce_loss_on_fixed_batch():
    cfg = get_preset("grpo").loss
    trajs, adv = make_batch(8, "none", seed=2)
    tr = Trainer(tiny_model(2), cfg, lr=3e-3, grad_clip=1.0)
    losses = [tr.step(trajs, adv)["loss"] for _ in range(8)]
    assert losses[-1] < losses[0] - 0.05, losses
    assert tr.version == 8


def test_bf16_precision_runs_and_keeps_master_weights():
    cfg = get_preset("sc+mis+top-p").loss
    trajs, adv = make_batch(4, "support", seed=3)
    model = tiny_model(3)
    tr = Trainer(model, cfg, lr=1e-2, precision="bf16", chunk_size=8)
    before = {k: v.float() for k, v in tr.state_dict_for_samplers().items()}
    m = tr.step(trajs, adv)
    assert math.isfinite(m["loss"]) and m["optim/grad_norm"] > 0 and m["optim/skipped_steps"] == 0
    pub = tr.state_dict_for_samplers()
    assert all(v.dtype == torch.bfloat16 and v.device.type == "cpu" for v in pub.values())
    assert any(not torch.equal(pub[k].float(), before[k]) for k in pub)
    assert tr.master is not None and all(mw.dtype == torch.float32 for mw in tr.master)
    for mw, p in zip(tr.master, tr.params, strict=True):
        torch.testing.assert_close(mw.bfloat16(), p.detach())


def test_malformed_records_are_dropped_masked_and_counted():
    cfg = get_preset("grpo").loss
    trajs, adv = make_batch(6, "none", seed=4)
    trajs[1].sampler_logprobs = trajs[1].sampler_logprobs[:-1]  # wrong length
    gen = trajs[2].loss_mask.index(1)
    trajs[2].sampler_logprobs[gen] = float("nan")  # kept, masked in the loss
    trajs[3].status, trajs[3].reward = "infra_failed", None
    trajs[4].loss_mask[0] = 1  # a generated token without context
    tr = Trainer(tiny_model(4), cfg, lr=1e-3)
    m = tr.step(trajs, adv)
    assert m["train/dropped_malformed"] == 2 and m["train/dropped_infra"] == 1
    assert m["train/nonfinite_sampler"] == 1 and m["corr/nonfinite_tokens"] == 1
    assert m["train/trajectories"] == 3 and math.isfinite(m["loss"]) and math.isfinite(m["optim/grad_norm"])
    with pytest.raises(ValueError, match="sampler_logprobs"):
        Trainer(tiny_model(4), cfg, lr=1e-3).step(trajs, adv, strict=True)


def test_missing_candidates_are_malformed_for_replay():
    trajs, adv = make_batch(3, "support", seed=5)
    trajs[0].cand_kind = "head"
    trajs[1].cand_ids[1] = trajs[1].cand_ids[0]  # duplicate within a position
    tr = Trainer(tiny_model(5), get_preset("grpo+top-p").loss, lr=1e-3)
    m = tr.step(trajs, adv)
    assert m["train/dropped_malformed"] == 2 and m["train/trajectories"] == 1


def test_decoupled_epochs_and_minibatches():
    cfg = get_preset("decoupled-ppo").loss
    trajs, adv = make_batch(8, "none", seed=6)
    tr = Trainer(tiny_model(6), cfg, lr=1e-2, epochs=2, minibatches=2, micro_batch_size=3)
    m = tr.step(trajs, adv)
    assert m["optim/steps"] == 4 and tr.version == 1
    assert m["policy/tv"] > 0  # the second minibatch sees θ moved away from the fixed p_old
    with pytest.raises(ValueError, match="score_centering"):
        Trainer(tiny_model(6), get_preset("sc").loss, lr=1e-3, epochs=2)
    with pytest.raises(ValueError, match="minibatches"):
        Trainer(tiny_model(6), get_preset("sc").loss, lr=1e-3, minibatches=2)


def test_one_step_form_has_zero_policy_tv_and_staleness():
    trajs, adv = make_batch(4, "none", seed=7)
    tr = Trainer(tiny_model(7), get_preset("grpo+mis").loss, lr=1e-3)
    tr.step(trajs, adv)
    m = tr.step(trajs, adv)  # tokens of version 0, trainer at 1
    assert m["policy/tv"] == 0.0
    assert m["lag/tokens"] == sum(t.num_generated for t in trajs) and m["precision/tokens"] == 0  # staleness 1


def test_trainer_state_round_trip():
    cfg = get_preset("grpo").loss
    trajs, adv = make_batch(4, "none", seed=8)
    a = Trainer(tiny_model(8), cfg, lr=1e-2)
    a.step(trajs, adv)
    b = Trainer(tiny_model(9), cfg, lr=1e-2)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    assert b.version == 1
    a.step(trajs, adv)
    b.step(trajs, adv)
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)


def test_step_cpu_of_the_thread_and_of_the_process():
    """The thread's CPU is part of the process's over the same update."""
    trajs, adv = make_batch(8, "none", seed=5)
    tr = Trainer(tiny_model(6), get_preset("grpo").loss, lr=1e-3, packing=True)
    m = tr.step(trajs, adv)
    thread, proc = m["perf/train_step_cpu_s"], m["perf/train_step_process_cpu_s"]
    assert 0 < thread <= proc + 1e-3  # clocks tick in ~1 ms steps at worst
