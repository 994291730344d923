"""Imported last by the worker processes' forkserver (``process.mp_context``), once everything
the workers share is imported: the server's heap is collected, then frozen (``gc.freeze``), so
the workers forked from it never walk it in a collection. A collection writes to the header of
every object it visits, and each write copies the page it lands on into the worker (copy on
write): a worker's first collection would otherwise turn the server's shared pages (torch,
transformers, the engine's modules: ~150 MB) into a private copy per worker. Measured in
``mixrl bench e2e`` (``memory_at_peak_mb``)."""

import gc

gc.collect()
gc.freeze()
