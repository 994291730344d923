"""The built-in engine's weights load: the same tensors as the straightforward construction,
none of them aliasing the source state dict, the RoPE tables computed once per path."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from mixrl.sampling.builtin import decoder_forward as qf
from mixrl.sampling.builtin.linear import PackedLinear
from mixrl.sampling.builtin.precision import from_profile


def _cfg():  # type: ignore[no-untyped-def]
    from mixrl.models.policy import tiny_config

    cfg = tiny_config(50, layers=2, max_positions=64, pad_id=0, eos_id=1)
    cfg.tie_word_embeddings = False  # an lm_head of its own
    return cfg


def _tiny() -> tuple[dict[str, torch.Tensor], qf.Shape]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = _cfg()
    return AutoModelForCausalLM.from_config(cfg).state_dict(), qf.Shape.from_config(cfg)


def test_fp32_layout_is_the_transposed_stack_and_owns_its_memory() -> None:
    sd, shape = _tiny()
    prec = from_profile(SimpleNamespace(weight_format="nvfp4"))
    w = qf.build_weights(sd, shape, prec, 16)
    a = "model.layers.1.self_attn."
    qkv = torch.cat([prec.weight(sd[a + f"{n}_proj.weight"].clone()) for n in "qkv"])
    assert w.layers[1].qkv.kernel == "mkl" and w.layers[1].qkv._wt.is_contiguous()
    assert torch.equal(w.layers[1].qkv._wt, qkv.t())
    m = "model.layers.1.mlp."
    gate_up = torch.cat([prec.weight(sd[m + "gate_proj.weight"].clone()), prec.weight(sd[m + "up_proj.weight"].clone())])
    assert torch.equal(w.layers[1].mlp.gate_up._wt, gate_up.t())
    assert torch.equal(w.layers[1].ln1, sd["model.layers.1.input_layernorm.weight"])
    src = {t.untyped_storage().data_ptr() for t in sd.values()}
    L = w.layers[1]
    mine = [w.embed, w.norm, w.lm_head._wt, L.ln1, L.ln2, L.qk_norm, L.qkv._wt, L.o._wt, L.down._wt, L.mlp.gate_up._wt]
    assert all(t.untyped_storage().data_ptr() not in src for t in mine)  # the trainer may update sd in place


def test_fused_one_part_of_one_row_is_still_a_copy() -> None:
    row = torch.randn(1, 8)
    lin = PackedLinear.fused([row])
    assert lin._wt.shape == (8, 1) and torch.equal(lin._wt, row.t())
    assert lin._wt.untyped_storage().data_ptr() != row.untyped_storage().data_ptr()


def test_rope_tables_are_built_once_per_path_and_match_a_fresh_build() -> None:
    from mixrl.sampling.builtin.fast import FastPath

    sd, shape = _tiny()
    cfg = _cfg()
    prec = from_profile(SimpleNamespace())
    path = FastPath(cfg, prec, 16, 4)
    w1, w2 = path.build(sd), path.build(sd)
    assert w1.cos is w2.cos and w1.sin is w2.sin  # not rebuilt per load
    fresh = qf.build_weights(sd, shape, prec, 16)
    assert torch.equal(w1.cos, fresh.cos) and torch.equal(w1.sin, fresh.sin)
