"""Your data as tasks: ``[data]`` in the run config, read through HF ``datasets``.

    [data]
    train = "data/train.jsonl"     # JSON/JSONL, Parquet, CSV, a saved dataset dir, a cached hub id
    heldout = "data/test.jsonl"    # or heldout_fraction = 0.05 (seeded split of train)
    prompt_key = "prompt"          # a string, or a list of chat messages

``open_split(cfg_data, split, seed, family)`` gives a ``DatasetSource``
(``mixrl.data.source``); every other column of a row reaches the reward
functions and the environment. Loaded datasets are kept per process.
"""

from __future__ import annotations

from typing import Any

from mixrl.data.loading import DataError, fingerprint, load_rows
from mixrl.data.source import DatasetSource

__all__ = ["DataError", "DatasetSource", "describe", "load_rows", "open_split"]

_CACHE: dict[tuple[Any, ...], tuple[Any, str]] = {}


def _rows(data: Any, split: str, split_seed: int) -> tuple[Any, str]:
    """(rows, digest) of ``split`` ("train" | "heldout"); ``split_seed`` seeds ``heldout_fraction``."""
    seed = split_seed
    key = (str(data.train), split, data.heldout_fraction, seed, str(data.heldout),
           _stamp(data.train), _stamp(data.heldout))  # a file edited in place is read again
    if key in _CACHE:
        return _CACHE[key]
    if split == "heldout" and data.heldout is not None:
        rows = load_rows(data.heldout, data.heldout_split)
    else:
        rows = load_rows(data.train, data.train_split)
        if data.heldout_fraction is not None:
            if len(rows) < 2:
                raise DataError(f"data.heldout_fraction: {data.train} has {len(rows)} row(s), too few to split")
            parts = rows.train_test_split(test_size=data.heldout_fraction, seed=seed, shuffle=True)
            rows = parts["test" if split == "heldout" else "train"]
        elif split == "heldout":
            raise DataError("data: no held-out data (set data.heldout or data.heldout_fraction)")
    out = (rows, fingerprint(rows))
    _CACHE[key] = out
    return out


def _stamp(spec: str | None) -> tuple[int, int]:
    from pathlib import Path

    p = Path(spec).expanduser() if spec else None
    if p is None or not p.exists():
        return (0, 0)
    files = [p] if p.is_file() else [f for f in p.rglob("*") if f.is_file()]
    return (max((f.stat().st_mtime_ns for f in files), default=0), sum(f.stat().st_size for f in files))


def open_split(data: Any, split: str, seed: int, family: str, split_seed: int = 0) -> DatasetSource:
    """A fresh ``DatasetSource`` (cursor 0) over ``split``; ``seed`` orders the epochs.

    ``split_seed`` seeds the ``heldout_fraction`` split: the run's seed, so
    training and every later evaluation see the same held-out rows.
    """
    rows, digest = _rows(data, split, split_seed)
    return DatasetSource(rows, split, seed, family=family, prompt_key=data.prompt_key,
                         shuffle=data.shuffle, digest=digest)


def has_heldout(data: Any) -> bool:
    return data.train is not None and (data.heldout is not None or data.heldout_fraction is not None)


def describe(data: Any, split_seed: int) -> dict[str, Any]:
    """What a run records about its data (compared on ``--resume``)."""
    out: dict[str, Any] = {}
    for split in ("train", "heldout") if has_heldout(data) else ("train",):
        rows, digest = _rows(data, split, split_seed)
        src = data.heldout if split == "heldout" and data.heldout is not None else data.train
        out[split] = {"source": src, "rows": len(rows), "digest": digest, "columns": list(rows.column_names)}
    return out
