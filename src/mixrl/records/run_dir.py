"""A run directory's layout: the one module that knows which file of a run holds what.

    run = RunDir("runs/demo")
    run.metrics        # runs/demo/metrics.jsonl: one JSON object per update
    run.checkpoint(40) # runs/demo/checkpoints/step_000040

The run writes them (``mixrl.runtime.run``, ``mixrl.telemetry.sinks``, ``mixrl.train.checkpoint``);
``mixrl eval``, ``mixrl export``, ``mixrl report`` and the lab read them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_STEP = re.compile(r"^step_(\d{6,})$")  # a complete checkpoint's directory name


@dataclass(frozen=True)
class RunDir:
    root: Path

    def __init__(self, root: str | Path) -> None:
        object.__setattr__(self, "root", Path(root))

    @property
    def config(self) -> Path:
        """The run's whole config as TOML (``mixrl train --resume`` and ``mixrl eval`` read it)."""
        return self.root / "config.toml"

    @property
    def derived(self) -> Path:
        """Settings the run derived from its config, and the resolved model path (JSON)."""
        return self.root / "derived.json"

    @property
    def inputs(self) -> Path:
        """Fingerprints of the run's model, data and reward code (JSON; checked on resume)."""
        return self.root / "inputs.json"

    @property
    def metrics(self) -> Path:
        """One JSON object per trainer update."""
        return self.root / "metrics.jsonl"

    @property
    def batches(self) -> Path:
        """One JSON object per trained batch (its groups and staleness)."""
        return self.root / "batches.jsonl"

    @property
    def collapse(self) -> Path:
        """The collapse monitor's flags, one JSON object each."""
        return self.root / "collapse.jsonl"

    @property
    def eval(self) -> Path:
        """The final held-out evaluation (JSON)."""
        return self.root / "eval.json"

    @property
    def summary(self) -> Path:
        """What the run did, written when it ends (JSON)."""
        return self.root / "summary.json"

    @property
    def log(self) -> Path:
        """Tracebacks and the libraries' warnings: everything the terminal does not show."""
        return self.root / "run.log"

    @property
    def marker(self) -> Path:
        """Written by ``mixrl train`` into every run directory it uses: ``--overwrite`` deletes only
        a directory that has it."""
        return self.root / ".mixrl-run"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"step_{step:06d}"

    def complete_checkpoints(self) -> list[tuple[int, Path]]:
        """(step, directory) of every complete checkpoint (``meta.json`` is written last), oldest first."""
        if not self.checkpoints.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.checkpoints.iterdir()
                 if (m := _STEP.match(p.name)) and (p / "meta.json").is_file()]
        return sorted(found)
