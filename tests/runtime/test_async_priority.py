"""Sampler worker processes run at a lower scheduling priority than the orchestrator
(its event loop and trainer are the critical path of an async run), and still serve."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from mixrl.records.generation import GenerationRequest, SamplingParams
from mixrl.runtime.backends.embedded.process import ProcessSampler
from mixrl.runtime.backends.embedded.worker import SAMPLER_NICE
from mixrl.sampling.profiles import get_profile


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="no POSIX priorities")
def test_sampler_worker_is_nicer_than_its_parent(tiny_policy: Path) -> None:
    async def main() -> tuple[int, int]:
        h = ProcessSampler("fp32/0", "fp32")
        await h.start(str(tiny_policy), get_profile("fp32"), 1, 1)
        try:
            res = await h.generate(GenerationRequest([4, 20, 30, 5], SamplingParams(max_new_tokens=4, seed=0), request_id="r"))
            return os.getpriority(os.PRIO_PROCESS, h.pid), len(res.token_ids)
        finally:
            await h.close()

    nice, n = asyncio.run(main())
    assert SAMPLER_NICE > 0
    assert nice == min(os.getpriority(os.PRIO_PROCESS, 0) + SAMPLER_NICE, 19)
    assert n >= 1
