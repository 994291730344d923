"""The built-in engine holds one copy of a tied FP32 table: the lookup reads the head's copy."""

from __future__ import annotations

import dataclasses

import pytest

from mixrl.models.policy import resolve
from mixrl.records.generation import GenerationRequest, SamplingParams
from mixrl.sampling.factory import make_engine
from mixrl.sampling.profiles import get_profile, with_overrides
from mixrl.weights.accounting import tensor_bytes


def _reqs() -> list[GenerationRequest]:
    return [GenerationRequest([4, 20 + i, 30, 5, 7 * i + 1], SamplingParams(max_new_tokens=12, seed=i), request_id=f"r{i}")
            for i in range(6)]


@pytest.mark.parametrize("profile", ["fp32", "h100-fp8"])
def test_a_tied_fp32_table_is_held_once_and_serves_the_same_tokens(profile: str) -> None:
    prof = with_overrides(get_profile(profile), compute_dtype="float32")  # the demo's fleet computes in FP32
    eng = make_engine(str(resolve("bundled")), prof, "g", seed=3)
    w = eng.weights
    wt = w.lm_head.transposed()
    assert wt is not None and w.embed.untyped_storage().data_ptr() == wt.untyped_storage().data_ptr()
    V, H = w.embed.shape
    # every byte counted once: the table is in it once (V x H x 4), not twice
    copied = dataclasses.replace(w, embed=w.embed.contiguous())
    assert tensor_bytes(copied)["owned"] - tensor_bytes(w)["owned"] == V * H * 4
    got = eng.generate_batch(_reqs())
    eng.weights = copied  # the former layout: a contiguous copy of the table for the lookup
    eng._seen = 0  # the same request seeds again
    want = eng.generate_batch(_reqs())
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs  # bit for bit


def test_a_quantized_head_keeps_its_own_table() -> None:
    prof = with_overrides(get_profile("h100-fp8"), compute_dtype="float32", quantize_lm_head=True)
    w = make_engine(str(resolve("bundled")), prof, "g").weights
    wt = w.lm_head.transposed()
    assert wt is not None and w.embed.untyped_storage().data_ptr() != wt.untyped_storage().data_ptr()
    assert w.embed.is_contiguous()


@pytest.mark.parametrize("free", [False, True])
def test_a_load_holds_one_copy_when_the_engine_may_drop_the_old_weights_first(free: bool) -> None:
    import weakref

    from mixrl.models.policy import load_policy

    eng = make_engine(str(resolve("bundled")), "fp32", "g", seed=1)
    eng.free_before_load = free
    sd = {k: v * 1.01 for k, v in load_policy("bundled")[0].state_dict().items()}
    old = weakref.ref(eng.weights)
    build, alive = eng.path.build, []

    def spy(state_dict):  # type: ignore[no-untyped-def]
        alive.append(old() is not None)
        return build(state_dict)

    eng.path.build = spy
    eng.load_weights(sd, 1)
    assert alive == [not free] and eng.version == 1
    want = make_engine(str(resolve("bundled")), "fp32", "g", seed=1)
    want.load_weights(sd, 1)
    a, b = eng.generate_batch(_reqs()), want.generate_batch(_reqs())
    assert [(r.token_ids, r.logprobs) for r in a] == [(r.token_ids, r.logprobs) for r in b]


def test_lazy_weights_build_nothing_until_needed_and_serve_the_same_tokens() -> None:
    from mixrl.models.policy import load_policy

    path = str(resolve("bundled"))
    lazy = make_engine(path, "h100-fp8", "g", seed=2, lazy_weights=True)
    assert lazy.built_weights() is None  # no HF model loaded, no checkpoint weights built
    eager = make_engine(path, "h100-fp8", "g", seed=2)
    a, b = lazy.generate_batch(_reqs()), eager.generate_batch(_reqs())  # the checkpoint, built on first use
    assert lazy.built_weights() is not None
    assert [(r.token_ids, r.logprobs, r.version) for r in a] == [(r.token_ids, r.logprobs, r.version) for r in b]
    # a replica that loads first never builds the checkpoint's weights
    sd = {k: v * 0.99 for k, v in load_policy("bundled")[0].state_dict().items()}
    first = make_engine(path, "h100-fp8", "g", seed=2, lazy_weights=True)
    first.load_weights(sd, 3)
    eager.load_weights(sd, 3)
    assert first.built_weights() is first.weights
    a, b = first.generate_batch(_reqs()), eager.generate_batch(_reqs())
    assert [(r.token_ids, r.logprobs, r.version) for r in a] == [(r.token_ids, r.logprobs, r.version) for r in b]


def test_a_quantizing_view_is_read_one_tensor_at_a_time_and_gives_the_same_weights() -> None:
    import gc
    import weakref

    import torch

    from mixrl.models.policy import load_policy
    from mixrl.sampling.builtin.decoder_forward import Shape, build_weights
    from mixrl.sampling.builtin.precision import from_profile
    from mixrl.weights.formats import Quantized, quantizer, serving_profile

    model, _ = load_policy("bundled")
    sd = model.state_dict()
    prof = with_overrides(get_profile("b200-nvfp4"), compute_dtype="float32")
    q = quantizer(prof)
    alive: list[weakref.ref] = []  # type: ignore[type-arg]
    peak = [0]

    def tracked(name: str, t: torch.Tensor) -> torch.Tensor | None:
        out = q(name, t)
        if out is not None:
            gc.collect()
            live = sum(r() is not None for r in alive)
            peak[0] = max(peak[0], live)
            alive.append(weakref.ref(out))
        return out

    shape = Shape.from_config(model.config)
    prec = from_profile(serving_profile(prof, "nvfp4"))
    view = Quantized(sd, tracked)
    got = build_weights(view, shape, prec, 64)
    n_lin = sum(k.endswith("_proj.weight") for k in sd)
    assert len(alive) == n_lin and view.seconds > 0  # each quantized once, read once
    assert peak[0] <= 3  # at most one layer's q, k, v alive at a time, never the whole model
    want = build_weights({k: (q(k, t) if q(k, t) is not None else t) for k, t in sd.items()}, shape, prec, 64)
    for a, b in zip(got.layers, want.layers, strict=True):
        for x, y in ((a.qkv, b.qkv), (a.o, b.o), (a.down, b.down), (a.mlp.gate_up, b.mlp.gate_up)):
            assert torch.equal(x.transposed(), y.transposed())
