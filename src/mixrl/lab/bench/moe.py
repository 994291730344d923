"""``mixrl bench moe``: routing mismatch of an NVFP4 sampler on a tiny Qwen3-MoE, and replay.

Setup: a random Qwen3-MoE (``--layers`` layers, ``--experts`` experts, top-``--top-k``,
hidden 64, head_dim 32, vocab 256; weights scaled x4 so routing is decisive), the
built-in engine with the ``b200-nvfp4`` profile (NVFP4 weights and expert banks,
FP8 KV cache; compute in float32 on CPU) samples ``--prompts`` prompts x
``--new-tokens`` tokens at temperature 1 over the whole vocabulary, recording the
whole distribution q and the experts of every predicting position. The FP32
trainer model then scores the *same tokens* twice: routing freely, and replaying
the recorded experts (``mixrl.models.moe``). Printed (``--json``: one object):

- ``routing_diff_frac``: share of generated tokens whose top-k set differs between
  sampler and (free) trainer in at least one layer;
- ``kl_no_replay`` / ``kl_replay``: mean over generated tokens of the exact
  KL(q || p) over the vocabulary (nats), p the trainer's distribution without / with replay;
- ``tokens``, ``layers``, ``experts``, ``top_k``, ``sampler``.

Replay should bring p closer to q (``kl_replay < kl_no_replay``) whenever
``routing_diff_frac > 0``: the expert choices are then the sampler's, and what is
left is the precision mismatch inside each expert.
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Any

from mixrl.system.jsonout import json_text


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--profile", default="b200-nvfp4", help="sampler profile (compute forced to float32)")
    parser.add_argument("--seed", type=int, default=0)


def build_model(path: str, layers: int, experts: int, top_k: int, seed: int) -> None:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                         num_experts=experts, num_experts_per_tok=top_k, max_position_embeddings=128,
                         tie_word_embeddings=False)  # fmt: skip
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
    model.save_pretrained(path)


def measure(path: str, profile: str, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from mixrl.models.moe import RoutingReplay, dense, diff_mask
    from mixrl.records.generation import GenerationRequest, SamplingParams
    from mixrl.sampling.builtin.engine import BuiltinEngine
    from mixrl.sampling.profiles import get_profile, with_overrides

    prof = with_overrides(get_profile(profile), compute_dtype="float32")
    eng = BuiltinEngine(path, prof, "sampler", seed=0, stop_on_eos=False, forward="generic")
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, record="support")
    res = eng.generate_batch([GenerationRequest(p, params, f"r{i}") for i, p in enumerate(prompts)])
    V = eng.vocab
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    n = len(prompts[0]) + new_tokens
    assert all(len(p) == len(prompts[0]) and len(r.token_ids) == new_tokens for p, r in zip(prompts, res, strict=True))
    ids = torch.tensor([p + r.token_ids for p, r in zip(prompts, res, strict=True)])  # [B, n]
    B, P = len(prompts), len(prompts[0])
    rows = torch.arange(B).repeat_interleave(new_tokens)  # [N] generated positions, row-major
    cols = torch.arange(P - 1, n - 1).repeat(B)  # predicting columns t - 1
    forced = torch.tensor([r.routed_experts for r in res], dtype=torch.long).flatten(0, 1)  # [N, layers, k]
    logq = torch.tensor([r.cand_logprobs for r in res], dtype=torch.float64).view(-1, V)  # [N, V]
    rr = RoutingReplay(model, replay=False)
    out: dict[str, Any] = {}
    for name, replay in (("no_replay", False), ("replay", True)):
        rr.replay = replay
        with torch.no_grad(), rr.forward(dense(forced, rows, cols, (B, n))):
            h = model.model(input_ids=ids).last_hidden_state[rows, cols]  # [N, H]
            logp = model.lm_head(h).double().log_softmax(-1)  # [N, V]
        out[f"kl_{name}"] = float((logq.exp() * (logq - logp)).sum(-1).mean())
        if not replay:
            out["routing_diff_frac"] = float(diff_mask(forced, rr.own, rows, cols, n).double().mean())
    cfg = model.config
    return {"routing_diff_frac": out["routing_diff_frac"], "kl_no_replay": out["kl_no_replay"],
            "kl_replay": out["kl_replay"], "tokens": int(forced.shape[0]), "layers": cfg.num_hidden_layers,
            "experts": cfg.num_experts, "top_k": cfg.num_experts_per_tok,
            "sampler": f"builtin generic path, {profile} ({prof.weight_format} weights, {prof.kv_format} KV, float32 compute)"}  # fmt: skip


def main(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="mixrl-bench-moe-") as d:
        build_model(d, args.layers, args.experts, args.top_k, args.seed)
        g = torch.Generator().manual_seed(args.seed)
        prompts = torch.randint(0, 256, (args.prompts, args.prompt_len), generator=g).tolist()
        res = measure(d, args.profile, prompts, args.new_tokens)
    if args.json:
        print(json_text(res))
    else:
        for k, v in res.items():
            print(f"{k:18s} {v}")
    return 0
