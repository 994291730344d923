"""``mixrl bench sampler`` on a tiny model: the JSON has every promised field, the
counts are real, and the peak-memory children report numbers."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from mixrl.lab.bench import sampler


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                      max_position_embeddings=64, eos_token_id=3)  # fmt: skip
    path = tmp_path_factory.mktemp("m")
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    return str(path)


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    sampler.configure(p)
    return p.parse_args(list(argv))


def test_both_sides_generate_every_token_despite_eos(model_dir):
    from transformers import AutoModelForCausalLM

    engine = sampler._builtin(model_dir, 1)
    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompts = sampler._prompts(64, 8, 3, seed=0)
    assert len(prompts) == 8 and all(len(p) == 3 for p in prompts)
    assert sampler._builtin_run(engine, prompts, 20, "none") == 8 * 20  # EOS id 3 ignored
    assert sampler._hf_run(hf, prompts, 20) == 8 * 20


def _bench_json(model_dir, capsys, repeats: int) -> dict:
    """``mixrl bench sampler --json`` on the tiny model (batch 4 x 6 new tokens, no vLLM, no memory)."""
    rc = sampler.main(_args("--json", "--model", model_dir, "--batch", "4", "--prompt-len", "4",
                            "--new-tokens", "6", "--repeats", str(repeats), "--threads", "1", "--no-vllm",
                            "--no-memory"))  # fmt: skip
    assert rc == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_bench_json_fields(model_dir, capsys):
    out = _bench_json(model_dir, capsys, 1)
    for key in ("builtin_tok_s", "hf_tok_s", "builtin_support_tok_s", "builtin_cpu_tok_s", "hf_cpu_tok_s"):
        assert out[key] > 0
    assert out["builtin_over_hf"] == pytest.approx(out["builtin_tok_s"] / out["hf_tok_s"], rel=1e-2)
    assert out["model"].startswith("HF directory") and out["params"] > 0
    assert "vllm_tok_s" in out and "vllm_logprob_max_abs_err_fp32" in out
    assert out["new_tokens"] == 6 and out["batch"] == 4
    assert out["hf_setup"] == "generate, sdpa attention, dynamic cache"


def test_peak_memory_child_reports_the_generation_only(model_dir):
    # RSS before generating is subtracted: interpreter, libraries and weights (~hundreds of
    # MB) are not counted, so a tiny model's generation needs only a few MB
    peak = sampler.peak_mb("builtin", model_dir, sampler._prompts(64, 64, 8, seed=0), 50, 1)
    assert peak is not None and 0 <= peak < 100


def test_floor_fields_are_the_best_floor_run_and_consistent(model_dir, capsys):
    out = _bench_json(model_dir, capsys, 2)
    assert out["builtin_path"] == "qwen3-fast" and "floor_note" not in out
    gemm, attn = out["floor_gemm_s"], out["floor_attention_s"]
    assert gemm > 0 and attn > 0 and out["floor_gemm_gflop_s"] > 0 and out["floor_attention_gb_s"] > 0
    assert out["floor_tok_s"] == pytest.approx(4 * 6 / (gemm + attn), rel=1e-2)  # tokens / floor time
    assert out["floor_over_hf"] == pytest.approx(out["floor_tok_s"] / out["hf_tok_s"], rel=1e-2)
    assert out["builtin_over_floor"] == pytest.approx(out["builtin_tok_s"] / out["floor_tok_s"], rel=1e-2)


def test_floor_counts_the_engine_work(model_dir):
    # 1 layer, hidden 32, 2 query heads + 1 kv head of 16, intermediate 64, vocab 64; 5 rows in
    # chunks of max_batch 4 and 1; prompt 3, 4 new tokens: steps attend over 4, 5, 6 columns
    engine = sampler._builtin(model_dir, 1)
    engine.max_batch = 4
    floor = sampler.Floor(engine, 5, 3, 4, seed=0)
    assert floor.rows == [4, 1]
    per_row = 32 * (4 * 16 + 2 * 16 + 3 * 64)  # qkv (64 out), o (32 in), gate+up, down
    assert floor.flops == sum(2 * b * (per_row * (3 + 3) + 4 * 32 * 64) for b in (4, 1))
    assert floor.kv_bytes == sum(2 * b * 16 * end * 4 for b in (4, 1) for end in (4, 5, 6))
    assert floor() == 5 * 4 and len(floor.runs) == 1 and all(t > 0 for t in floor.runs[0])
    k, _ = floor.inputs[4]["kv"][0]
    assert k.shape == (4, 1, 3 + 4, 16)  # the engine's cache: prompt + new columns


def test_no_floor_on_the_generic_path():
    fields = sampler.floor_fields(None, {"hf": 1.0, "builtin": 1.0})
    assert fields["floor_tok_s"] is None and fields["floor_over_hf"] is None and "generic" in fields["floor_note"]
