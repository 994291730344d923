"""The seed study's four findings, judged from the data of a comparison, with intervals.

Each verdict is ``reproduced``, ``not reproduced``, ``not distinguishable`` (the
bootstrap interval of the difference that decides it contains 0) or
``inconclusive`` (an arm is missing); the interval and the figures behind it are
part of the evidence. Held-out scores are pass@k of the final policy over seeds
and tasks (``lab/study/stats.py``), on all evaluated tasks and, reported
separately, on the hard subset (tasks the base policy solves < 25% of the time).
Findings 1, 2 and 4 are judged per fleet (mixed and stress, where run).

1. Uncorrected GRPO collapses: ``grpo`` on the fleet vs the zero-mismatch
   ``on-policy`` reference: pass@k difference below 0 and a collapse flagged in
   at least half of the seeds.
2. SC + MIS stays stable: ``sc+mis+top-p`` (else ``sc+mis``) never collapses and
   beats ``grpo`` on the same fleet.
3. Mixed matches homogeneous: ``sc+mis+top-p`` mixed vs homogeneous, judged on
   quality only; the modelled cost (profile price and throughput table, not a
   measurement) is reported beside it, never as evidence.
4. A group's share of out-of-range staleness-0 tokens follows its precision KL
   rather than its share of samples: per run, Spearman(oob share, KL) − Spearman(oob
   share, sample share) over the fleet's groups (average ranks for ties), a t-interval
   over runs; inconclusive ("untestable") when the two rankings coincide.

Differences of two arms pair their seeds (``_diff``): the paired t over seeds and
the two-way bootstrap over seeds x tasks (``lab/study/paired.py``), both required to
exclude 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from mixrl.lab.study import paired
from mixrl.lab.study.plots import kl_key
from mixrl.lab.study.runs import Run
from mixrl.lab.study.stats import (
    NOT_DISTINGUISHABLE,
    Interval,
    bootstrap_mean_diff,
    bootstrap_passk_diff,
    bootstrap_passk_mean,
    hard_tasks,
    passk_matrix,
)

COST_SOURCE = ("modelled: generated tokens / profile tokens_per_second x price_per_hour, "
               "from sampling/profiles.toml (list prices, modelled throughput; not measured)")


@dataclass
class Finding:
    title: str
    verdict: str  # "reproduced" | "not reproduced" | "not distinguishable" | "inconclusive"
    evidence: str
    interval: Interval | None = None


def kl_growth(run: Run, skip: int = 10, early: int = 10, late: int = 10) -> float:
    """Mean precision KL of the last ``late`` measured steps over the mean of (skip, skip + early].

    Precision KL exists only on steps with staleness-0 tokens, which async runs have few of; a run
    with too few measured steps for two windows splits them in halves, and under 4 it is NaN
    (not measured) rather than a ratio of one value to itself."""
    _, ys = run.series(kl_key(run))
    if len(ys) < 4:
        return math.nan
    if len(ys) < skip + early + late:
        skip, early = 0, len(ys) // 2
        late = len(ys) - early
    e = sum(ys[skip:skip + early]) / early
    last = sum(ys[-late:]) / late
    return last / e if e > 0 else math.nan


def _growths(runs: list[Run]) -> str:
    return ", ".join("not measured" if math.isnan(g := kl_growth(r)) else f"{g:.2f}x" for r in runs)


def summarize(run: Run, k: int = 4) -> dict[str, float | str | bool]:
    n = max(1, len(run.rows) // 10)
    pre = kl_key(run).split("/")[0]
    return {
        "run": run.name,
        "steps": len(run.rows),
        "reward_first": run.mean("rollout/reward", first=n),
        "reward_final": run.mean("rollout/reward", last=n),
        f"pass@{k}": float(run.eval.get(f"pass@{k}", math.nan)),
        "pass@1": float(run.eval.get("pass@1", math.nan)),
        "kl": run.mean(kl_key(run)),
        "kl_growth": kl_growth(run),
        "ratio_oob": run.mean(f"{pre}/ratio_oob"),
        "format_error_end": run.mean("rollout/format_error_end", last=n),
        "empty_last_reply": run.mean("rollout/empty_last_reply", last=n),
        "length": run.mean("rollout/length", last=n),
        "collapse_flags": ",".join(run.flags()) or "none",
        "collapsed": run.collapsed,
        "cost": run.mean("cost/cumulative", last=1),
    }


def cells(runs: list[Run]) -> dict[str, list[Run]]:
    """``<fleet>/<arm>`` -> its runs (one per seed), runs without metrics left out."""
    out: dict[str, list[Run]] = {}
    for r in runs:
        if r.rows:
            out.setdefault(r.cell, []).append(r)
    return out


def per_task(run: Run) -> dict[str, Any] | None:
    t = run.eval.get("per_task")
    return dict(t) if isinstance(t, dict) and t else None


def hard_set(runs: list[Run]) -> list[str]:
    """Held-out tasks the base policy solves < 25% of the time (any run's base evaluation:
    it is the same policy, tasks and sampling seeds in every run of a study)."""
    for r in runs:
        base = r.base.get("per_task") if r.base else None
        if isinstance(base, dict) and base:
            return hard_tasks(base)
    return []


def _tables(rs: list[Run]) -> list[dict[str, Any]]:
    return [t for r in rs if (t := per_task(r)) is not None]


def cell_table(runs: list[Run], k: int) -> list[dict[str, Any]]:
    """One row per cell: means over seeds with 95% bootstrap intervals."""
    hard, rows = hard_set(runs), []
    for name, rs in sorted(cells(runs).items()):
        tabs = _tables(rs)
        s = [summarize(r, k) for r in rs]
        row: dict[str, Any] = {"cell": name, "seeds": len(rs), "steps": min(int(x["steps"]) for x in s)}
        row[f"pass@{k}"] = bootstrap_passk_mean(tabs, k) if tabs else None
        row[f"pass@{k} hard"] = bootstrap_passk_mean(tabs, k, tasks=hard) if tabs and hard else None
        for key in ("reward_final", "kl", "ratio_oob", "format_error_end", "empty_last_reply", "length"):
            row[key] = bootstrap_mean_diff([float(x[key]) for x in s])
        row["collapsed"] = f"{sum(bool(x['collapsed']) for x in s)}/{len(s)}"
        row["kl_metric"] = ",".join(sorted({kl_key(r) for r in rs}))
        row["cost (modelled)"] = sum(float(x["cost"]) for x in s) / len(s)
        rows.append(row)
    return rows


def _diff(a: list[Run], b: list[Run], k: int, tasks: list[str] | None = None) -> Interval | None:
    """pass@k(A) − pass@k(B). Seeds present in both arms are paired (same seed: same prompts):
    the paired t over seeds and the two-way bootstrap over seeds x tasks (``lab/study/paired.py``),
    reported as the union of the two, so a difference counts only when both exclude 0. Without
    two shared seeds: the bootstrap over seeds and (paired) tasks of ``lab/study/stats.py``."""
    ta, tb = _tables(a), _tables(b)
    if not ta or not tb or tasks == []:
        return None
    pa = {r.seed: r for r in a if per_task(r)}
    pb = {r.seed: r for r in b if per_task(r)}
    seeds = sorted(set(pa) & set(pb) - {""})
    if len(seeds) >= 2:
        common = sorted(set.intersection(*(set(per_task(x[s]) or {}) for x in (pa, pb) for s in seeds)))
        ts = common if tasks is None else [t for t in tasks if t in common]
        if len(ts) >= 2:
            ma = passk_matrix([per_task(pa[s]) or {} for s in seeds], ts, k)
            mb = passk_matrix([per_task(pb[s]) or {} for s in seeds], ts, k)
            t, boot = paired.both(ma, mb)
            if t is not None and boot is not None:
                return Interval(t.estimate, min(t.lo, boot.lo), max(t.hi, boot.hi), t.level, 0,
                                f"{len(seeds)} paired seeds x {len(ts)} tasks: {t.method} "
                                f"[{t.lo:+.3f}, {t.hi:+.3f}] and {boot.method} [{boot.lo:+.3f}, {boot.hi:+.3f}]")
    return bootstrap_passk_diff(ta, tb, k, tasks=tasks)


def _iv(iv: Interval | None) -> str:
    return str(iv) if iv is not None else "no interval (no per-task evaluation)"


def _fleets(c: dict[str, list[Run]]) -> list[str]:
    return [f for f in ("mixed", "stress") if any(name.startswith(f + "/") for name in c)]


def _f1(c: dict[str, list[Run]], fleet: str, k: int, hard: list[str]) -> Finding:
    title = f"1. uncorrected GRPO collapses ({fleet} fleet)"
    grpo, ref = c.get(f"{fleet}/grpo"), c.get("reference/on-policy")
    if not grpo or not ref:
        return Finding(title, "inconclusive", f"needs `{fleet}/grpo` and `reference/on-policy` runs")
    iv = _diff(grpo, ref, k)
    collapsed = sum(r.collapsed for r in grpo)
    rew = bootstrap_mean_diff([summarize(r, k)["reward_final"] for r in grpo],  # type: ignore[misc]
                              [summarize(r, k)["reward_final"] for r in ref])  # type: ignore[misc]
    ev = (f"pass@{k} grpo - on-policy: {_iv(iv)}; hard subset ({len(hard)} tasks): "
          f"{_iv(_diff(grpo, ref, k, hard))}; final training reward difference {_iv(rew)}; "
          f"collapse flagged in {collapsed}/{len(grpo)} seeds; precision KL growth "
          + _growths(grpo))
    if iv is None:
        return Finding(title, "inconclusive", ev)
    if iv.contains_zero:
        verdict = NOT_DISTINGUISHABLE
    elif iv.hi < 0 and 2 * collapsed >= len(grpo):
        verdict = "reproduced"
    else:
        verdict = "not reproduced"
    return Finding(title, verdict, ev, iv)


def _f2(c: dict[str, list[Run]], fleet: str, k: int, hard: list[str]) -> Finding:
    title = f"2. SC + MIS stays stable ({fleet} fleet)"
    arm = next((a for a in ("sc+mis+top-p", "sc+mis") if c.get(f"{fleet}/{a}")), None)
    grpo = c.get(f"{fleet}/grpo")
    if arm is None or not grpo:
        return Finding(title, "inconclusive", f"needs `{fleet}/sc+mis+top-p` (or sc+mis) and `{fleet}/grpo`")
    sc = c[f"{fleet}/{arm}"]
    iv = _diff(sc, grpo, k)
    collapsed = sum(r.collapsed for r in sc)
    ref = c.get("reference/on-policy")
    ev = (f"pass@{k} {arm} - grpo: {_iv(iv)}; hard subset: {_iv(_diff(sc, grpo, k, hard))}; "
          f"{arm} - on-policy: {_iv(_diff(sc, ref, k) if ref else None)}; "
          f"collapse flagged in {collapsed}/{len(sc)} seeds of {arm}")
    if collapsed:
        return Finding(title, "not reproduced", ev, iv)
    if iv is None:
        return Finding(title, "inconclusive", ev)
    verdict = NOT_DISTINGUISHABLE if iv.contains_zero else ("reproduced" if iv.lo > 0 else "not reproduced")
    return Finding(title, verdict, ev, iv)


def _f3(c: dict[str, list[Run]], k: int, hard: list[str]) -> Finding:
    title = "3. mixed fleet matches homogeneous (quality; cost reported separately)"
    mixed, homo = c.get("mixed/sc+mis+top-p"), c.get("homogeneous/sc+mis+top-p")
    if not mixed or not homo:
        return Finding(title, "inconclusive", "needs `sc+mis+top-p` on the mixed and homogeneous fleets")
    iv = _diff(mixed, homo, k)
    cm = sum(r.mean("cost/cumulative", last=1) for r in mixed) / len(mixed)
    ch = sum(r.mean("cost/cumulative", last=1) for r in homo) / len(homo)
    ev = (f"pass@{k} mixed - homogeneous: {_iv(iv)}; hard subset: {_iv(_diff(mixed, homo, k, hard))}. "
          f"Cost, separately: mixed ${cm:.4f} vs homogeneous ${ch:.4f} per run ({COST_SOURCE})")
    if iv is None:
        return Finding(title, "inconclusive", ev)
    # "matches" is only ever "no difference found"; the width says how much could hide in it
    verdict = NOT_DISTINGUISHABLE if iv.contains_zero else ("reproduced" if iv.lo > 0 else "not reproduced")
    return Finding(title, verdict, ev + f"; interval width {iv.hi - iv.lo:.3f}", iv)


def _f4(c: dict[str, list[Run]], fleet: str) -> Finding:
    """Precision-only out-of-range token counts against the groups' precision-KL order (``design.f4``)."""
    from mixrl.lab.study.design import f4

    title = f"4. out-of-range rate follows precision KL ({fleet} fleet)"
    runs = [r for name, rs in c.items() if name.startswith(fleet + "/") for r in rs if len(r.groups()) >= 2]
    res = f4(runs)
    groups = ", ".join(f"{g} {v['oob']}/{v['tokens']:.0f} (KL {v['kl']:.3g})" for g, v in res["groups"].items())
    inc = res.get("runs_increasing")
    ev = (f"staleness-0 tokens outside [0.2, 5] per group: {groups or 'none'}; {res['test']}"
          + (f": z {res['z']:.2f}, p {res['p']:.3g}; runs whose own trend increases {inc[0]}/{inc[1]} "
             f"(sign test p {res['p_sign']:.3g})" if res.get("z") is not None and inc else ""))
    verdict = res["verdict"] if not res["verdict"].startswith("untestable") else "inconclusive"
    return Finding(title, verdict, ev + ("; " + res["verdict"] if verdict == "inconclusive" else ""))


def judge(runs: list[Run], k: int = 4) -> list[Finding]:
    c, hard = cells(runs), hard_set(runs)
    fleets = _fleets(c) or ["mixed"]
    # Findings 1 and 2 on the homogeneous fleet too: the seed saw GRPO collapse there later, and a
    # deficit that is as large there as on the mixed fleet comes from policy lag, not precision.
    homo = ["homogeneous"] if any(name.startswith("homogeneous/grpo") for name in c) else []
    out = [_f1(c, f, k, hard) for f in homo + fleets]
    out += [_f2(c, f, k, hard) for f in homo + fleets]
    out.append(_f3(c, k, hard))
    out += [_f4(c, f) for f in fleets]
    return out
