"""Reading run directories back: metrics, evaluation, collapse events.

A run directory (written by ``mixrl train``) holds ``metrics.jsonl`` (one JSON
object per trainer step: ``step``, ``time`` and namespaced metrics, per sampler
group as ``<metric>/<group>``), ``eval.json`` (final held-out evaluation),
``collapse.jsonl`` (monitor events) and ``config.json`` (the resolved config).
A compare directory holds one run directory per ``<fleet>/<arm>`` or, with several
seeds, per ``<fleet>/<arm>/seed<s>``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mixrl.records.run_dir import RunDir


@dataclass
class Run:
    path: Path
    name: str  # "<fleet>/<arm>" inside a compare directory, else the folder name
    rows: list[dict[str, Any]] = field(default_factory=list)
    eval: dict[str, Any] = field(default_factory=dict)
    evals: list[dict[str, Any]] = field(default_factory=list)  # periodic evaluations
    base: dict[str, Any] = field(default_factory=dict)  # evaluation of the starting policy
    episodes: list[dict[str, Any]] = field(default_factory=list)  # decoded sample episodes
    events: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def fleet(self) -> str:
        return self.name.split("/")[0] if "/" in self.name else ""

    @property
    def arm(self) -> str:
        parts = self.name.split("/")
        return parts[1] if len(parts) == 3 else parts[-1]

    @property
    def seed(self) -> str:
        """``seed<s>`` of a ``<fleet>/<arm>/seed<s>`` run; "" for a single-seed layout."""
        parts = self.name.split("/")
        return parts[2] if len(parts) == 3 else ""

    @property
    def cell(self) -> str:
        """``<fleet>/<arm>``: the runs of one cell differ only by seed."""
        return "/".join(self.name.split("/")[:2])

    def series(self, key: str) -> tuple[list[int], list[float]]:
        xs, ys = [], []
        for r in self.rows:
            v = r.get(key)
            if isinstance(v, int | float) and math.isfinite(v):
                xs.append(int(r.get("step", len(xs) + 1)))
                ys.append(float(v))
        return xs, ys

    def mean(self, key: str, first: int | None = None, last: int | None = None) -> float:
        _, ys = self.series(key)
        if first is not None:
            ys = ys[:first]
        if last is not None:
            ys = ys[-last:]
        return sum(ys) / len(ys) if ys else math.nan

    def groups(self) -> list[str]:
        """Sampler groups seen in per-group metrics (``share/samples/<group>``)."""
        seen: dict[str, None] = {}
        for r in self.rows:
            for k in r:
                if k.startswith("share/samples/"):
                    seen[k.split("/", 2)[2]] = None
        return list(seen)

    @property
    def collapsed(self) -> bool:
        return any(e.get("signal") == "collapse" and e.get("active") for e in self.events)

    def flags(self) -> list[str]:
        return sorted({e["signal"] for e in self.events if e.get("active")})


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a kill mid-write; the rest is still good
    return out


def load_run(path: Path, name: str | None = None) -> Run:
    path = Path(path)
    run = Run(path=path, name=name or path.name)
    run.rows = _jsonl(RunDir(path).metrics)
    run.events = _jsonl(RunDir(path).collapse)
    run.evals = _jsonl(path / "evals.jsonl")
    f = RunDir(path).eval
    if f.exists():
        ev = json.loads(f.read_text())
        # ``mixrl train`` writes {"final": {...}, "base": {...}, "gain": ...}; a bare
        # evaluation ({"pass@1": ...}) is accepted too.
        run.eval = dict(ev.get("final", ev))
        if "base" in ev and isinstance(ev["base"], dict):
            run.base = dict(ev["base"])
            run.evals.insert(0, {**ev["base"], "cost/cumulative": 0.0})
        if "k" in ev:
            run.eval.setdefault("k", ev["k"])
    run.episodes = _jsonl(path / "episodes.jsonl")
    for name in ("config.json", "config.toml"):
        c = path / name
        if c.exists():
            run.config = json.loads(c.read_text()) if name.endswith(".json") else _toml(c)
            break
    return run


def _toml(path: Path) -> dict[str, Any]:
    import tomllib

    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError:
        return {}


def load_runs(path: Path) -> list[Run]:
    """A run directory -> [run]; a compare directory -> every ``<fleet>/<arm>`` run in it."""
    path = Path(path)
    if RunDir(path).metrics.exists():
        return [load_run(path)]
    runs = [
        load_run(m.parent, str(m.parent.relative_to(path)))
        for pattern in ("*/*/metrics.jsonl", "*/*/seed*/metrics.jsonl")  # one seed / several
        for m in sorted(path.glob(pattern))
    ]
    if not runs:
        raise FileNotFoundError(f"no metrics.jsonl under {path} (expected a run or compare directory)")
    return runs
