"""Figures of a run or a comparison, mirroring the seed study's panels.

``curves.png``   one panel per metric, one line per arm (fleet by line style)
``groups.png``   per sampler group: KL, and share of samples vs share of
                 out-of-range tokens (bars), for one arm on the mixed fleet
``passk_cost.png`` held-out pass@k against cumulative modelled sampling cost
``timelines.png`` the seed's "one cell per turn" figure: a few sampled episodes per
                 arm, one row each, one cell per assistant reply (colour: reply length,
                 red: empty), the episode's ending status at the right
``precision_lag.png`` per sampler group, over the updates: the KL of staleness-0 tokens
                 (``precision/``: what the group's number formats cost) beside the KL of
                 stale tokens (``lag/``: what asynchrony costs), one estimator for both
                 (docs/corrections.md section 10)
"""

from __future__ import annotations

import math
from pathlib import Path

from mixrl.lab.study.runs import Run
from mixrl.records import keys as K

PANELS: tuple[tuple[str, str], ...] = (
    ("rollout/reward", "training reward"),
    ("KL", "sampler-trainer KL"),
    ("optim/grad_norm", "gradient norm"),
    ("policy/entropy", "entropy"),
    ("mismatch/ratio_oob", "share of tokens with ratio outside [0.2, 5]"),
    ("rollout/length", "trajectory length (tokens)"),
    ("rollout/format_error_end", "share of episodes ending on format errors"),
    ("rollout/empty_last_reply", "share of episodes whose last reply is empty"),
    ("rollout/turns", "assistant turns per episode"),
    ("rollout/clipped_frac", "share of episodes cut at max_new_tokens or the token budget"),
)
FLEET_STYLE = {"mixed": "-", "homogeneous": "--", "stress": ":", "reference": "-.", "exact": (0, (1, 3))}


def kl_key(run: Run) -> str:
    """The one KL of every arm: exact where the support was recorded, else k3 (k1 is too noisy),
    over staleness-0 tokens (``precision/``, docs/corrections.md section 10); ``mismatch/``
    only for runs written before the split."""
    for k in K.PRECISION_KL:
        if run.series(k)[1]:
            return k
    return "mismatch/kl_k3"


