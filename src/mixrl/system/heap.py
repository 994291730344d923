"""One collection, then the start-up heap frozen: ``settle_heap``.

A process of mixrl (the orchestrator of a run, ``mixrl serve``, a sampler
worker) builds a large long-lived heap at start-up: modules, the model's
config, tokenizer, fleet, about 200,000-400,000 objects tracked by the cyclic
garbage collector. Every full collection walks all of them, and it runs with
the interpreter lock held, so each one stalls the loop, the trainer's thread
and every request in flight: measured at ~0.3 s per full collection, twice in
a 20-step run of the bundled demo and about once per 9 rounds of
``mixrl bench serve``. ``gc.freeze`` moves what is alive once start-up is over
out of the collector's generations; what the work allocates afterwards is
collected as usual. A process-long server calls ``settle_heap``; a run, which
may be one of several in a process, holds ``settled_heap()``.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
from collections.abc import Iterator


def settle_heap() -> None:
    """Once start-up is over: collect, then freeze what is alive (idempotent; unfrozen at
    exit, so cycles in it are collected then as without the freeze)."""
    gc.collect()
    gc.freeze()
    if not _settled:  # at exit the heap is ordinary again: cycles in it are collected, as without the freeze
        atexit.register(gc.unfreeze)
        _settled.append(True)


_settled: list[bool] = []


@contextlib.contextmanager
def settled_heap() -> Iterator[None]:
    """``settle_heap`` for a scope inside a longer process (a run in a notebook or a test
    session): on exit everything frozen returns to the collector, so what the scope left
    behind in cycles is collected as usual."""
    settle_heap()
    try:
        yield
    finally:
        gc.unfreeze()
