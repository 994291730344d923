"""The 2 x 2 study in ``mixrl report``: cells, effects with paired intervals, curves, regime.

Read from the per-run data files (``OUT/data``, ``lab/study/studydata.py``), so the
committed files alone regenerate it (``mixrl compare --recompute OUT``):

- a per-cell table: pass@k over seeds (t-interval), final training reward, the
  FP32-sampler reward, precision and lag KL, precision out-of-range share,
  staleness and the collapses the collapse monitor detects (replayed with the
  study's ``[study.monitor]`` settings);
- per fleet, the precision, lag, correction and interaction effects of
  ``lab/study/design.py``, each with both paired intervals (the method named);
- per fleet, the per-update curves with seed bands (``lab/study/studyplots.py``);
- how far the toy's regime is from a real model's: the precision KL and the
  share of tokens outside [0.2, 5] that ``mixrl probe`` measured on a real
  pretrained model (``docs/artifacts/probe_real.json``) beside the bundled
  policy's probe (``docs/artifacts/probe.json``) and the staleness-0 values the
  study's sync runs measured in training, per sampler group.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from mixrl.lab.study import design, outcome, paired
from mixrl.lab.study.runs import Run
from mixrl.lab.study.stats import passk_matrix
from mixrl.lab.study.studyplots import collapse_steps, pick_key, plot_study
from mixrl.records import keys as K

ARTIFACTS = Path(__file__).resolve().parents[4] / "docs" / "artifacts"
PROBES = {"real": ARTIFACTS / "probe_real.json", "toy": ARTIFACTS / "probe.json"}


def is_study(runs: list[Run]) -> bool:
    """A study with both scheduling modes' fleet names (``<fleet>-sync`` / ``<fleet>-async``)."""
    return any(r.fleet.endswith("-sync") for r in runs)


def _mean(xs: list[float]) -> float:
    v = [x for x in xs if math.isfinite(x)]
    return sum(v) / len(v) if v else math.nan


def weighted(run: Run, key: str, tokens: str) -> float:
    """Mean of ``key`` over the run's steps weighted by ``tokens`` (1 where no count was written)."""
    num = den = 0.0
    for row in run.rows:
        v = row.get(key)
        if isinstance(v, int | float) and math.isfinite(v):
            w = row.get(tokens, 1.0)
            w = float(w) if isinstance(w, int | float) and math.isfinite(w) else 1.0
            num, den = num + w * v, den + w
    return num / den if den else math.nan


def cell_rows(runs: list[Run], k: int, monitor: dict[str, Any],
              study: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One row per cell (module docstring); every mean is over the cell's seeds. A run counts
    as collapsed by the study's outcome (lab/study/outcome.py: monitor, FP32-sampler or
    held-out drop); the monitor's first flagged step is shown where it flagged."""
    cells: dict[str, list[Run]] = {}
    for r in runs:
        cells.setdefault(r.cell, []).append(r)
    collapsed = collapse_steps(runs, monitor)
    why = outcome.collapsed(runs, {**(study or {}), "monitor": monitor})
    rows = []
    for cell, rs in sorted(cells.items()):
        rs = sorted(rs, key=lambda r: r.seed)
        tasks = sorted(set.intersection(*(set(r.eval.get("per_task") or {}) for r in rs)))
        per_seed = list(np.nanmean(passk_matrix([r.eval["per_task"] for r in rs], tasks, k), axis=1)) \
            if tasks else []
        iv = paired.paired_t(per_seed)
        pkl, lkl = pick_key(rs, K.PRECISION_KL), pick_key(rs, K.LAG_KL)
        ptok, ltok = K.split(K.PRECISION, K.TOKENS), K.split(K.LAG, K.TOKENS)
        flags = [f"{r.seed}@{collapsed[r.name]}" if r.name in collapsed else f"{r.seed} ({', '.join(why[r.name])})"
                 for r in rs if r.name in why]
        rows.append({
            "cell": cell, "seeds": len(rs),
            f"pass@{k}": iv.to_dict() if iv else (float(per_seed[0]) if per_seed else math.nan),
            "reward_final": _mean([design.reward_final(r) for r in rs]),
            "reward_fp32": _mean([design.reward_fp32(r) for r in rs]),
            "precision_kl": _mean([weighted(r, pkl, ptok) for r in rs]) if pkl else math.nan,
            "lag_kl": _mean([weighted(r, lkl, ltok) for r in rs]) if lkl else math.nan,
            "precision_oob": _mean([weighted(r, K.PRECISION_OOB, ptok) for r in rs]),
            "staleness": _mean([r.mean(K.STALENESS) for r in rs]),
            "collapsed": f"{len(flags)}/{len(rs)}" + (f" ({', '.join(flags)})" if flags else ""),
        })
    return rows


