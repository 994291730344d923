"""One publication on worker processes: the quantizing worker loads what it built in the same
message, and writes the format's file only when another replica of the format will map it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import torch

from mixrl.config import build_config
from mixrl.records.generation import GenerationRequest, SamplingParams


def _req(i: int) -> GenerationRequest:
    return GenerationRequest([4, 20 + i, 30, 5], SamplingParams(max_new_tokens=6, seed=i), request_id=f"r{i}")


def test_quantizing_worker_loads_in_one_message_and_writes_only_for_others(tiny_policy: Path) -> None:
    from transformers import AutoModelForCausalLM

    from mixrl.runtime.backends.embedded import EmbeddedBackend
    from mixrl.runtime.backends.embedded.threads import group_profile, replica_seed
    from mixrl.sampling.factory import make_engine
    from mixrl.weights.shared import SharedVersion

    fp32 = {"compute_dtype": "float32"}
    groups = [{"name": "nv", "profile": "b200-nvfp4", "replicas": 1, "overrides": fp32},
              {"name": "b16", "profile": "b200-bf16", "replicas": 2, "overrides": fp32}]
    cfg = build_config({"fleet": {"groups": groups}, "runtime": {"torch_threads": 1}})
    torch.manual_seed(0)
    sd = AutoModelForCausalLM.from_pretrained(str(tiny_policy)).state_dict()
    sd = {k: v + 0.003 * torch.randn_like(v) for k, v in sd.items()}  # a version the checkpoint is not
    names = ["nv/0", "b16/0", "b16/1"]
    kinds: dict[str, list[str]] = {n: [] for n in names}

    async def main() -> tuple[SharedVersion, dict[str, Any], dict[str, int]]:
        backend = EmbeddedBackend(cfg, str(tiny_policy), None, workers="process")
        try:
            hs = [await backend.make_sampler(n.split("/")[0], n) for n in names]
            for h in hs:
                async def seen(kind: str, payload: object, h=h, call=h._call) -> object:  # type: ignore[no-untyped-def]
                    kinds[h.name].append(kind)
                    return await call(kind, payload)

                h._call = seen  # type: ignore[method-assign]
            sv = SharedVersion.from_state_dict(sd)
            await asyncio.gather(*(h.load_weights(sv, 1) for h in hs))
            for h in hs:
                h._call = type(h)._call.__get__(h)  # type: ignore[method-assign]
            out = {h.name: [await h.generate(r) for r in map(_req, range(3))] for h in hs}
            return sv, out, {h.name: len(h.load_s) for h in hs}
        finally:
            await backend.shutdown()

    sv, out, loads = asyncio.run(main())
    assert kinds["nv/0"] == ["quant"]  # quantized and loaded: one message, no "load" after it
    assert sorted(kinds["b16/0"] + kinds["b16/1"]) == ["load", "quant"]  # one builds, the other maps its file
    assert loads == {n: 1 for n in names}  # each load timed, the quantizing worker's too
    assert sorted(sv.quantize_s) == ["bf16", "nvfp4"]
    # nvfp4 has no other replica: nothing written, not recorded (a later one builds it again)
    assert "nvfp4" not in sv._formats and not any(p.exists() for p in sv._files if "nvfp4" in p.name)
    bf16_file = {f for f, *_ in sv.manifest("bf16").values()} - {str(sv._files[0])}
    assert len(bf16_file) == 1 and all(Path(f).exists() for f in bf16_file)
    for n in names:
        g = n.split("/")[0]
        own = make_engine(str(tiny_policy), group_profile(cfg, g), g, seed=replica_seed(cfg.runtime.seed, n))
        own.load_weights(sd, 1)
        want = [own.generate_batch([_req(i)])[0] for i in range(3)]
        assert [r.version for r in out[n]] == [1, 1, 1]
        assert [r.token_ids for r in out[n]] == [r.token_ids for r in want], n
        for a, b in zip(out[n], want, strict=True):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=0)
    sv.retire()