def smooth(ys: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y
        if i >= window:
            acc -= ys[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_curves(runs: list[Run], out: Path, window: int = 5) -> Path:
    plt = _plt()
    fig, axes = plt.subplots(2, 5, figsize=(25, 8.5))
    arms = sorted({r.arm for r in runs})
    colors = {a: plt.cm.tab10(i % 10) for i, a in enumerate(arms)}
    for ax, (key, title) in zip(axes.flat, PANELS, strict=False):
        for run in runs:
            k = kl_key(run) if key == "KL" else key
            xs, ys = run.series(k)
            if not xs:
                continue
            ax.plot(xs, smooth(ys, window), FLEET_STYLE.get(run.fleet, "-"),
                    color=colors[run.arm], label=run.name, lw=1.4)
        ax.set_title(title if key != "KL" else f"{title} ({kl_key(runs[0]).replace('/', ' ')})")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if key == "KL" and any(y > 0 for ln in ax.lines for y in ln.get_ydata()):
            ax.set_yscale("log")
    axes.flat[-1].axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    axes.flat[-1].legend(handles, labels, loc="center", fontsize=9)
    if len(runs) == 1:
        fig.suptitle(f"{runs[0].name}: training curves of one run (moving average over {window} steps)")
    else:
        fig.suptitle(f"Training curves of {len(runs)} runs (moving average over {window} steps; solid: mixed "
                     "fleet, dashed: homogeneous, dotted: stress, dash-dot: reference arms)")
    fig.tight_layout()
    path = Path(out) / "curves.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def group_kl(run: Run) -> tuple[dict[str, float], str]:
    """Per group, the precision KL the report's table shows (``precision_lag_means``: token-weighted
    over the run, the table's estimator), and its label; a run written before the precision/lag split
    gives the step mean of ``kl_key``."""
    est = split_estimator(run)
    table = {str(r["group"]): r[f"precision {est}"] for r in precision_lag_means(run)}
    if any(isinstance(v, float) and math.isfinite(v) for v in table.values()):
        return {g: float(v) if isinstance(v, float) else math.nan for g, v in table.items()}, f"precision {est}"
    k = kl_key(run)
    return {g: run.mean(f"{k}/{g}") for g in run.groups()}, k.replace("/", " ")


def group_stats(run: Run) -> dict[str, dict[str, float]]:
    """Per group, averaged over training: KL (``group_kl``), share of samples, share of OOB tokens."""
    k = kl_key(run)
    kl = group_kl(run)[0]
    return {
        g: {
            "kl": kl.get(g, math.nan),
            "share_samples": run.mean(f"share/samples/{g}"),
            "share_oob": run.mean(f"share/oob_tokens/{g}"),
            "ratio_oob": run.mean(f"{k.split('/')[0]}/ratio_oob/{g}"),
        }
        for g in run.groups()
    }


def plot_groups(run: Run, out: Path) -> Path | None:
    stats = group_stats(run)
    if not stats:
        return None
    plt = _plt()
    names = sorted(stats, key=lambda g: -_nz(stats[g]["kl"]))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(14, 4.5))
    bars = a1.bar(names, [_nz(stats[g]["kl"]) for g in names], color="tab:red")
    a1.bar_label(bars, labels=[f"{stats[g]['kl']:.3g}" if math.isfinite(stats[g]["kl"]) else "n/a" for g in names])
    a1.set_title(f"{run.name}: sampler-trainer KL per group ({group_kl(run)[1]}, token-weighted as in the table)")
    x = range(len(names))
    a2.bar([i - 0.2 for i in x], [_nz(stats[g]["share_samples"]) for g in names], 0.4,
           label="share of samples")
    a2.bar([i + 0.2 for i in x], [_nz(stats[g]["share_oob"]) for g in names], 0.4,
           label="share of tokens with ratio outside [0.2, 5]")
    a2.set_xticks(list(x), names)
    a2.legend()
    a2.set_title("share of samples vs share of out-of-range tokens")
    for ax in (a1, a2):
        ax.tick_params(axis="x", rotation=30)
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    path = Path(out) / "groups.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def passk_points(run: Run, k: int = 4) -> list[tuple[float, float]]:
    """(cumulative cost, pass@k) of every evaluation the run made, in order."""
    pts = [(float(e.get("cost/cumulative", math.nan)), float(e[f"pass@{k}"]))
           for e in run.evals if f"pass@{k}" in e]
    if f"pass@{k}" in run.eval:
        pts.append((float(run.eval.get("cost/cumulative", run.mean("cost/cumulative", last=1))),
                    float(run.eval[f"pass@{k}"])))
    return [p for p in pts if math.isfinite(p[0])]


def plot_passk_cost(runs: list[Run], out: Path, k: int = 4) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, run in enumerate(runs):
        pts = passk_points(run, k)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], FLEET_STYLE.get(run.fleet, "-"),
                    marker="o", color=plt.cm.tab10(i % 10), label=run.name)
    ax.set_title(f"{runs[0].name}: held-out pass@{k} vs cost, base and final" if len(runs) == 1
                 else f"held-out pass@{k} vs cost, {len(runs)} runs")
    ax.set_xlabel("cumulative sampling cost (USD, modelled)")
    ax.set_ylabel(f"held-out pass@{k}")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, f"no evaluation reported pass@{k}", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    path = Path(out) / "passk_cost.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _nz(x: float) -> float:
    return 0.0 if not math.isfinite(x) else x


def plot_timelines(runs: list[Run], out: Path, per_cell: int = 3) -> Path | None:
    """One row per sampled episode (the last ``per_cell`` of each arm), one cell per reply."""
    rows: list[tuple[str, dict]] = []
    for cell in sorted({r.cell for r in runs}):
        eps = [(r.seed, e) for r in runs if r.cell == cell for e in r.episodes if e.get("replies")]
        rows += [(f"{cell} {seed} step {e.get('step')}", e) for seed, e in eps[-per_cell:]]
    if not rows:
        return None
    plt = _plt()
    width = max(len(e["replies"]) for _, e in rows)
    fig, ax = plt.subplots(figsize=(4 + 1.4 * width, 1 + 0.35 * len(rows)))
    cmap = plt.cm.viridis
    longest = max(c["tokens"] for _, e in rows for c in e["replies"]) or 1
    for i, (_, e) in enumerate(rows):
        for j, c in enumerate(e["replies"]):
            empty = c["tokens"] <= 1
            ax.add_patch(plt.Rectangle((j, i), 0.95, 0.9, color="tab:red" if empty
                                       else cmap(c["tokens"] / longest)))
            ax.text(j + 0.47, i + 0.45, str(c["tokens"]), ha="center", va="center", fontsize=7,
                    color="white")
        ax.text(len(e["replies"]) + 0.1, i + 0.45, f"{e.get('status')} r={e.get('reward')}",
                va="center", fontsize=7)
    ax.set_xlim(0, width + 2)
    ax.set_ylim(len(rows), 0)
    ax.set_yticks([i + 0.45 for i in range(len(rows))], [name for name, _ in rows], fontsize=7)
    ax.set_xticks([j + 0.47 for j in range(width)], [f"turn {j + 1}" for j in range(width)])
    ax.set_title("sampled episodes: one cell per assistant reply\n(number: tokens; red: empty reply)", fontsize=9)
    fig.tight_layout()
    path = Path(out) / "timelines.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


