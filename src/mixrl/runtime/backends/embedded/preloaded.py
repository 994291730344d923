"""Imported last by the worker processes' forkserver (``process.mp_context``), once everything
the workers share is imported: the server's heap is collected, then frozen (``gc.freeze``), so
the workers forked from it never walk it in a collection. A collection writes to the header of
every object it visits, and each write copies the page it lands on into the worker (copy on
write): a worker's first collection would otherwise turn the server's shared pages (torch,
transformers, the engine's modules: ~80 MB per worker on the bundled policy) into a private
copy per worker. Measured in ``mixrl bench e2e`` (``memory_at_peak_mb``). Unfrozen when the
server exits, so what it holds is finalized as without the freeze (extension modules report
instances still alive at exit otherwise)."""

import atexit
import gc

gc.collect()
gc.freeze()
atexit.register(gc.unfreeze)
