"""What a run was started from (``inputs.json``), so ``--resume`` can say what changed.

    {"model": {"path": "bundled", "resolved": "...", "digest": "9f2c..."},
     "data": {"train": {"source": "...", "rows": 200, "digest": "...", "columns": [...]}, "heldout": {...}},
     "reward": ["reward.py:exact_match"]}

A model converted from a GGUF file also records that file's sha256 and tensor
types (``model.gguf``). The model digest covers the weight and config files of the model directory
(names, sizes and contents of files up to 256 MiB; only names and sizes of
larger ones, which a resumed run would read anyway). The data digests are
``mixrl.data.describe``'s content hashes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from mixrl.records.run_dir import RunDir

FULL_HASH_LIMIT = 256 << 20


class InputsChanged(ValueError):
    """``--resume`` found another model or dataset than the run started with (user error)."""


def model_digest(path: str | Path) -> str:
    p = Path(path)
    files = sorted(f for f in (p.rglob("*") if p.is_dir() else [p]) if f.is_file()
                   and f.suffix in (".safetensors", ".bin", ".json", ".model", ".txt", ".pt"))
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.relative_to(p) if p.is_dir() else f.name}:{size}".encode())
        if size <= FULL_HASH_LIMIT:
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def describe_inputs(cfg: Any, model_path: str) -> dict[str, Any]:
    out: dict[str, Any] = {"model": {"path": cfg.model.path, "resolved": model_path, "digest": model_digest(model_path)}}
    source = Path(model_path) / "gguf_source.json"  # converted from a GGUF file: its sha256 and formats
    if source.is_file():
        out["model"]["gguf"] = json.loads(source.read_text())
    if cfg.data.train is not None:
        from mixrl.data import describe

        out["data"] = describe(cfg.data, cfg.runtime.seed)
    out["reward"] = cfg.reward.specs()
    return out


def changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Human-readable differences in model and data (reward specs may change freely)."""
    out = []
    om, nm = old.get("model", {}), new.get("model", {})
    if om.get("digest") != nm.get("digest"):
        where = f" ({om.get('path')} -> {nm.get('path')})" if om.get("path") != nm.get("path") else ""
        out.append(f"model: weights {om.get('digest')} -> {nm.get('digest')}{where}")
    od, nd = old.get("data") or {}, new.get("data") or {}
    for split in sorted(set(od) | set(nd)):
        a, b = od.get(split), nd.get(split)
        if a is None or b is None:
            out.append(f"data.{split}: {'none' if a is None else a['source']} -> {'none' if b is None else b['source']}")
        elif a.get("digest") != b.get("digest"):
            parts = [f"{k} {a.get(k)} -> {b.get(k)}" for k in ("source", "rows") if a.get(k) != b.get(k)]
            out.append(f"data.{split}: {', '.join(parts + ['content ' + str(a.get('digest')) + ' -> ' + str(b.get('digest'))])}")
    return out


def check_unchanged(run_dir: Path, inputs: dict[str, Any]) -> None:
    saved = RunDir(run_dir).inputs
    if not saved.exists():
        return  # a run from before inputs.json existed: nothing to compare
    diff = changes(json.loads(saved.read_text()), inputs)
    if diff:
        raise InputsChanged(f"--resume {run_dir}: the run's inputs changed: {'; '.join(diff)} "
                            "(restore them, or start a new run with --overwrite)")
