"""A rich progress bar on stderr, when stderr is a terminal (stdout is the command's result: ``--json``):
step, reward, KL, staleness, time."""

from __future__ import annotations

import sys
from typing import Any

# Precision KL (staleness-0 tokens) first; in async runs most steps have none, and then the
# all-token mismatch KL is shown under its own name, since it is mostly weight lag.
KL_KEYS = ("precision/kl_exact", "precision/kl_k3", "mismatch/kl_exact", "mismatch/kl_k3")


class ProgressBar:
    def __init__(self, total: int, start: int = 0, enabled: bool = True):
        from rich.console import Console

        console = Console(stderr=True)
        self.enabled = enabled and console.is_terminal  # a log or a pipe gets no bar (and no frozen last frame)
        if not self.enabled:
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self._p = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"), console=console,
        )
        self._task = self._p.add_task("train", total=total, completed=start, info="waiting for the first batch")
        self._p.start()

    def update(self, step: int, m: dict[str, Any], elapsed: float) -> None:
        if not self.enabled:
            return
        kl_key = next((k for k in KL_KEYS if k in m), None)
        kl = f"{kl_key.split('/')[0]} kl {m[kl_key]:.2e}" if kl_key else "kl -"
        info = (
            f"reward {m.get('rollout/reward', float('nan')):.3f}  {kl}  "
            f"stale {m.get('rollout/staleness_mean', 0.0):.2f}/{m.get('rollout/staleness_max', 0.0):.0f}  "
            f"{elapsed:.0f}s"
        )
        self._p.update(self._task, completed=step, info=info)

    def note(self, text: str) -> None:
        if self.enabled:
            self._p.console.print(text)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled:
            self._p.stop()