def _probe(path: Path) -> dict[str, dict[str, Any]]:
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return {p: {**v, "command": d.get("command", "")} for p, v in d.get("result", {}).get("profiles", {}).items()}


def trained_groups(runs: list[Run]) -> dict[str, dict[str, float]]:
    """Per sampler group of the sync runs: token-weighted precision KL and oob share, mean over runs."""
    acc: dict[str, dict[str, list[float]]] = {}
    for r in runs:
        if not r.fleet.endswith("-sync"):
            continue
        for g in r.groups():
            est = next((e for e in K.PRECISION_KL if r.series(f"{e}/{g}")[0]), None)
            if est is None:
                continue
            tok = f"{K.split(K.PRECISION, K.TOKENS)}/{g}"
            e = acc.setdefault(f"{r.fleet[: -len('-sync')]}: {g}", {"kl": [], "oob": []})
            e["kl"].append(weighted(r, f"{est}/{g}", tok))
            e["oob"].append(weighted(r, f"{K.PRECISION_OOB}/{g}", tok))
    return {g: {"kl": _mean(v["kl"]), "oob": _mean(v["oob"])} for g, v in sorted(acc.items())}


def regime(runs: list[Run], probes: dict[str, Path] | None = None) -> dict[str, Any]:
    """The real model's probe, the bundled policy's probe and the study's training values."""
    p = probes or PROBES
    real, toy = _probe(p["real"]), _probe(p["toy"])
    rows = []
    for prof, v in real.items():
        t = toy.get(prof, {})
        rk, tk = v.get("mismatch/kl_exact", math.nan), t.get("mismatch/kl_exact", math.nan)
        rows.append({"profile": prof, "real_kl": rk, "real_oob": v.get("mismatch/ratio_oob", math.nan),
                     "toy_kl": tk, "toy_oob": t.get("mismatch/ratio_oob", math.nan),
                     "kl_ratio": rk / tk if tk and math.isfinite(tk) and tk > 0 else math.nan})
    return {"probe": rows, "real_command": next(iter(real.values()), {}).get("command", ""),
            "toy_command": next(iter(toy.values()), {}).get("command", ""), "trained": trained_groups(runs)}


def distance(reg: dict[str, Any]) -> str:
    """One sentence: the study's largest training mismatch against the real model's largest probe."""
    real = max(reg["probe"], key=lambda r: r["real_kl"] if math.isfinite(r["real_kl"]) else -1.0, default=None)
    kl = {g: v["kl"] for g, v in reg["trained"].items() if math.isfinite(v["kl"])}
    oob = {g: v["oob"] for g, v in reg["trained"].items() if math.isfinite(v["oob"])}
    if real is None or not kl:
        return ""
    g = max(kl, key=kl.__getitem__)
    go = max(oob, key=oob.__getitem__) if oob else g
    return (f"Distance: the largest precision KL the study's samplers reach in training ({g}: {_f(kl[g])}) is "
            f"{_f(real['real_kl'] / kl[g] if kl[g] > 0 else math.inf)}x below the real model's {real['profile']} "
            f"probe ({_f(real['real_kl'])}); the largest out-of-range share ({go}: {_f(oob.get(go, math.nan))}) "
            f"against {_f(real['real_oob'])} there.")


