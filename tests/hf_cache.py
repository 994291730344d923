"""The local Hugging Face cache layout tests resolve hub ids from (no hub here)."""

from __future__ import annotations

import shutil
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hf_cache_layout(hub: Path, repo: str, src: Path) -> Path:
    """Write ``src``'s files under ``hub`` as huggingface_hub does (blobs, a snapshot of
    links, refs/main) for ``repo``; returns the snapshot directory."""
    base = hub / f"models--{repo.replace('/', '--')}"
    snap = base / "snapshots" / COMMIT
    (base / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in src.iterdir():
        blob = base / "blobs" / f"blob-{f.name}"
        shutil.copy(f, blob)
        (snap / f.name).symlink_to(Path("../../blobs") / blob.name)
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text(COMMIT)
    return snap
