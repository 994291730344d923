"""Read a dataset through Hugging Face ``datasets``: files, saved directories, hub ids.

    rows = load_rows("data/train.jsonl")          # JSON / JSONL, Parquet, CSV (by suffix)
    rows = load_rows("saved_dir")                 # a ``save_to_disk`` directory (Dataset or DatasetDict)
    rows = load_rows("data_dir")                  # a directory of data files (``load_dataset(dir)``)
    rows = load_rows("user/name", split="test")   # a hub dataset, from the local cache only

Hub datasets are read offline (``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE`` set
while loading): a run never downloads. Anything that cannot be read is a
``DataError`` with one line naming the source, which the CLI reports with
exit status 2.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


class DataError(ValueError):
    """A dataset that cannot be read or does not fit the config (one line, names the source)."""


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """Offline for the libraries too: they read the variables once, at import."""
    import datasets.config
    import huggingface_hub.constants

    keys = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    old = {k: os.environ.get(k) for k in keys}
    mods = (datasets.config, huggingface_hub.constants)
    old_attr = [(m, k, getattr(m, k)) for m in mods for k in keys if hasattr(m, k)]
    os.environ.update({k: "1" for k in keys})
    for m, k, _ in old_attr:
        setattr(m, k, True)
    try:
        yield
    finally:
        for m, k, v in old_attr:
            setattr(m, k, v)
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _quiet() -> None:
    """No progress bars or info lines from ``datasets`` while reading small files."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()


def looks_like_path(spec: str) -> bool:
    return Path(spec).suffix.lower() in BUILDERS or spec.startswith((".", "/", "~")) or Path(spec).exists()


def load_rows(spec: str, split: str = "train") -> Any:
    """A ``datasets.Dataset`` from ``spec`` (see the module docstring)."""
    import datasets

    _quiet()
    p = Path(spec).expanduser()
    try:
        if p.is_file():
            builder = BUILDERS.get(p.suffix.lower())
            if builder is None:
                raise DataError(f"{spec}: unknown file type {p.suffix!r}; use one of {sorted(BUILDERS)}")
            return datasets.load_dataset(builder, data_files=str(p), split="train")
        if p.is_dir():
            if (p / "dataset_info.json").exists() or (p / "dataset_dict.json").exists() or (p / "state.json").exists():
                ds = datasets.load_from_disk(str(p))
            else:
                ds = datasets.load_dataset(str(p))
            return _pick(ds, split, spec)
        if looks_like_path(spec):
            raise DataError(f"{spec}: no such file or directory")
        return _from_hub_cache(spec, split)
    except DataError:
        raise
    except Exception as e:  # datasets raises many types; the user needs the source and the reason
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"{spec}: cannot read it as a dataset ({type(e).__name__}: {msg})") from None


def _from_hub_cache(spec: str, split: str) -> Any:
    """A hub id: its snapshot in the hub cache (``hf download``), else the ``datasets`` cache."""
    import datasets
    from huggingface_hub import snapshot_download

    with _offline():
        try:
            local = snapshot_download(spec, repo_type="dataset", local_files_only=True)
        except Exception:
            local = None
        if local is not None:
            return _pick(datasets.load_dataset(local), split, spec)
        try:
            return datasets.load_dataset(spec, split=split)
        except (ConnectionError, FileNotFoundError) as e:
            raise DataError(f"{spec}: not a file or directory, and not a dataset in the local Hugging Face cache "
                            f"(runs never download; fetch it first with `hf download --repo-type dataset {spec}`)") from e


def _pick(ds: Any, split: str, spec: str) -> Any:
    import datasets

    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataError(f"{spec}: no split {split!r}; it has {sorted(ds)}")
        return ds[split]
    return ds


def fingerprint(rows: Any) -> str:
    """A digest of the rows' content (what ``--resume`` compares): columns and every value."""
    h = hashlib.sha256(json.dumps(sorted(rows.column_names)).encode())
    for batch in rows.iter(batch_size=1024):
        h.update(json.dumps(batch, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]
