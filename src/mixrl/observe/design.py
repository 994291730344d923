"""The 2 x 2 study per fleet: precision, lag and their interaction, with paired intervals.

Cells (``mixrl compare --modes sync,async``): ``<fleet>-sync/<arm>`` (staleness
0: the samplers' numerics alone), ``<fleet>-async/<arm>`` (numerics + policy
lag), ``reference/on-policy`` (FP32 sampler = trainer, sync: no mismatch). Arms
G = ``grpo``, C = ``sc+mis+top-p``. Every effect is a paired difference (same
seed: same prompts; same held-out tasks and sampling seeds), pass@k per seed
and task, with both intervals of ``observe/paired.py``:

    precision effect (arm)   = arm @ fleet-sync  − on-policy
    lag effect (arm)         = arm @ fleet-async − arm @ fleet-sync
    correction effect (mode) = C @ fleet-mode    − G @ fleet-mode
    interaction              = (C_async − C_sync) − (G_async − G_sync)

Verdicts (an effect is "found" only when both intervals exclude 0):

- F1 (precision-only): G @ fleet-sync − on-policy below 0 and a collapse
  (the collapse monitor replayed on the per-step metrics with the study's
  ``[study.monitor]`` settings) in at least half the seeds: ``reproduced``;
  below 0 without collapses: ``not reproduced`` (a deficit, no collapse);
  an interval containing 0: ``not distinguishable``.
- F2 (precision-only): C @ fleet-sync − G @ fleet-sync above 0 and no C collapse.
- F3: C @ mixed-sync − C @ homogeneous-sync against the equivalence margin
  ``[study] f3_margin`` stated before the runs (TOST: equivalent / different /
  not distinguishable).
- F4: per sync run, Spearman(precision oob share, precision KL) − Spearman(precision
  oob share, sample share) over the fleet's groups; the oob counts are staleness-0
  tokens only (``precision/ratio_oob`` x ``precision/tokens``). ``untestable``
  when the KL and sample-share rankings coincide in every run, or no
  staleness-0 token left [0.2, 5].

Scalars beside pass@k (paired t over seeds): final training reward (mean of
the last 10% of updates, each arm's own sampler) and the FP32-sampler reward
of the last scored checkpoint (one common sampler for every arm).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from mixrl.observe import keys as K
from mixrl.observe import paired, studydata
from mixrl.observe.monitor import monitor_config, replay
from mixrl.observe.runs import Run
from mixrl.observe.stats import passk_matrix

G, C, REF = "grpo", "sc+mis+top-p", "reference/on-policy"


def _by_seed(runs: list[Run]) -> dict[str, dict[str, Run]]:
    out: dict[str, dict[str, Run]] = {}
    for r in runs:
        out.setdefault(r.cell, {})[r.seed] = r
    return out


def _matrix(cell: dict[str, Run], seeds: list[str], tasks: list[str], k: int) -> np.ndarray:
    return passk_matrix([cell[s].eval["per_task"] for s in seeds], tasks, k)


def effect(cells: dict[str, dict[str, Run]], plus: list[str], minus: list[str], k: int,
           level: float = 0.95) -> dict[str, Any] | None:
    """Σ plus − Σ minus of the cells' pass@k, paired over their common seeds and tasks."""
    names = plus + minus
    if any(n not in cells for n in names):
        return None
    seeds = sorted(set.intersection(*(set(cells[n]) for n in names)))
    if len(seeds) < 2:
        return None
    tasks = sorted(set.intersection(*(set(cells[n][s].eval.get("per_task") or {}) for n in names for s in seeds)))
    if len(tasks) < 2:
        return None
    d = sum(_matrix(cells[n], seeds, tasks, k) for n in plus) - sum(_matrix(cells[n], seeds, tasks, k)
                                                                      for n in minus)
    t, boot = paired.both(d, np.zeros_like(d), level)
    out: dict[str, Any] = {"t": t.to_dict() if t else None, "boot": boot.to_dict() if boot else None,
                           "seeds": seeds, "tasks": len(tasks)}
    for name, f in (("reward_final", reward_final), ("reward_fp32", reward_fp32)):
        v = [sum(f(cells[n][s]) for n in plus) - sum(f(cells[n][s]) for n in minus) for s in seeds]
        iv = paired.paired_t(v, level)
        out[name] = iv.to_dict() if iv else None
    return out


