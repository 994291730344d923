"""Ray: weights through the object store, quantized once per (version, format).

On a local Ray cluster (token auth on, no dashboard, a temporary directory): two
replicas of an NVFP4 group and one of a BF16 group load two versions; each version
is quantized once per format (by the first replica's actor), and every replica
serves exactly what an engine quantizing on load serves.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from mixrl.config import build_config
from mixrl.records.generation import GenerationRequest, SamplingParams

pytestmark = pytest.mark.ray


def _req(i: int) -> GenerationRequest:
    return GenerationRequest([4, 20 + i, 30, 5], SamplingParams(max_new_tokens=6, seed=i), request_id=f"r{i}")


def test_ray_quantizes_once_per_version_and_format(tiny_policy: Path) -> None:
    pytest.importorskip("ray")
    import ray
    from transformers import AutoModelForCausalLM

    from mixrl.runtime.backends.embedded.threads import group_profile
    from mixrl.runtime.backends.ray_backend import RayBackend
    from mixrl.sampling.factory import make_engine

    fp32 = {"compute_dtype": "float32"}
    groups = [{"name": "q", "profile": "b200-nvfp4", "replicas": 2, "max_replicas": 2, "overrides": fp32},
              {"name": "h", "profile": "b200-bf16", "replicas": 1, "max_replicas": 1, "overrides": fp32}]
    cfg = build_config({"fleet": {"groups": groups}, "runtime": {"torch_threads": 1, "backend": "ray"}})
    base = AutoModelForCausalLM.from_pretrained(str(tiny_policy)).state_dict()
    torch.manual_seed(0)
    versions = {v: {k: t + 0.003 * v * torch.randn_like(t) for k, t in base.items()} for v in (1, 2)}
    reqs = [_req(i) for i in range(3)]

    async def main() -> tuple[dict, dict]:
        backend = RayBackend(cfg, str(tiny_policy), None)
        await backend.start()
        try:
            hs = [await backend.make_sampler("q", f"q/{i}") for i in range(2)] + [await backend.make_sampler("h", "h/0")]
            out, built = {}, {}
            for v, sd in versions.items():
                ref = ray.put(sd)  # what the trainer actor's weights() is: one object per version
                await asyncio.gather(*(h.load_weights(ref, v) for h in hs))
                built[v] = dict(backend.formats.built)
                out[v] = {h.name: [await h.generate(r) for r in reqs] for h in hs}
            return out, built
        finally:
            await backend.shutdown()

    out, built = asyncio.run(main())
    assert built == {1: {"nvfp4": 1, "bf16": 1}, 2: {"nvfp4": 2, "bf16": 2}}  # per version and format, not per replica
    for v, sd in versions.items():
        for group, names in (("q", ["q/0", "q/1"]), ("h", ["h/0"])):
            own = make_engine(str(tiny_policy), group_profile(cfg, group), group, seed=0)
            own.load_weights(sd, v)
            want = [own.generate_batch([r])[0] for r in reqs]
            for n in names:
                assert [r.token_ids for r in out[v][n]] == [r.token_ids for r in want], (v, n)
                for a, b in zip(out[v][n], want, strict=True):
                    torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=0)
