"""``mixrl bench sampler --workload multiturn`` on a tiny policy with the bundled tokenizer:
both arms generate the same tokens, the reuse arm's counts add up, the kept KV stays within
its budget, bad options exit with status 2."""

from __future__ import annotations

import argparse
import json

import torch

from mixrl.lab.bench import sampler


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    sampler.configure(p)
    return p.parse_args(list(argv))


def test_multiturn_workload_json(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from mixrl.models.policy import tiny_config
    from mixrl.models.tokenizer import save_tokenizer

    tok = save_tokenizer(tmp_path)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config(len(tok), max_positions=512, eos_id=tok.eos_token_id)).save_pretrained(tmp_path)
    rc = sampler.main(_args("--workload", "multiturn", "--json", "--model", str(tmp_path), "--repeats", "2",
                            "--episodes", "3", "--turns", "3", "--reply-tokens", "5", "--groups", "2",
                            "--group-size", "4", "--kv-budget-mb", "1"))  # fmt: skip
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    m, g = out["multiturn"], out["group"]
    assert m["requests"] == 3 * 3 and g["requests"] == g["samples"] == 2 * 4
    for w in (m, g):
        assert w["identical_tokens"] is True and w["max_abs_logprob_diff"] < 1e-4
        assert w["prefill_tokens"] + w["reused_tokens"] == w["prompt_tokens"]
        assert w["prefill_saved_frac"] == w["reused_tokens"] / w["prompt_tokens"]
        assert 0 < w["kv_retained_peak_bytes"] <= w["kv_budget_bytes"] == 1 << 20
        assert len(w["reuse_over_no_reuse_rounds"]) == 2 and w["samples_per_s_on"] > 0
        assert w["ratio_from_prefill_time"] == 1 / (1 - w["prefill_frac_off"] * w["prefill_saved_frac"])
    # the group's 4 samples share one prefill: at least 3 of every 4 prompt tokens reused
    assert g["prefill_saved_frac"] >= 0.75
    # turns 2 and 3 reuse each session's kept KV
    assert m["prefill_saved_frac"] > 0 and out["multiturn_prefill_saved_frac"] == m["prefill_saved_frac"]
    assert set(out["goals"]) >= {"identical_tokens", "kv_within_budget"}


def test_bad_options_exit_2(capsys):
    assert sampler.main(_args("--workload", "multiturn", "--turns", "0")) == 2
    assert "--turns must be >= 1, got 0" in capsys.readouterr().err
    assert sampler.main(_args("--workload", "multiturn", "--kv-budget-mb", "0")) == 2
    assert sampler.main(_args("--workload", "multiturn", "--model", "/nonexistent")) == 2
    assert "--model '/nonexistent' has no tokenizer_config.json" in capsys.readouterr().err