SPLITS = (("precision", "precision: staleness-0 tokens (number formats)", "-"),
          ("lag", "lag: stale tokens (asynchrony)", "--"))


def split_estimator(run: Run) -> str:
    """The KL estimator shown for both splits: exact where the run recorded it, else k3."""
    exact = any(k.startswith(("precision/kl_exact", "lag/kl_exact")) for r in run.rows for k in r)
    return "kl_exact" if exact else "kl_k3"


def precision_lag_series(run: Run) -> dict[str, dict[str, tuple[list[int], list[float]]]]:
    """Per sampler group, ``{"precision": (steps, values), "lag": (steps, values)}`` as recorded
    (``<split>/<estimator>/<group>``); a run without per-group metrics gives its whole-batch
    ``<split>/<estimator>`` under ``"all groups"``. Steps where a split had no tokens are absent."""
    est = split_estimator(run)
    groups = run.groups()
    if not groups:
        return {"all groups": {split: run.series(f"{split}/{est}") for split, _, _ in SPLITS}}
    return {g: {split: run.series(f"{split}/{est}/{g}") for split, _, _ in SPLITS} for g in groups}


def precision_lag_means(run: Run) -> list[dict[str, object]]:
    """Per group: token-weighted means of each split's KL over the run (``<split>/tokens/<g>``
    weights; 1 per step where the count is missing) and the tokens each split covered."""
    est, out = split_estimator(run), []
    for g, series in precision_lag_series(run).items():
        row: dict[str, object] = {"group": g}
        for split, _, _ in SPLITS:
            suffix = "" if g == "all groups" else f"/{g}"
            tokens = {int(r["step"]): float(r[f"{split}/tokens{suffix}"]) for r in run.rows
                      if isinstance(r.get(f"{split}/tokens{suffix}"), int | float) and "step" in r}
            xs, ys = series[split]
            w = [tokens.get(x, 1.0) for x in xs]
            row[f"{split} {est}"] = sum(wi * y for wi, y in zip(w, ys, strict=True)) / sum(w) if sum(w) else math.nan
            row[f"{split} tokens"] = int(sum(tokens.values())) if tokens else "-"
        out.append(row)
    return out


def precision_lag_figure(run: Run):  # -> matplotlib Figure
    """One panel per sampler group: precision KL and lag KL over the updates, as recorded."""
    plt = _plt()
    series, est = precision_lag_series(run), split_estimator(run)
    n = len(series)
    cols = min(n, 4)
    fig, axes = plt.subplots((n + cols - 1) // cols, cols, figsize=(4.6 * cols, 3.6 * ((n + cols - 1) // cols)),
                             squeeze=False, sharey=True)
    values = [y for s in series.values() for _, ys in s.values() for y in ys]
    log = bool(values) and min(values) > 0
    for ax, (g, s) in zip(axes.flat, series.items(), strict=False):
        for (split, label, style), color in zip(SPLITS, ("tab:blue", "tab:red"), strict=True):
            xs, ys = s[split]
            if xs:
                ax.plot(xs, ys, style, marker="o", ms=3, lw=1.3, color=color, label=label)
        if not any(s[split][0] for split, _, _ in SPLITS):
            ax.text(0.5, 0.5, "no tokens recorded", ha="center", transform=ax.transAxes)
        ax.set_title(g)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if log:
            ax.set_yscale("log")
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    axes.flat[0].set_ylabel(est.replace("_", " "))
    handles = [h for ax in axes.flat for h in ax.get_legend_handles_labels()[0]][:2]
    fig.legend(handles, [h.get_label() for h in handles], loc="lower center", ncol=2, fontsize=9)
    fig.suptitle(f"{run.name}: sampler-trainer KL per group, precision vs lag ({est}; "
                 "precision/ and lag/ metrics per update)")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


def plot_precision_lag(run: Run, out: Path) -> Path | None:
    """``precision_lag.png`` of one run; None when it recorded neither split."""
    series = precision_lag_series(run)
    if not any(xs for s in series.values() for xs, _ in s.values()):
        return None
    plt = _plt()
    fig = precision_lag_figure(run)
    path = Path(out) / "precision_lag.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
