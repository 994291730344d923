"""Publishing one version to a mixed fleet of worker processes: quantization slots.

- ``QuantizeSlots``: never more than ``n`` holders; a freed slot goes to the waiting
  format that took longest last time; a waiter cancelled after being handed a slot
  passes it on (no slot is lost, the count returns to 0);
- worker processes of three formats with one slot: each version is quantized once per
  format, the quantizations never overlap, and every replica serves exactly what an
  engine quantizing on load serves.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import torch

from mixrl.config import build_config
from mixrl.records.generation import GenerationRequest, SamplingParams
from mixrl.runtime.backends.embedded.slots import QuantizeSlots


def test_slots_bound_holders_and_serve_the_costliest_format_first() -> None:
    async def main() -> None:
        slots = QuantizeSlots(1)
        slots.cost = {"cheap": 0.001, "dear": 0.5}
        order: list[str] = []
        peak = {"now": 0, "max": 0}

        async def quantize(fmt: str, start: asyncio.Event | None = None) -> None:
            async with slots.slot(fmt):
                peak["now"] += 1
                peak["max"] = max(peak["max"], peak["now"])
                order.append(fmt)
                if start is not None:
                    await start.wait()
                await asyncio.sleep(0.01)
                peak["now"] -= 1

        go = asyncio.Event()
        first = asyncio.ensure_future(quantize("first", go))
        await asyncio.sleep(0.01)  # "first" holds the one slot
        waiters = [asyncio.ensure_future(quantize(f)) for f in ("cheap", "new", "dear")]
        await asyncio.sleep(0.01)
        go.set()
        await asyncio.gather(first, *waiters)
        # unknown cost first (it may be the slowest), then the dearest, the cheapest last
        assert order == ["first", "new", "dear", "cheap"]
        assert peak["max"] == 1 and slots.busy == 0

    asyncio.run(main())


def test_a_cancelled_waiter_does_not_lose_the_slot() -> None:
    async def main() -> None:
        slots = QuantizeSlots(1)
        hold = asyncio.Event()

        async def holder() -> None:
            async with slots.slot("a"):
                await hold.wait()

        async def waiter(fmt: str) -> str:
            async with slots.slot(fmt):
                return fmt

        h = asyncio.ensure_future(holder())
        await asyncio.sleep(0)
        w1, w2 = asyncio.ensure_future(waiter("b")), asyncio.ensure_future(waiter("c"))
        await asyncio.sleep(0)
        w1.cancel()  # cancelled while waiting
        hold.set()
        await h
        assert await w2 == "c"
        assert w1.cancelled() and slots.busy == 0
        # handed the slot, then cancelled before it ran: the slot passes on
        h = asyncio.ensure_future(holder())
        hold.clear()
        await asyncio.sleep(0)
        w3, w4 = asyncio.ensure_future(waiter("d")), asyncio.ensure_future(waiter("e"))
        await asyncio.sleep(0)
        hold.set()
        await asyncio.sleep(0)  # the holder releases: w3's future is resolved, w3 not yet resumed
        w3.cancel()
        assert await w4 == "e"
        await h
        assert slots.busy == 0

    asyncio.run(main())


def _req(i: int) -> GenerationRequest:
    return GenerationRequest([4, 20 + i, 30, 5], SamplingParams(max_new_tokens=6, seed=i), request_id=f"r{i}")


def test_one_slot_quantizes_each_format_once_never_two_at_a_time(tiny_policy: Path) -> None:
    from transformers import AutoModelForCausalLM

    from mixrl.runtime.backends.embedded import EmbeddedBackend
    from mixrl.runtime.backends.embedded.threads import group_profile, replica_seed
    from mixrl.sampling.factory import make_engine
    from mixrl.weights.shared import SharedVersion

    fp32 = {"compute_dtype": "float32"}
    groups = [{"name": n, "profile": p, "replicas": 1, "overrides": fp32}
              for n, p in (("nv", "b200-nvfp4"), ("f8", "h100-fp8"), ("b16", "b200-bf16"))]
    cfg = build_config({"fleet": {"groups": groups}, "runtime": {"torch_threads": 1}})
    torch.manual_seed(0)
    sd = AutoModelForCausalLM.from_pretrained(str(tiny_policy)).state_dict()
    sd = {k: v + 0.003 * torch.randn_like(v) for k, v in sd.items()}  # a version the checkpoint is not
    spans: list[tuple[str, float, float]] = []  # (group, start, end) of each quantization, parent side

    async def main() -> tuple[SharedVersion, dict[str, Any]]:
        backend = EmbeddedBackend(cfg, str(tiny_policy), None, workers="process", quantize_slots=1)
        try:
            hs = [await backend.make_sampler(g["name"], g["name"] + "/0") for g in groups]
            for h in hs:
                async def timed(kind: str, payload: object, h=h, call=h._call) -> object:  # type: ignore[no-untyped-def]
                    t0 = time.perf_counter()
                    out = await call(kind, payload)
                    if kind == "quant":
                        spans.append((h.group, t0, time.perf_counter()))
                    return out

                h._call = timed  # type: ignore[method-assign]
            sv = SharedVersion.from_state_dict(sd)
            await asyncio.gather(*(h.load_weights(sv, 1) for h in hs))
            return sv, {h.name: [await h.generate(r) for r in map(_req, range(3))] for h in hs}
        finally:
            await backend.shutdown()

    sv, out = asyncio.run(main())
    assert sorted(g for g, _, _ in spans) == ["b16", "f8", "nv"]  # once per format
    spans.sort(key=lambda s: s[1])
    assert all(a[2] <= b[1] for a, b in zip(spans, spans[1:], strict=False)), spans  # one at a time
    assert sorted(sv.quantize_s) == ["bf16", "fp8_e4m3", "nvfp4"]
    for g in groups:
        name = g["name"] + "/0"
        own = make_engine(str(tiny_policy), group_profile(cfg, g["name"]), g["name"],
                          seed=replica_seed(cfg.runtime.seed, name))
        own.load_weights(sd, 1)
        want = [own.generate_batch([_req(i)])[0] for i in range(3)]
        assert [r.token_ids for r in out[name]] == [r.token_ids for r in want], name
        for a, b in zip(out[name], want, strict=True):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=0)
    sv.retire()
