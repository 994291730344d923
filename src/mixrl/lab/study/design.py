"""The 2 x 2 study per fleet: precision, lag and their interaction, judged by pre-registered tests.

Cells (``mixrl compare --modes sync,async``): ``<fleet>-sync/<arm>`` (staleness
0: the samplers' numerics alone), ``<fleet>-async/<arm>`` (numerics + policy
lag), ``reference/on-policy`` (FP32 sampler = trainer, sync: no mismatch). Arms
G = ``grpo`` and C = the corrected arm (``[study] corrected``). Every effect is a
paired difference (same seed: same prompts; same held-out tasks and sampling
seeds), with both intervals of ``lab/study/paired.py``:

    precision effect (arm)   = arm @ fleet-sync  − on-policy
    lag effect (arm)         = arm @ fleet-async − arm @ fleet-sync
    correction effect (mode) = C @ fleet-mode    − G @ fleet-mode
    interaction              = (C_async − C_sync) − (G_async − G_sync)

Pre-registered (docs/study.md, "Pre-registration"): the primary outcome is held-out
**pass@1** (pass@k is secondary: near its ceiling it compresses every effect). One
contrast per finding, tested by the paired t over seeds (``lab/study/prereg.py``), and
Holm's correction over the family {F1 per fleet, F2 per fleet, F3} at ``[study] alpha``:

- F1 (uncorrected GRPO is hurt by precision alone): ``precision G`` < 0 (Holm p < α);
  ``reproduced`` when, besides, at least half of the G @ fleet-sync seeds collapsed
  (``lab/study/outcome.py``), ``not reproduced`` (a deficit, no collapse) otherwise;
- F2 (the correction helps, precision alone): ``correction sync`` > 0 (Holm p < α)
  and no C @ fleet-sync collapse;
- F3 (the mixed fleet is not worse than the homogeneous one, C, sync): one-sided
  non-inferiority of ``C @ mixed-sync − C @ homogeneous-sync`` at margin
  ``[study] f3_margin`` (Holm p < α: ``non-inferior``);
- F4 (the out-of-bounds rate follows the precision KL): the Cochran–Armitage trend
  test on staleness-0 token counts, the fleet's groups ordered by their precision KL,
  pooled over the sync runs of G and C (one-sided, α; not in the Holm family), read only
  when a one-sided sign test over the runs' own trend statistics agrees (tokens of one
  run are not independent);
- collapses: per cell the collapsed runs, and Fisher's exact test of G @ fleet-sync
  against on-policy, C against G in each mode, and async against sync per arm.

The other effects are reported with their intervals as exploratory (uncorrected).
Scalars beside pass@1 (paired t over seeds): final training reward (mean of the last
10% of updates, each arm's own sampler) and the FP32-sampler reward of the last scored
checkpoint (one common sampler for every arm).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

from mixrl.lab.study import outcome, paired, prereg, studydata
from mixrl.lab.study.runs import Run
from mixrl.lab.study.stats import passk_matrix
from mixrl.records import keys as K

G, REF = "grpo", "reference/on-policy"
C = "sc+mis+top-p"  # the corrected arm when the [study] table names none (the committed study's)
PRIMARY_K = 1  # pre-registered primary outcome: held-out pass@1


def by_seed(runs: list[Run]) -> dict[str, dict[str, Run]]:
    out: dict[str, dict[str, Run]] = {}
    for r in runs:
        out.setdefault(r.cell, {})[r.seed] = r
    return out


def _matrix(cell: dict[str, Run], seeds: list[str], tasks: list[str], k: int) -> np.ndarray:
    return passk_matrix([cell[s].eval["per_task"] for s in seeds], tasks, k)


def effect(cells: dict[str, dict[str, Run]], plus: list[str], minus: list[str], k: int = PRIMARY_K,
           level: float = 0.95, secondary_k: int | None = None) -> dict[str, Any] | None:
    """Σ plus − Σ minus of the cells' pass@k, paired over their common seeds and tasks: both
    intervals, the per-seed differences ``d_seed`` (mean over tasks) and their paired-t ``p``;
    with ``secondary_k`` the same intervals on pass@secondary_k under ``secondary``."""
    names = plus + minus
    if any(n not in cells for n in names):
        return None
    seeds = sorted(set.intersection(*(set(cells[n]) for n in names)))
    if len(seeds) < 2:
        return None
    tasks = sorted(set.intersection(*(set(cells[n][s].eval.get("per_task") or {}) for n in names for s in seeds)))
    if len(tasks) < 2:
        return None

    def diff(kk: int) -> np.ndarray:
        return (sum(_matrix(cells[n], seeds, tasks, kk) for n in plus)
                - sum(_matrix(cells[n], seeds, tasks, kk) for n in minus))

    d = diff(k)
    t, boot = paired.both(d, np.zeros_like(d), level)
    per_seed = [float(x) for x in np.nanmean(d, axis=1)]
    out: dict[str, Any] = {"k": k, "t": t.to_dict() if t else None, "boot": boot.to_dict() if boot else None,
                           "seeds": seeds, "tasks": len(tasks), "d_seed": per_seed, "p": prereg.paired_p(per_seed)}
    if secondary_k is not None and secondary_k != k:
        d2 = diff(secondary_k)
        t2, b2 = paired.both(d2, np.zeros_like(d2), level)
        out["secondary"] = {"k": secondary_k, "t": t2.to_dict() if t2 else None, "boot": b2.to_dict() if b2 else None}
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


def found(e: dict[str, Any] | None) -> str:
    """"lower" / "higher" when both intervals exclude 0 on the same side, else not distinguishable."""
    if not e or not e["t"] or not e["boot"]:
        return "inconclusive"
    ivs = (e["t"], e["boot"])
    if all(iv["hi"] < 0 for iv in ivs):
        return "lower"
    if all(iv["lo"] > 0 for iv in ivs):
        return "higher"
    return "not distinguishable"


def _group_counts(r: Run) -> dict[str, dict[str, float]]:
    """Per group: staleness-0 tokens, those outside the bounds (counts), token-weighted precision KL."""
    out = {}
    exact, k3 = K.split(K.PRECISION, K.KL_EXACT), K.split(K.PRECISION, K.KL_K3)
    kl = exact if any(k.startswith(exact + "/") for row in r.rows for k in row) else k3
    tokens, oob_key = K.split(K.PRECISION, K.TOKENS), K.PRECISION_OOB
    for g in r.groups():
        oob = toks = klsum = 0.0
        for row in r.rows:
            n = row.get(f"{tokens}/{g}") or 0.0
            if n and row.get(f"{oob_key}/{g}") is not None:
                toks += n
                oob += float(row[f"{oob_key}/{g}"]) * n
                klsum += float(row.get(f"{kl}/{g}") or 0.0) * n
        out[g] = {"tokens": toks, "oob": oob, "kl": klsum / toks if toks else math.nan}
    return out


def f4(cell_runs: list[Run], alpha: float = 0.05) -> dict[str, Any]:
    """Cochran–Armitage trend of the oob rate over the groups ordered by precision KL, counts
    pooled over ``cell_runs`` (staleness-0 tokens only)."""
    per_run = [_group_counts(r) for r in cell_runs]
    pooled: dict[str, dict[str, float]] = {}
    for counts in per_run:
        for g, v in counts.items():
            acc = pooled.setdefault(g, {"tokens": 0.0, "oob": 0.0, "klw": 0.0})
            acc["tokens"] += v["tokens"]
            acc["oob"] += v["oob"]
            acc["klw"] += (v["kl"] * v["tokens"]) if math.isfinite(v["kl"]) else 0.0
    gs = sorted(g for g in pooled if pooled[g]["tokens"] > 0)
    groups = {g: {"tokens": pooled[g]["tokens"], "oob": round(pooled[g]["oob"]),
                  "kl": pooled[g]["klw"] / pooled[g]["tokens"]} for g in gs}
    res: dict[str, Any] = {"test": "Cochran-Armitage trend, one-sided", "groups": groups, "z": None, "p": None}
    if len(gs) < 2:
        return {**res, "verdict": "untestable (fewer than 2 groups with staleness-0 tokens)"}
    if sum(v["oob"] for v in groups.values()) == 0:
        return {**res, "verdict": "untestable (no staleness-0 token outside [0.2, 5])"}
    order = sorted(gs, key=lambda g: groups[g]["kl"])
    z, p = prereg.trend([groups[g]["oob"] for g in order], [groups[g]["tokens"] for g in order],
                        list(range(len(order))))
    if not math.isfinite(p):
        return {**res, "verdict": "untestable (equal KL or every token out of bounds)"}
    # tokens of one run are not independent: the pooled z is read only where the runs agree
    # (a one-sided sign test over the runs' own trend statistics, same order of groups)
    signs = []
    for v in per_run:
        if all(g in v and v[g]["tokens"] > 0 for g in order):
            zr, _ = prereg.trend([v[g]["oob"] for g in order], [v[g]["tokens"] for g in order],
                                 list(range(len(order))))
            if math.isfinite(zr) and zr != 0:
                signs.append(zr > 0)
    p_sign = prereg.sign_p(sum(signs), len(signs))
    if p < alpha and p_sign < alpha:
        verdict = "reproduced"
    elif z < 0 and sum(signs) < len(signs) / 2:
        verdict = "not reproduced"
    else:
        verdict = "not distinguishable"
    return {**res, "z": z, "p": p, "order": order, "runs_increasing": [sum(signs), len(signs)],
            "p_sign": p_sign, "verdict": verdict}


def _fisher(cells: dict[str, dict[str, Run]], col: dict[str, list[str]], a: str, b: str) -> dict[str, Any] | None:
    if a not in cells or b not in cells:
        return None
    ya, yb = (sum(r.name in col for r in cells[c].values()) for c in (a, b))
    na, nb = len(cells[a]), len(cells[b])
    return {"a": a, "b": b, "collapsed": [ya, yb], "runs": [na, nb], "p": prereg.fisher(ya, na - ya, yb, nb - yb)}


def corrected_arm(runs: list[Run], study: dict[str, Any]) -> str:
    """``[study] corrected`` when the data holds it; else the one non-G arm of the sync cells
    (a study committed with another corrected arm is judged with its own)."""
    want = str(study.get("corrected", C))
    arms = {r.arm for r in runs if r.fleet.endswith("-sync")} - {G}
    return arms.pop() if want not in arms and len(arms) == 1 else want


def judge(runs: list[Run], study: dict[str, Any]) -> dict[str, Any]:
    cells = by_seed(runs)
    k2 = int(next((r.eval.get("k") for r in runs if r.eval.get("k")), 4))
    c_arm = corrected_arm(runs, study)
    mon, margin, alpha = study.get("monitor", {}), float(study.get("f3_margin", 0.05)), float(study.get("alpha", 0.05))
    col = outcome.collapsed(runs, study)
    fleets = sorted({r.fleet[: -len("-sync")] for r in runs if r.fleet.endswith("-sync")})
    base_held, _ = outcome.base_policy(runs)  # the starting policy's held-out counts
    gain = None
    if REF in cells and base_held:
        gain = float(np.mean([outcome.pass1(r.eval.get("per_task"), sorted(base_held)) for r in cells[REF].values()])
                     - outcome.pass1(base_held))
    out: dict[str, Any] = {"k": PRIMARY_K, "k_secondary": k2, "corrected": c_arm, "monitor": mon, "alpha": alpha,
                           "f3_margin": margin, "gain_on_policy": gain, "fleets": {},
                           "collapsed_runs": {n: why for n, why in sorted(col.items())}}
    family: dict[str, float] = {}
    for f in fleets:
        s, a = f"{f}-sync/", f"{f}-async/"
        specs = {"precision G": ([s + G], [REF]), "precision C": ([s + c_arm], [REF]),
                 "lag G": ([a + G], [s + G]), "lag C": ([a + c_arm], [s + c_arm]),
                 "correction sync": ([s + c_arm], [s + G]), "correction async": ([a + c_arm], [a + G]),
                 "interaction": ([a + c_arm, s + G], [s + c_arm, a + G])}
        # an effect whose cells the study did not run is left out (the real model's study is sync only)
        eff = {name: effect(cells, pl, mi, secondary_k=k2) for name, (pl, mi) in specs.items()
               if all(c in cells for c in pl + mi)}
        for e in eff.values():
            if e is not None:
                e["verdict"] = found(e)
        counts = {c: f"{sum(r.name in col for r in cells[c].values())}/{len(cells[c])}"
                  for c in cells if c.startswith((s, a))}
        fisher = {name: t for name, (x, y) in {
            "G sync vs on-policy": (s + G, REF), "C vs G sync": (s + c_arm, s + G),
            "C vs G async": (a + c_arm, a + G), "G async vs sync": (a + G, s + G),
            "C async vs sync": (a + c_arm, s + c_arm)}.items() if (t := _fisher(cells, col, x, y))}
        for name, key in (("F1", "precision G"), ("F2", "correction sync")):
            e = eff.get(key)
            family[f"{f}: {name}"] = e["p"] if e else math.nan
        sync_runs = list(cells.get(s + G, {}).values()) + list(cells.get(s + c_arm, {}).values())
        out["fleets"][f] = {"effects": eff, "collapsed": counts, "fisher": fisher, "F4": f4(sync_runs, alpha)}
    mixed, homo = f"mixed-sync/{c_arm}", f"homogeneous-sync/{c_arm}"
    f3 = effect(cells, [mixed], [homo], secondary_k=k2)
    if f3 is not None:
        f3["p_noninferiority"] = prereg.noninferiority_p(f3["d_seed"], margin)
        family["F3"] = f3["p_noninferiority"]
    adj = prereg.holm(family)
    out["holm"] = {"family": sorted(family), "p": family, "p_holm": adj}
    for f, v in out["fleets"].items():
        s = f"{f}-sync/"
        e1, e2 = v["effects"].get("precision G"), v["effects"].get("correction sync")
        p1, p2 = adj.get(f"{f}: F1", math.nan), adj.get(f"{f}: F2", math.nan)
        g_col = sum(r.name in col for r in cells.get(s + G, {}).values())
        c_col = sum(r.name in col for r in cells.get(s + c_arm, {}).values())
        v["F1"] = _verdict(e1, p1, alpha, -1, "reproduced" if 2 * g_col >= len(cells.get(s + G, {})) > 0
                           else "not reproduced")
        v["F2"] = "not reproduced" if c_col and e2 else _verdict(e2, p2, alpha, +1, "reproduced")
        v["p_holm"] = {"F1": p1, "F2": p2}
    ran = mixed in cells and homo in cells
    if f3 is None:
        verdict = "inconclusive" if ran else "not run"
    else:
        verdict = "non-inferior" if adj["F3"] < alpha else "not shown non-inferior"
    out["F3"] = {"effect": f3, "margin": margin, "p_holm": adj.get("F3", math.nan), "verdict": verdict}
    return out


def _verdict(e: dict[str, Any] | None, p_adj: float, alpha: float, sign: int, yes: str) -> str:
    """``yes`` when the contrast has the predicted sign and its Holm-adjusted p is below α;
    ``not reproduced`` when it is significant the other way; else ``not distinguishable``."""
    if e is None or not math.isfinite(p_adj):
        return "inconclusive"
    if p_adj >= alpha:
        return "not distinguishable"
    return yes if sign * e["t"]["estimate"] > 0 else "not reproduced"


def fmt_iv(d: dict[str, Any] | None) -> str:
    return "–" if not d else f"{d['estimate']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]"


def _p(x: Any) -> str:
    return "–" if x is None or not math.isfinite(float(x)) else f"{float(x):.3g}"


def markdown(res: dict[str, Any]) -> str:
    k, k2 = res["k"], res.get("k_secondary", res["k"])
    gain = res.get("gain_on_policy")
    lines = [f"# The 2 x 2 study: precision, lag, interaction (primary pass@{k}, secondary pass@{k2}, paired)", "",
             f"Intervals: 95% {paired.T_METHOD} | 95% {paired.BOOT_METHOD}. C = `{res.get('corrected', C)}`. "
             f"Holm over {', '.join(res['holm']['family']) or 'nothing'} at α = {res['alpha']}. "
             f"F3 non-inferiority margin {res['f3_margin']}"
             + (f" (the on-policy pass@1 gain over the base policy: {gain:+.3f})" if gain is not None else "") + ".", ""]
    for f, v in res["fleets"].items():
        lines += [f"## {f}", "", f"| effect | pass@{k}: t | pass@{k}: bootstrap | p (t) | pass@{k2}: t "
                  "| FP32-sampler reward (t) | verdict |", "|---|---|---|---|---|---|---|"]
        for name, e in v["effects"].items():
            e = e or {}
            lines.append(f"| {name} | {fmt_iv(e.get('t'))} | {fmt_iv(e.get('boot'))} | {_p(e.get('p'))} | "
                         f"{fmt_iv((e.get('secondary') or {}).get('t'))} | {fmt_iv(e.get('reward_fp32'))} | "
                         f"{found(e or None)} |")
        colls = ", ".join(f"{c} {n}" for c, n in sorted(v["collapsed"].items()))
        fish = "; ".join(f"{n}: {t['collapsed'][0]}/{t['runs'][0]} vs {t['collapsed'][1]}/{t['runs'][1]}, "
                         f"p = {_p(t['p'])}" for n, t in v["fisher"].items())
        f4v = v["F4"]
        lines += ["", f"Collapsed (lab/study/outcome.py: monitor, FP32-sampler or held-out drop): {colls}",
                  f"Fisher's exact test: {fish or '–'}", "",
                  f"- F1 uncorrected GRPO is hurt by precision alone: **{v['F1']}** (Holm p {_p(v['p_holm']['F1'])})",
                  f"- F2 the correction beats GRPO, precision alone: **{v['F2']}** (Holm p {_p(v['p_holm']['F2'])})",
                  f"- F4 the oob rate follows the precision KL: **{f4v['verdict']}** "
                  f"(pooled trend z {_p(f4v.get('z'))}, p {_p(f4v.get('p'))}; runs increasing "
                  f"{'/'.join(map(str, f4v.get('runs_increasing') or [])) or '–'}, sign-test p {_p(f4v.get('p_sign'))})", ""]
    f3 = res["F3"]
    lines += [f"F3 mixed not worse than homogeneous (C, sync, margin {f3['margin']}): **{f3['verdict']}** "
              f"({fmt_iv((f3['effect'] or {}).get('t'))}, Holm p {_p(f3.get('p_holm'))})", ""]
    return "\n".join(lines)


def main(out: Path, study: dict[str, Any]) -> int:
    """``mixrl compare --recompute OUT``: judge from ``OUT/data``; writes design.json and design.md."""
    runs = studydata.load(Path(out))
    if not runs:
        print(f"mixrl compare: no data files under {Path(out) / 'data'}", flush=True, file=sys.stderr)
        return 2
    res = judge(runs, study)
    (Path(out) / "design.json").write_text(json.dumps(res, indent=1, default=float))
    text = markdown(res)
    (Path(out) / "design.md").write_text(text)
    print(text)
    return 0