def build(runs: list[Run], out: Path, study: dict[str, Any], probes: dict[str, Path] | None = None) -> dict[str, Any]:
    res = design.judge(runs, study)
    figs = plot_study(runs, Path(out) / "figures", study.get("monitor", {}))
    return {"design": res, "cells": cell_rows(runs, res["k"], study.get("monitor", {}), study), "figures": figs,
            "regime": regime(runs, probes)}


def _f(v: Any) -> str:
    if isinstance(v, dict):
        return f"{v['estimate']:.3f} [{v['lo']:.3f}, {v['hi']:.3f}]"
    if isinstance(v, float):
        return "–" if not math.isfinite(v) else (f"{v:.3g}" if v != 0 and abs(v) < 1e-2 else f"{v:.3f}")
    return str(v)


CELL_HELP = ("pass@{k}: held-out, final policy, mean over seeds [95% t-interval over seeds]; reward_final: "
             "training reward, last 10% of updates, each arm's own sampler; reward_fp32: the last scored "
             "checkpoint under one common FP32 sampler; precision_kl / precision_oob: staleness-0 tokens "
             "(token-weighted), lag_kl: stale tokens; staleness: mean policy versions behind; collapsed: "
             "runs the study's collapse outcome counts (seed@first step the monitor flags, or the FP32-sampler "
             "or held-out drop that counted it)")


def markdown(rep: dict[str, Any]) -> str:
    res, k = rep["design"], rep["design"]["k"]
    cols = list(rep["cells"][0]) if rep["cells"] else []
    lines = ["## The 2 x 2 study: precision, lag and their interaction", "",
             "Every effect is a paired difference over seeds (same seed: same prompts; the same held-out "
             f"tasks and sampling seeds in every run), on pass@{k}, with two intervals: "
             f"95% {paired.T_METHOD} and 95% {paired.BOOT_METHOD} (lab/study/paired.py). An effect is "
             f"found only when both exclude 0. G = `grpo`, C = `{res.get('corrected', design.C)}` (the corrected loss); "
             "F1–F3 are judged by the pre-registered tests (lab/study/design.py):", "",
             "- precision effect (arm) = arm @ fleet-sync − on-policy (staleness 0: the samplers' numerics "
             "alone)",
             "- lag effect (arm) = arm @ fleet-async − arm @ fleet-sync (what asynchrony adds, same fleet)",
             "- correction effect (mode) = C − G @ fleet-mode",
             "- interaction = (C_async − C_sync) − (G_async − G_sync)", "", "### Cells", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_f(r[c]) for c in cols) + " |" for r in rep["cells"]]
    lines += ["", CELL_HELP.format(k=k) + ".", "",
              design.markdown(res).split("\n", 1)[1].replace("\n## ", "\n### Effects: ")]
    reg = rep["regime"]
    if reg["probe"]:
        lines += ["### How far the toy's regime is from a real model's", "",
                  f"`{reg['real_command']}` (a real pretrained model) against `{reg['toy_command']}` "
                  "(the bundled policy): exact KL and share of tokens whose ratio is outside [0.2, 5].", "",
                  "| profile | real KL | real oob | bundled KL | bundled oob | KL real / bundled |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['profile']} | {_f(r['real_kl'])} | {_f(r['real_oob'])} | {_f(r['toy_kl'])} | "
                  f"{_f(r['toy_oob'])} | {_f(r['kl_ratio'])} |" for r in reg["probe"]]
        lines.append("")
    if reg["trained"]:
        lines += ["Measured in the study's sync runs (staleness-0 tokens, token-weighted, mean over runs; "
                  "the study's groups compute in FP32 and its FP4/FP8 groups also quantize `lm_head`):", "",
                  "| fleet: sampler group | precision KL | share outside [0.2, 5] |", "|---|---|---|"]
        lines += [f"| {g} | {_f(v['kl'])} | {_f(v['oob'])} |" for g, v in reg["trained"].items()]
        lines += ["", distance(reg), ""]
    for p in rep["figures"]:
        lines += [f"![{p.stem}](figures/{p.name})", "", f"*{p.stem}: per-update curves of the "
                  f"{p.stem.split('_', 1)[1]} fleet's cells, seed bands, collapses marked*", ""]
    return "\n".join(lines)
