"""CPU accounting of the sampler worker processes over a run's training loop.

- a worker's CPU is read from /proc while it runs and its last reading is kept once it
  is gone (a killed replica still counts up to its death);
- a run where a worker is SIGKILLed mid-run: ``samplers_s`` counts the killed replica up
  to its last reading and its replacement from the moment it was ready; the
  replacement's start-up is ``sampler_startup_s``, apart.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

from mixrl.records.generation import GenerationRequest, SamplingParams
from mixrl.runtime.backends.embedded.process import ProcessSampler
from mixrl.runtime.cpu import proc_cpu
from mixrl.runtime.run import train
from mixrl.sampling.profiles import get_profile

from .test_run import tiny_cfg


def test_worker_cpu_read_live_and_kept_after_death(tiny_policy: Path) -> None:
    async def main() -> tuple[float | None, float | None, float | None, float | None]:
        h = ProcessSampler("fp32/0", "fp32")
        await h.start(str(tiny_policy), get_profile("fp32"), 1, 1)
        try:
            ready = h.cpu_ready
            for i in range(3):
                await h.generate(GenerationRequest([4, 20, 30, 5], SamplingParams(max_new_tokens=6, seed=i),
                                                   request_id=f"r{i}"))
            live = h.cpu_s()
            os.kill(h.pid, signal.SIGKILL)
            t0 = time.monotonic()
            while not h.dead and time.monotonic() - t0 < 30:
                await asyncio.sleep(0.01)
            after = h.cpu_s()
            return ready, live, after, h.cpu_s()
        finally:
            await h.close()

    ready, live, after, again = asyncio.run(main())
    # start-up: forked from the preloaded forkserver, the engine's weights built lazily: it may
    # take less than one clock tick (/proc counts in ticks), so 0.0 is a valid reading
    assert ready is not None and ready >= 0
    assert live is not None and live >= ready
    assert after is not None and after >= live  # read once more at exit, then kept
    assert again == after
    assert proc_cpu(-1) is None


def test_killed_and_replacement_replicas_are_counted(tiny_policy: Path, tmp_path: Path) -> None:
    seen: dict[str, Any] = {}

    async def hook(orch: Any) -> None:
        async def chaos() -> None:
            while orch.step < 1:
                await asyncio.sleep(0.005)
            h = orch.backend.samplers["fp32/0"]
            seen["killed"] = h
            os.kill(h.pid, signal.SIGKILL)
            # run on until the replacement has served a few updates, then stop (a clean end)
            while not [n for n in orch.backend.samplers if n not in orch._cpu.w0]:
                await asyncio.sleep(0.01)
            step = orch.step
            while orch.step < step + 2:
                await asyncio.sleep(0.01)
            orch.request_stop()

        asyncio.ensure_future(chaos())
        seen["orch"] = orch

    cfg = tiny_cfg(tiny_policy, tmp_path, runtime={"steps": 500})
    s = train(cfg, evaluate=False, hook=hook)
    assert s["interrupted"] and s["steps"] < 500
    cpu, orch, killed = s["cpu"], seen["orch"], seen["killed"]
    w0, w1, reps = orch._cpu.w0, orch._cpu.w1, orch.backend.samplers
    assert set(w0) == {"fp32/0", "fp32/1", "fp8/0"}  # the replicas serving when the loop started
    late = [h for n, h in reps.items() if n not in w0]
    assert late and orch.history[-1]["fleet/replica_failures"] >= 1  # the killed one was replaced
    # the killed one worked in the loop and counts, up to its last reading (taken as it died)
    assert killed.dead and w1["fp32/0"] == killed.cpu_s() and w1["fp32/0"] - w0["fp32/0"] > 0
    assert set(w1) == set(reps) and all(w1[n] <= h.cpu_s() for n, h in reps.items())
    # each replica from the loop's start (or from when it became ready) to the loop's end
    want = sum(w1[n] - w0[n] for n in reps if n in w0)
    want += sum(w1[h.name] - h.cpu_ready for h in late)
    assert abs(cpu["samplers_s"] - want) < 1e-6
    # the replacement's start-up (interpreter, engine) is reported apart, not as sampling
    assert abs(cpu["sampler_startup_s"] - sum(h.cpu_ready for h in late)) < 1e-6
    assert cpu["sampler_startup_s"] >= 0  # may be under one clock tick (see the test above)
