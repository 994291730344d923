"""MoE routing: the engine's record, replay against a float64 brute force, the trainer's metric.

Models are tiny random Qwen3-MoEs (2 layers, 4 experts, top-2, hidden 64).
"""

from __future__ import annotations

import pytest
import torch

from mixrl.models.moe import RoutingReplay, dense, diff_mask, routers

torch.set_num_threads(1)


def _moe(seed: int = 0, dtype: torch.dtype = torch.float32):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                         num_experts=4, num_experts_per_tok=2, max_position_embeddings=64)  # fmt: skip
    m = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
    if dtype == torch.float64:  # the grouped-GEMM kernel takes no float64
        m.set_experts_implementation("eager")
    return m.to(dtype)


def _brute_block(block, x: torch.Tensor, forced: torch.Tensor) -> torch.Tensor:
    """float64 MoE block by the formula: y = sum_{i in I} g_i * down_i(silu(gate_i x) * up_i x)."""
    W = block.gate.weight  # [E, H]
    out = []
    for n in range(x.shape[0]):
        p = torch.softmax(W @ x[n], dim=0)
        idx = forced[n]
        g = p[idx] / p[idx].sum() if block.gate.norm_topk_prob else p[idx]
        y = torch.zeros_like(x[n])
        for gi, e in zip(g, idx.tolist(), strict=True):
            gu = block.experts.gate_up_proj[e] @ x[n]
            a, u = gu.chunk(2)
            y = y + gi * (block.experts.down_proj[e] @ (torch.nn.functional.silu(a) * u))
        out.append(y)
    return torch.stack(out)


def test_replayed_block_equals_float64_brute_force_and_gates_stay_differentiable():
    m = _moe(dtype=torch.float64)
    block = m.model.layers[0].mlp
    assert block.gate.norm_topk_prob is False  # Qwen3-MoE's default; the True case is checked below
    rr = RoutingReplay(block, replay=True)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 64, dtype=torch.float64, generator=g)
    forced = torch.tensor([[0, 1], [2, 3], [3, 0], [1, 2], [0, 3], [2, 1]])  # [N, k]
    fl = forced[:, None, :]  # [N, layers=1, k]
    with rr.forward(fl):
        y = block(x[None])[0]
    ref = _brute_block(block, x, forced)
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    # gradients reach the router through the gates, as in the brute force
    (gy,) = torch.autograd.grad(y.square().sum(), block.gate.weight)
    (gr,) = torch.autograd.grad(ref.square().sum(), block.gate.weight)
    assert gy.abs().max() > 0
    torch.testing.assert_close(gy, gr, rtol=1e-10, atol=1e-12)
    # -1 rows route freely: identical to HF's own block
    free = torch.full_like(fl, -1)
    with torch.no_grad(), rr.forward(free):
        y_free = block(x[None])[0]
    with torch.no_grad():
        y_hf = block(x[None])[0]  # unpatched again after the context
    # HF rounds router probabilities to float32 even in a float64 model; replay keeps float64
    torch.testing.assert_close(y_free, y_hf, rtol=0, atol=1e-7)
    assert "forward" not in block.gate.__dict__
    with pytest.raises(ValueError, match="routed expert id 9"), rr.forward(torch.full_like(fl, 9)):
        block(x[None])
    block.gate.norm_topk_prob = True  # gates renormalised over the forced set
    with rr.forward(fl):
        y = block(x[None])[0]
    torch.testing.assert_close(y, _brute_block(block, x, forced), rtol=1e-12, atol=1e-12)


def test_engine_records_routing_equal_to_hf_at_fp32_and_replay_is_then_a_no_op(tmp_path):
    from mixrl.records.generation import GenerationRequest, SamplingParams
    from mixrl.sampling.builtin.engine import BuiltinEngine
    from mixrl.sampling.profiles import get_profile

    m = _moe()
    m.save_pretrained(tmp_path)
    eng = BuiltinEngine(str(tmp_path), get_profile("fp32"), "g", stop_on_eos=False)
    assert eng.path_name == "generic"
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10]]  # ragged: left padding must not leak into routing
    res = eng.generate_batch([GenerationRequest(p, SamplingParams(max_new_tokens=5, record="none", seed=i))
                              for i, p in enumerate(prompts)])  # fmt: skip
    rr = RoutingReplay(m, replay=False)
    for p, r in zip(prompts, res, strict=True):
        assert r.routed_experts is not None and len(r.routed_experts) == 5
        ids = torch.tensor([p + r.token_ids])
        n = ids.shape[1]
        cols = torch.arange(len(p) - 1, n - 1)
        rows = torch.zeros_like(cols)
        forced = torch.tensor(r.routed_experts)  # [5, layers, k]
        with torch.no_grad(), rr.forward(dense(forced, rows, cols, (1, n))):
            m.model(input_ids=ids)
        assert not diff_mask(forced, rr.own, rows, cols, n).any()  # FP32 sampler == trainer routing


def _traj(prompt, res, routed):
    from mixrl.records.trajectory import Trajectory

    n = len(res.token_ids)
    return Trajectory(prompt_id="p", sample_idx=0, tokens=prompt + res.token_ids, loss_mask=[0] * len(prompt) + [1] * n,
                      sampler_logprobs=[0.0] * len(prompt) + res.logprobs, versions=[-1] * len(prompt) + [0] * n,
                      groups=[""] * len(prompt) + [res.group] * n, reward=1.0, routed_experts=routed)  # fmt: skip


def test_trainer_replays_recorded_experts_and_reports_routing_diff_frac(tmp_path):
    from mixrl.config.loss import LossConfig
    from mixrl.records.generation import GenerationRequest, SamplingParams
    from mixrl.sampling.builtin.engine import BuiltinEngine
    from mixrl.sampling.profiles import get_profile
    from mixrl.train.trainer import Trainer

    m = _moe(seed=2)
    m.save_pretrained(tmp_path)
    eng = BuiltinEngine(str(tmp_path), get_profile("fp32"), "fp32", stop_on_eos=False)
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    res = eng.generate_batch([GenerationRequest(p, SamplingParams(max_new_tokens=4, record="none", seed=i))
                              for i, p in enumerate(prompts)])  # fmt: skip
    # the true record, and one where every token's experts are moved to other ones
    true = [_traj(p, r, r.routed_experts) for p, r in zip(prompts, res, strict=True)]
    moved = [_traj(p, r, [[[(e + 1) % 4 for e in layer] for layer in tok] for tok in r.routed_experts])
             for p, r in zip(prompts, res, strict=True)]  # fmt: skip
    lp: dict[str, dict[str, float]] = {}
    for name, trajs, replay in (("free", true, False), ("true", true, True), ("moved", moved, True)):
        model = _moe(seed=2)
        tr = Trainer(model, LossConfig(routing_replay=replay), lr=1e-9)
        met = tr.step(trajs, [[1.0] * 4, [-1.0] * 4])
        lp[name] = met
    assert lp["free"]["mismatch/routing_diff_frac"] == 0.0
    assert lp["free"]["mismatch/routing_diff_frac/fp32"] == 0.0
    assert lp["moved"]["mismatch/routing_diff_frac"] == 1.0  # every token's set differs from the trainer's own
    # replaying the true routing is the free forward; replaying moved experts changes the loss
    assert lp["true"]["loss"] == pytest.approx(lp["free"]["loss"], abs=1e-7)
    assert abs(lp["moved"]["loss"] - lp["free"]["loss"]) > 1e-4


def test_dense_model_passes_through():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    m = Qwen3ForCausalLM(Qwen3Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=16))  # fmt: skip
    assert routers(m) == [] and not RoutingReplay(m, True).active
