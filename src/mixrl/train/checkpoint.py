"""Atomic checkpoints: a checkpoint is either complete and loadable, or invisible.

Layout under ``run_dir``::

    checkpoints/
      step_000120/            complete checkpoints (meta.json written last)
        meta.json             {"step", "parts": {name: "json" | "pt"}, "created"}
        trainer.pt            a part that holds tensors (torch.save)
        orchestrator.json     a JSON-able part (data cursor, buffer, prompts in flight)
        rng.pt                torch / python / numpy RNG states (added automatically)
        hf/                   a directory written by a ``dirs`` writer: the policy in HF format
                              (config, safetensors, tokenizer), loadable by transformers, vLLM
                              and ``mixrl eval``
      latest                  one line: the directory name of the newest checkpoint

Writing (single writer): every file goes into ``checkpoints/.tmp-*`` and is
fsynced, then the directory is renamed to ``step_XXXXXX`` (one atomic rename on
the same filesystem), then ``latest`` is replaced atomically (write aside,
``os.replace``). A crash at any point leaves the previous checkpoint and the
previous ``latest`` untouched; a half-written ``.tmp-*`` directory is ignored by
readers and removed by the next save. Only the newest ``keep`` checkpoints stay.

Reading: :func:`load_latest` follows ``latest``; if it names a missing or
incomplete directory (a crash between rename and pointer update), it falls back
to the newest complete ``step_*`` directory. ``.pt`` parts are loaded with
``weights_only=True``: they may hold tensors and plain containers of numbers
and strings, nothing that needs arbitrary unpickling. JSON parts come back as
JSON (tuples as lists, keys as strings).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mixrl.records.run_dir import RunDir
from mixrl.system.files import atomic_write

_NAME = re.compile(r"^[A-Za-z0-9_-]+$")
_STEP = re.compile(r"^step_(\d{6,})$")
RESERVED = ("meta", "rng")


def capture_rng() -> dict[str, Any]:
    """RNG states of torch (CPU, and CUDA when present), python and numpy."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    py = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """The states ``capture_rng`` took (``numpy`` may be absent: older trainer states).

    CUDA states restore only where CUDA is available with at least as many devices."""
    torch.set_rng_state(state["torch"])
    v, internal, gauss = state["python"]
    random.setstate((v, tuple(internal), gauss))
    if "numpy" in state:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        for i, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)


def _is_json(value: Any) -> bool:
    try:
        return json.loads(json.dumps(value, allow_nan=True)) == value
    except (TypeError, ValueError):
        return False


_LEAVES = (type(None), bool, int, float, str, torch.Tensor, torch.dtype, torch.device, torch.Size)


def _check_plain(value: Any, where: str) -> None:
    """Raise ``ValueError`` naming the path of a value ``weights_only`` loading would reject."""
    if isinstance(value, _LEAVES):
        return
    if isinstance(value, dict):
        for k, v in value.items():
            _check_plain(k, f"{where} key {k!r}")
            _check_plain(v, f"{where}[{k!r}]")
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _check_plain(v, f"{where}[{i}]")
    else:
        raise ValueError(f"checkpoint part {where} holds a {type(value).__name__}; parts may hold "
                         "tensors, numbers, strings, None and dicts/lists/tuples of them")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(path: Path, value: Any, kind: str) -> None:
    with open(path, "wb") as f:
        if kind == "json":
            f.write(json.dumps(value, allow_nan=True).encode())
        else:
            torch.save(value, f)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(
    run_dir: str | Path, step: int, payload: dict[str, Any], *, keep: int = 3,
    dirs: dict[str, Callable[[Path], None]] | None = None,
) -> Path:
    """Write ``payload`` (part name -> value) as checkpoint ``step``; returns its directory.

    ``dirs`` (name -> writer): each writer fills ``<checkpoint>/<name>/`` (the
    HF-format model directory ``hf``) inside the same atomic write.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    for name in payload:
        if not _NAME.match(name) or name in RESERVED:
            raise ValueError(f"payload part name {name!r} must match [A-Za-z0-9_-]+ and not be one of {RESERVED}")
    kinds = {name: "json" if _is_json(v) else "pt" for name, v in payload.items()}
    for name, v in payload.items():
        if kinds[name] == "pt":
            _check_plain(v, name)  # fail now, not at resume time
    root = RunDir(run_dir).checkpoints
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-*"):  # left by a crashed writer
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-step_{step:06d}-", dir=root))
    final = RunDir(run_dir).checkpoint(step)
    try:
        parts = {}
        for name, value in {**payload, "rng": capture_rng()}.items():
            kind = kinds.get(name, "pt")
            _write(tmp / f"{name}.{kind}", value, kind)
            parts[name] = kind
        for name, writer in (dirs or {}).items():
            if not _NAME.match(name) or name in parts:
                raise ValueError(f"checkpoint directory name {name!r} must match [A-Za-z0-9_-]+ and not be a part")
            writer(tmp / name)
        meta = {"step": step, "parts": parts, "dirs": sorted(dirs or {}), "created": time.time()}
        _write(tmp / "meta.json", meta, "json")
        _fsync_dir(tmp)
        if final.exists():  # re-saving a step (e.g. after resume): move the old one aside first
            old = Path(tempfile.mkdtemp(prefix=f".tmp-old-{final.name}-", dir=root))
            os.replace(final, old / final.name)
        os.rename(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    atomic_write(root / "latest", final.name + "\n")
    _fsync_dir(root)
    for old_dir in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old_dir, ignore_errors=True)
    for stale in root.glob(".tmp-old-*"):
        shutil.rmtree(stale, ignore_errors=True)
    return final


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoint directories, oldest first."""
    return [p for _, p in RunDir(run_dir).complete_checkpoints()]


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """All parts of one checkpoint directory, plus ``step`` and ``rng``."""
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    out: dict[str, Any] = {"step": int(meta["step"])}
    for name, kind in meta["parts"].items():
        file = path / f"{name}.{kind}"
        if kind == "json":
            out[name] = json.loads(file.read_text())
        else:
            out[name] = torch.load(file, map_location=map_location, weights_only=True)
    return out


def load_latest(run_dir: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any] | None:
    """The newest complete checkpoint of ``run_dir`` (see module doc), or None if there is none."""
    root = RunDir(run_dir).checkpoints
    pointer = root / "latest"
    if pointer.is_file():
        target = root / pointer.read_text().strip()
        if _STEP.match(target.name) and (target / "meta.json").is_file():
            return load_checkpoint(target, map_location)
    complete = list_checkpoints(run_dir)
    return load_checkpoint(complete[-1], map_location) if complete else None