def reward_final(r: Run) -> float:
    return r.mean(K.REWARD, last=max(1, len(r.rows) // 10))


def reward_fp32(r: Run) -> float:
    scores = {int(s): v for s, v in (r.config.get("fp32") or {}).items() if "mean_reward" in v and int(s) > 0}
    return float(scores[max(scores)]["mean_reward"]) if scores else math.nan


def _found(e: dict[str, Any] | None) -> str:
    """"lower" / "higher" when both intervals exclude 0 on the same side, else not distinguishable."""
    if not e or not e["t"] or not e["boot"]:
        return "inconclusive"
    ivs = (e["t"], e["boot"])
    if all(iv["hi"] < 0 for iv in ivs):
        return "lower"
    if all(iv["lo"] > 0 for iv in ivs):
        return "higher"
    return "not distinguishable"


def collapses(cell: dict[str, Run], mon: dict[str, Any]) -> int:
    cfg = monitor_config(mon)
    return sum(replay(r.rows, cfg)[0].collapsed for r in cell.values())


def _group_shares(r: Run) -> dict[str, dict[str, float]]:
    """Per group: staleness-0 oob tokens (count), precision KL (token-weighted), sample share."""
    out = {}
    exact, k3 = K.split(K.PRECISION, K.KL_EXACT), K.split(K.PRECISION, K.KL_K3)
    kl = exact if any(k.startswith(exact + "/") for row in r.rows for k in row) else k3
    tokens, oob_key = K.split(K.PRECISION, K.TOKENS), K.PRECISION_OOB
    for g in r.groups():
        oob = toks = klsum = 0.0
        for row in r.rows:
            # token-weighted; metrics written without per-group token counts weigh steps equally
            n = row.get(f"{tokens}/{g}", 1.0 if f"{oob_key}/{g}" in row else 0.0) or 0.0
            if n:
                toks += n
                oob += (row.get(f"{oob_key}/{g}") or 0.0) * n
                klsum += (row.get(f"{kl}/{g}") or 0.0) * n
        out[g] = {"oob": oob, "kl": klsum / toks if toks else math.nan,
                  "share": r.mean(f"{K.SAMPLE_SHARE}/{g}")}
    return out


def f4(cell_runs: list[Run]) -> dict[str, Any]:
    diffs, coincide, with_oob = [], 0, 0
    for r in cell_runs:
        st = _group_shares(r)
        gs = sorted(g for g in st if math.isfinite(st[g]["kl"]))
        total = sum(st[g]["oob"] for g in gs)
        if len(gs) < 3 or total <= 0:
            continue
        with_oob += 1
        oob = [st[g]["oob"] / total for g in gs]
        kl, share = [st[g]["kl"] for g in gs], [st[g]["share"] for g in gs]
        if paired.same_ranking(kl, share):
            coincide += 1
            continue
        diffs.append(paired.rank_corr(oob, kl) - paired.rank_corr(oob, share))
    iv = paired.paired_t([d for d in diffs if math.isfinite(d)])
    if not with_oob:
        verdict = "untestable (no staleness-0 token outside [0.2, 5])"
    elif not diffs:
        verdict = "untestable (precision KL and sample share rank the groups identically)"
    elif iv is None:
        verdict = f"inconclusive ({len(diffs)} testable run: an interval needs 2)"
    else:
        verdict = "not distinguishable" if iv.contains_zero else ("reproduced" if iv.lo > 0 else "not reproduced")
    return {"verdict": verdict, "runs_with_oob": with_oob, "rankings_coincide": coincide,
            "interval": iv.to_dict() if iv else None}


def judge(runs: list[Run], study: dict[str, Any]) -> dict[str, Any]:
    cells, k = _by_seed(runs), int(next((r.eval.get("k") for r in runs if r.eval.get("k")), 4))
    mon, margin = study.get("monitor", {}), float(study.get("f3_margin", 0.05))
    fleets = sorted({r.fleet[: -len("-sync")] for r in runs if r.fleet.endswith("-sync")})
    out: dict[str, Any] = {"k": k, "monitor": mon, "f3_margin": margin, "fleets": {}}
    for f in fleets:
        s, a = f"{f}-sync/", f"{f}-async/"
        specs = {"precision G": ([s + G], [REF]), "precision C": ([s + C], [REF]),
                 "lag G": ([a + G], [s + G]), "lag C": ([a + C], [s + C]),
                 "correction sync": ([s + C], [s + G]), "correction async": ([a + C], [a + G]),
                 "interaction": ([a + C, s + G], [s + C, a + G])}
        # an effect whose cells the study did not run is left out (the real model's study is sync only)
        eff = {name: effect(cells, pl, mi, k) for name, (pl, mi) in specs.items() if all(c in cells for c in pl + mi)}
        for e in eff.values():
            if e is not None:
                e["verdict"] = _found(e)
        col = {c: f"{collapses(cells[c], mon)}/{len(cells[c])}" for c in cells if c.startswith((s, a))}
        g_col = collapses(cells[s + G], mon) if s + G in cells else 0
        d1 = _found(eff.get("precision G"))
        f1 = {"lower": "reproduced" if 2 * g_col >= len(cells.get(s + G, {})) > 0 else "not reproduced",
              "higher": "not reproduced"}.get(d1, d1)
        d2 = _found(eff.get("correction sync"))
        c_col = collapses(cells[s + C], mon) if s + C in cells else 0
        f2 = "not reproduced" if c_col else {"higher": "reproduced", "lower": "not reproduced"}.get(d2, d2)
        out["fleets"][f] = {"effects": eff, "collapsed": col, "F1": f1, "F2": f2,
                            "F4": f4(list(cells.get(s + G, {}).values()) + list(cells.get(s + C, {}).values()))}
    f3 = effect(cells, [f"mixed-sync/{C}"], [f"homogeneous-sync/{C}"], k)
    f3n = effect(cells, [f"mixed-sync/{C}"], [f"homogeneous-sync/{C}"], k, level=0.90)
    ran = all(c in cells for c in (f"mixed-sync/{C}", f"homogeneous-sync/{C}"))
    verdicts = ([paired.tost(_iv(f3n, m), _iv(f3, m), margin) for m in ("t", "boot")] if f3
                else ["inconclusive" if ran else "not run"])
    out["F3"] = {"effect": f3, "effect_90": f3n, "margin": margin,
                 "verdict": verdicts[0] if len(set(verdicts)) == 1 else "not distinguishable"}
    return out


def _iv(e: dict[str, Any] | None, m: str) -> paired.PairedInterval | None:
    d = (e or {}).get(m)
    return None if not d else paired.PairedInterval(d["estimate"], d["lo"], d["hi"], d["level"], d["method"],
                                                    d["seeds"], d["tasks"])


def _fmt(d: dict[str, Any] | None) -> str:
    return "–" if not d else f"{d['estimate']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]"


def markdown(res: dict[str, Any]) -> str:
    k = res["k"]
    lines = [f"# The 2 x 2 study: precision, lag, interaction (pass@{k}, paired)", "",
             f"Intervals: 95% {paired.T_METHOD} | 95% {paired.BOOT_METHOD}. F3 margin ±{res['f3_margin']}.", ""]
    for f, v in res["fleets"].items():
        lines += [f"## {f}", "", f"| effect | pass@{k}: t | pass@{k}: bootstrap | final training reward (t) "
                  "| FP32-sampler reward (t) | verdict |", "|---|---|---|---|---|---|"]
        for name, e in v["effects"].items():
            e = e or {}
            lines.append(f"| {name} | {_fmt(e.get('t'))} | {_fmt(e.get('boot'))} | {_fmt(e.get('reward_final'))} "
                         f"| {_fmt(e.get('reward_fp32'))} | {_found(e or None)} |")
        col = ", ".join(f"{c} {n}" for c, n in sorted(v["collapsed"].items()))
        lines += ["", f"Collapsed (the collapse monitor replayed on each run's metrics): {col}", "",
                  f"- F1 uncorrected GRPO collapses (precision only): **{v['F1']}**",
                  f"- F2 SC + MIS better than GRPO (precision only): **{v['F2']}**",
                  f"- F4 oob share follows KL: **{v['F4']['verdict']}** ({_fmt(v['F4']['interval'])})", ""]
    f3 = res["F3"]
    lines += [f"F3 mixed vs homogeneous (sc+mis+top-p, sync): **{f3['verdict']}** "
              f"({_fmt((f3['effect'] or {}).get('t'))}, margin ±{f3['margin']})", ""]
    return "\n".join(lines)


def main(out: Path, study: dict[str, Any]) -> int:
    """``mixrl compare --recompute OUT``: judge from ``OUT/data``; writes study.json and study.md."""
    runs = studydata.load(Path(out))
    if not runs:
        print(f"mixrl compare: no data files under {Path(out) / 'data'}", flush=True)
        return 2
    res = judge(runs, study)
    (Path(out) / "study.json").with_name("design.json").write_text(json.dumps(res, indent=1, default=float))
    text = markdown(res)
    (Path(out) / "design.md").write_text(text)
    print(text)
    return 0
