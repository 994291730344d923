"""Sampler worker processes, shared-memory weights, staleness admission.

- weights pre-quantized once per (version, format) and mapped by a replica give the
  same tokens and log-probs as the replica quantizing on load itself;
- a sampler worker process killed with SIGKILL mid-run: the run completes, no
  prompt is lost or trained twice, no episode is recorded as a failure;
- async with ``max_staleness = 0``: no group is dropped, every token is fresh.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import torch

from mixrl.records.generation import GenerationRequest, SamplingParams
from mixrl.runtime.run import train
from mixrl.weights.formats import format_key, quantizer, serving_profile
from mixrl.weights.shared import SharedVersion, map_manifest

from .test_run import assert_complete_and_unique, metrics, tiny_cfg


def _reqs() -> list[GenerationRequest]:
    return [GenerationRequest([4, 20 + i, 30, 5], SamplingParams(max_new_tokens=8, seed=i), request_id=f"r{i}")
            for i in range(3)]


def test_quantized_once_equals_quantize_on_load(tiny_policy: Path) -> None:
    from transformers import AutoModelForCausalLM

    from mixrl.sampling.factory import make_engine
    from mixrl.sampling.profiles import get_profile, with_overrides

    sd = AutoModelForCausalLM.from_pretrained(str(tiny_policy)).state_dict()
    sd = {k: v + 0.003 * torch.randn_like(v) for k, v in sd.items()}  # a version the checkpoint is not
    prof = with_overrides(get_profile("b200-nvfp4"), compute_dtype="float32")
    key = format_key(prof, tied=True)
    assert key == "nvfp4"
    calls = {"n": 0}
    q = quantizer(prof)

    def counting(name: str, t: torch.Tensor) -> torch.Tensor | None:
        calls["n"] += 1
        return q(name, t)

    own = make_engine(str(tiny_policy), prof, "g", seed=1)
    own.load_weights(sd, 1)
    shared = SharedVersion.from_state_dict(sd)
    replicas = [make_engine(str(tiny_policy), serving_profile(prof, key), "g", seed=1) for _ in range(2)]
    for e in replicas:
        e.load_weights(map_manifest(shared.for_format(key, counting)), 1)
    assert calls["n"] == len(sd)  # one pass over the version, however many replicas map it
    assert list(shared.quantize_s) == ["nvfp4"]
    want = own.generate_batch(_reqs())
    for e in replicas:
        got = e.generate_batch(_reqs())
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=0)
    # the quantized file holds only what the format changes; the rest maps the base file
    man = shared.manifest("nvfp4")
    assert man["model.embed_tokens.weight"] == shared.manifest()["model.embed_tokens.weight"]
    assert man["model.layers.0.mlp.down_proj.weight"][0] != shared.manifest()["model.layers.0.mlp.down_proj.weight"][0]
    files = {f for f, *_ in man.values()}
    shared.retire()
    assert not any(os.path.exists(f) for f in files)  # retired and unheld: the memory is freed


def test_sigkill_of_a_sampler_worker_mid_run(tiny_policy: Path, tmp_path: Path) -> None:
    killed: dict[str, int] = {}

    async def hook(orch: Any) -> None:
        assert orch.backend.workers == "process"

        async def chaos() -> None:
            while orch.step < 1:
                await asyncio.sleep(0.005)
            h = orch.backend.samplers["fp32/0"]
            killed[h.name] = h.pid
            os.kill(h.pid, signal.SIGKILL)  # the process dies; the fleet learns it from the pipe

        asyncio.ensure_future(chaos())

    cfg = tiny_cfg(tiny_policy, tmp_path, runtime={"steps": 4})
    s = train(cfg, evaluate=False, hook=hook)
    assert s["steps"] == 4 and list(killed) == ["fp32/0"]
    pid = killed["fp32/0"]
    assert not os.path.exists(f"/proc/{pid}") or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    assert_complete_and_unique(tmp_path, 4)  # nothing lost, nothing trained twice
    ms = metrics(tmp_path)
    assert ms[-1]["fleet/replica_failures"] >= 1
    assert sum(m["rollout/infra_failed"] for m in ms) == 0  # failover, never reward 0


def test_async_max_staleness_0_drops_nothing(tiny_policy: Path, tmp_path: Path) -> None:
    cfg = tiny_cfg(tiny_policy, tmp_path, runtime={"steps": 4, "mode": "async", "max_staleness": 0})
    train(cfg, evaluate=False)
    ms = metrics(tmp_path)
    assert ms[-1]["rollout/dropped_groups"] == 0
    assert max(m["rollout/staleness_max"] for m in ms) == 0
    assert_complete_and_unique(tmp_path, 4)


def test_a_worker_joins_requests_from_its_reader_yet_a_load_comes_first(tiny_policy: Path) -> None:
    """Requests join a running batch straight from the worker's reader thread; one sent after a
    load in the same message waits for the load and sees the new version."""
    from transformers import AutoModelForCausalLM

    from mixrl.runtime.backends.embedded.process import ProcessSampler

    sd = AutoModelForCausalLM.from_pretrained(str(tiny_policy)).state_dict()
    new = {k: v * 1.2 for k, v in sd.items()}

    def req(i: int, n: int) -> GenerationRequest:
        return GenerationRequest([4, 20 + i, 30, 5], SamplingParams(max_new_tokens=n, seed=i, stop_ids=[]),
                                 request_id=f"r{i}")

    async def go() -> Any:
        h = ProcessSampler("w/0", "fp32")
        await h.start(str(tiny_policy), "fp32", 0, 1, batching={"max_wait_ms": 1})
        await h.load_weights(sd, 1)
        long = asyncio.ensure_future(h.generate(req(0, 60)))
        while (await h.stats())["prefills"] == 0:  # the long request is decoding
            await asyncio.sleep(0.002)
        joined = await asyncio.gather(*(h.generate(req(i, 3)) for i in (1, 2)))
        # one message [load, gen]: the request was sent after the load
        _, after = await asyncio.gather(h.load_weights(new, 2), h.generate(req(3, 3)))
        first, stats = await long, await h.stats()
        await h.close()
        return first, joined, after, stats

    first, joined, after, stats = asyncio.run(go())
    assert first.version == 1 and [r.version for r in joined] == [1, 1] and after.version == 2
    assert stats["requests"] == 4 and stats["gen_tokens"] == 60 + 3 + 3 + 3
    assert stats["joined_direct"] >= 2  # the two sent while the long one decoded: not through the loop
