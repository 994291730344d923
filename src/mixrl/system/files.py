"""Atomic file writes: a reader sees the old file or the new one, never a part of one.

``atomic_write(path, data)`` writes a temporary file beside ``path`` (same directory, so the
rename cannot cross file systems), flushes and fsyncs it, then ``os.replace``s it over
``path``. A crash leaves the old file and, at worst, a ``.<name>.*.tmp`` beside it.
Directories that appear whole (checkpoints, weight versions) are renamed into place by their
owners (``mixrl.train.checkpoint``) on the same principle.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def atomic_write(path: str | Path, data: str | bytes) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: str | Path, obj: Any, **dumps: Any) -> None:
    """``obj`` as JSON (``json.dumps`` options in ``dumps``), atomically."""
    atomic_write(path, json.dumps(obj, **dumps) + ("\n" if dumps.get("indent") is not None else ""))
