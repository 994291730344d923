"""The study's per-update curves: one figure per fleet, one line per cell, a band over seeds.

``study_<fleet>.png`` has a panel per metric of ``PANELS`` (training reward,
precision KL, lag KL, precision out-of-range share, gradient norm, entropy,
format-error and empty-reply endings). Each cell of the fleet's 2 x 2 (``grpo`` /
``sc+mis+top-p`` x sync / async) and the on-policy reference is one line: the mean
over its seeds of each seed's moving average, with the seeds' min–max as a band.
A collapse that the collapse monitor (replayed with the study's settings) detects
in a run is marked with a cross at its first collapse step, on every panel,
in the cell's colour.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from mixrl.lab.study.runs import Run
from mixrl.records import keys as K
from mixrl.telemetry.monitor import monitor_config, replay

# (keys, first present wins; title)
PANELS: tuple[tuple[tuple[str, ...], str], ...] = (
    ((K.REWARD,), "training reward (each arm's own sampler)"),
    (K.PRECISION_KL, "precision KL (staleness-0 tokens)"),
    (K.LAG_KL, "lag KL (stale tokens)"),
    ((K.PRECISION_OOB,), "precision: share of tokens outside [0.2, 5]"),
    ((K.GRAD_NORM,), "gradient norm"),
    ((K.ENTROPY,), "entropy"),
    ((K.FORMAT_END,), "share of episodes ending on format errors"),
    ((K.EMPTY_END,), "share of episodes whose last reply is empty"),
)
ARM_COLOR = {"grpo": "tab:red", "sc+mis+top-p": "tab:blue", "on-policy": "black"}
MODE_STYLE = {"sync": "-", "async": "--"}
REFERENCE = "reference"


def pick_key(runs: list[Run], keys: tuple[str, ...]) -> str | None:
    """The first of ``keys`` any run recorded."""
    return next((k for k in keys if any(r.series(k)[0] for r in runs)), None)


def moving_average(xs: list[int], ys: list[float], window: int) -> dict[int, float]:
    """Step -> mean of the last ``window`` recorded values up to it (steps without a value skipped)."""
    out, buf = {}, []
    for x, y in zip(xs, ys, strict=True):
        buf = (buf + [y])[-window:]
        out[x] = sum(buf) / len(buf)
    return out


def band(runs: list[Run], key: str, window: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(steps, mean, min, max) over the runs' moving averages, at every step any run recorded."""
    per_run = [moving_average(*r.series(key), window) for r in runs]
    steps = sorted({s for m in per_run for s in m})
    vals = [[m[s] for m in per_run if s in m] for s in steps]
    return (np.asarray(steps), np.asarray([np.mean(v) for v in vals]), np.asarray([min(v) for v in vals]),
            np.asarray([max(v) for v in vals]))


def collapse_steps(runs: list[Run], monitor: Mapping[str, Any] | None) -> dict[str, int]:
    """Run name -> first collapse step, for the runs the replayed monitor flags."""
    cfg = monitor_config(monitor)
    out = {}
    for r in runs:
        mon, _ = replay(r.rows, cfg)
        if mon.first_collapse_step is not None:
            out[r.name] = int(mon.first_collapse_step)
    return out


def fleet_cells(runs: list[Run], fleet: str) -> dict[str, list[Run]]:
    """``<fleet>-<mode>/<arm>`` and ``reference/<arm>`` cells -> their runs (one per seed)."""
    cells: dict[str, list[Run]] = {}
    for r in runs:
        if r.fleet in (f"{fleet}-sync", f"{fleet}-async", REFERENCE):
            cells.setdefault(r.cell, []).append(r)
    return dict(sorted(cells.items()))


def _style(cell: str) -> tuple[str, str]:
    fleet, arm = cell.split("/", 1)
    mode = fleet.rsplit("-", 1)[-1] if "-" in fleet else "sync"
    return ARM_COLOR.get(arm, "tab:green"), "-." if fleet == REFERENCE else MODE_STYLE.get(mode, "-")


def plot_fleet(runs: list[Run], fleet: str, out: Path, monitor: Mapping[str, Any] | None = None,
               window: int = 5) -> Path | None:
    """``out/study_<fleet>.png``; None when the fleet has no run."""
    cells = fleet_cells(runs, fleet)
    if not any(c.startswith(fleet) for c in cells):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    collapsed = collapse_steps([r for rs in cells.values() for r in rs], monitor)
    fig, axes = plt.subplots(2, 4, figsize=(24, 9))
    for ax, (keys, title) in zip(axes.flat, PANELS, strict=True):
        for cell, rs in cells.items():
            key = pick_key(rs, keys)
            if key is None:
                continue
            color, style = _style(cell)
            xs, mean, lo, hi = band(rs, key, window)
            ax.plot(xs, mean, style, color=color, lw=1.5, label=f"{cell} ({len(rs)} seeds)")
            ax.fill_between(xs, lo, hi, color=color, alpha=0.12, lw=0)
            for r in rs:
                if r.name in collapsed:
                    step = collapsed[r.name]
                    i = int(np.searchsorted(xs, step))
                    if i < len(xs):
                        ax.plot([xs[i]], [mean[i]], "x", color=color, ms=11, mew=2.5)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("update")
        ax.grid(alpha=0.3)
        if "KL" in title and any(np.nanmin(ln.get_ydata()) > 0 for ln in ax.lines if len(ln.get_ydata())):
            ax.set_yscale("log")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if collapsed:
        handles.append(plt.Line2D([], [], marker="x", ls="", color="gray", ms=9, mew=2))
        labels.append("collapse detected (first step, one run)")
    fig.legend(handles, labels, loc="lower center", ncol=min(6, len(labels)), fontsize=9)
    n_col = f"{len(collapsed)} run(s) flagged" if collapsed else "no collapse detected"
    fig.suptitle(f"{fleet} fleet: per-update curves, mean over seeds of a {window}-update moving average, "
                 f"band: seeds' min-max; solid sync (precision only), dashed async (precision + lag), "
                 f"dash-dot on-policy reference; collapse monitor: {n_col}", fontsize=11)
    fig.tight_layout(rect=(0, 0.06, 1, 0.96))
    path = Path(out) / f"study_{fleet}.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def study_fleets(runs: list[Run]) -> list[str]:
    """The fleets that ran both modes or either: ``mixed-sync`` -> ``mixed``."""
    return sorted({r.fleet.rsplit("-", 1)[0] for r in runs if r.fleet.endswith(("-sync", "-async"))})


def plot_study(runs: list[Run], out: Path, monitor: Mapping[str, Any] | None = None) -> list[Path]:
    Path(out).mkdir(parents=True, exist_ok=True)
    return [p for f in study_fleets(runs) if (p := plot_fleet(runs, f, out, monitor)) is not None]

