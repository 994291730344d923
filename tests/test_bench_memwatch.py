"""bench/memwatch: a process tree's PSS counts memory its processes share once."""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import pytest

from mixrl.lab.bench.memwatch import PeakMemory, tree_pss_bytes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

MB = 1 << 20
SIZE = 64 * MB


def _hold(buf: mmap.mmap, ready, done) -> None:  # type: ignore[no-untyped-def]
    sum(buf[i] for i in range(0, SIZE, 4096))  # map every page of the shared buffer
    ready.set()
    done.wait(60)


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def test_shared_pages_count_once_and_the_peak_sees_children():
    ctx = mp.get_context("fork")
    buf = mmap.mmap(-1, SIZE)  # anonymous, shared with children forked below
    buf.write(b"\x01" * SIZE)
    before = tree_pss_bytes()
    with PeakMemory(every=0.05) as mem:
        mem.phase("children")
        ready, done = [ctx.Event() for _ in range(2)], ctx.Event()
        kids = [ctx.Process(target=_hold, args=(buf, r, done)) for r in ready]
        for k in kids:
            k.start()
        for r in ready:
            assert r.wait(60)
        time.sleep(0.3)
        during = tree_pss_bytes()
        rss = _rss(os.getpid()) + sum(_rss(k.pid) for k in kids)
        done.set()
        for k in kids:
            k.join()
    # three processes map the same 64 MB: RSS counts it three times, PSS once
    assert rss - before >= 2.5 * SIZE
    assert during - before < 1.5 * SIZE + 2 * 30 * MB  # + each child's own interpreter pages
    assert mem.peak_bytes >= during * 0.9 and mem.peaks["children"] >= during * 0.9
    out = mem.gb()
    assert out["peak_pss_gb"] == round(mem.peak_bytes / 2**30, 2) and "children" in out["peak_pss_gb_by_phase"]
