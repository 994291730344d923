"""The study's settings: the bundled compare.toml, a config's ``[study]`` table over it, and the
config a study directory was started with."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any


def default_config_path() -> Path:
    return Path(__file__).resolve().parents[2] / "configs" / "compare.toml"


def study_table(path: Path | None) -> dict[str, Any]:
    """The config's ``[study]`` table over the bundled compare.toml's: a run config of yours
    (e.g. ``examples/real_model/config.toml``) needs no ``[study]`` of its own, and each of its
    sub-tables (``real``, ``fp32``, ``monitor``) replaces the bundled one whole."""

    def read(p: Path) -> dict[str, Any]:
        try:
            return dict(tomllib.loads(p.read_text()).get("study", {}))
        except (OSError, tomllib.TOMLDecodeError):
            return {}

    bundled = read(default_config_path())
    return bundled if path is None else {**bundled, **read(Path(path))}


def saved_config(out: Path) -> Path | None:
    """The config a study in ``out`` was started with (``OUT/study.json``), if any."""
    try:
        c = json.loads((Path(out) / "study.json").read_text())["args"].get("config")
    except (OSError, KeyError, json.JSONDecodeError):
        return None
    return Path(c) if c else None
