"""The seed study's four findings, judged from the data of a comparison.

Each verdict is ``reproduced``, ``not reproduced`` or ``inconclusive`` with the
figures behind it; nothing is assumed. A missing arm makes its finding
inconclusive.

1. Uncorrected GRPO on mixed-precision samplers collapses (reward falls, KL
   grows >= 3x, episodes end on repeated format errors).
2. SC + MIS (with or without top-p replay) stays stable on the mixed fleet.
3. With SC + MIS + top-p the mixed fleet matches the homogeneous fleet's
   held-out pass@k at lower modelled cost.
4. A group's share of out-of-range tokens follows its KL, not its share of samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mixrl.observe.plots import group_stats, kl_key
from mixrl.observe.runs import Run


@dataclass
class Finding:
    title: str
    verdict: str  # "reproduced" | "not reproduced" | "inconclusive"
    evidence: str


def kl_growth(run: Run, skip: int = 10, early: int = 10, late: int = 10) -> float:
    """Mean KL of the last ``late`` steps over the mean of steps (skip, skip + early].

    The first steps are skipped as in the collapse monitor: an async run has no
    staleness yet, so their KL is the precision mismatch alone.
    """
    k = kl_key(run)
    _, ys = run.series(k)
    if len(ys) < skip + early + late:
        skip = 0
    e = sum(ys[skip:skip + early]) / max(1, len(ys[skip:skip + early])) if ys else math.nan
    last = run.mean(k, last=late)
    return last / e if e and e > 0 else math.nan


def summarize(run: Run, k: int = 4) -> dict[str, float | str | bool]:
    n = max(1, len(run.rows) // 10)
    return {
        "run": run.name,
        "steps": len(run.rows),
        "reward_first": run.mean("rollout/reward", first=n),
        "reward_final": run.mean("rollout/reward", last=n),
        f"pass@{k}": float(run.eval.get(f"pass@{k}", math.nan)),
        "pass@1": float(run.eval.get("pass@1", math.nan)),
        "kl_growth": kl_growth(run),
        "ratio_oob": run.mean("mismatch/ratio_oob"),
        "format_error_end": run.mean("rollout/format_error_end", last=n),
        "collapse_flags": ",".join(run.flags()) or "none",
        "collapsed": run.collapsed,
        "cost": run.mean("cost/cumulative", last=1),
    }


def _find(runs: list[Run], fleet: str, arm: str) -> Run | None:
    return next((r for r in runs if r.fleet == fleet and r.arm == arm and r.rows), None)


def _spearman(a: list[float], b: list[float]) -> float:
    def ranks(x: list[float]) -> list[float]:
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        for pos, i in enumerate(order):
            r[i] = float(pos)
        return r

    if len(a) < 3:
        return math.nan
    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    va = math.sqrt(sum((x - ma) ** 2 for x in ra))
    vb = math.sqrt(sum((y - mb) ** 2 for y in rb))
    return cov / (va * vb) if va > 0 and vb > 0 else math.nan


def judge(runs: list[Run], k: int = 4) -> list[Finding]:
    out = []
    grpo = _find(runs, "mixed", "grpo")
    if grpo is None:
        out.append(Finding("1. uncorrected GRPO collapses on mixed samplers", "inconclusive",
                           "no `grpo` run on the mixed fleet"))
    else:
        s = summarize(grpo, k)
        ev = (f"reward {s['reward_first']:.3f} -> {s['reward_final']:.3f}, KL growth "
              f"{s['kl_growth']:.2f}x, format-error share at the end {s['format_error_end']:.3f}, "
              f"flags: {s['collapse_flags']}, over {s['steps']} steps")
        out.append(Finding("1. uncorrected GRPO collapses on mixed samplers",
                           "reproduced" if grpo.collapsed else "not reproduced", ev))
    stable = [r for a in ("sc+mis", "sc+mis+top-p") if (r := _find(runs, "mixed", a))]
    if not stable:
        out.append(Finding("2. SC + MIS stays stable on mixed samplers", "inconclusive",
                           "no `sc+mis` / `sc+mis+top-p` run on the mixed fleet"))
    else:
        parts = [f"{r.arm}: flags {','.join(r.flags()) or 'none'}, KL growth {kl_growth(r):.2f}x"
                 for r in stable]
        if any(r.collapsed for r in stable):
            verdict = "not reproduced"
        elif grpo is not None and not grpo.collapsed:
            verdict = "inconclusive"
            parts.append("stable, but the uncorrected baseline did not collapse either, so the "
                         "corrections were not needed at this scale")
        else:
            verdict = "reproduced"
        out.append(Finding("2. SC + MIS stays stable on mixed samplers", verdict, "; ".join(parts)))
    mixed, homo = _find(runs, "mixed", "sc+mis+top-p"), _find(runs, "homogeneous", "sc+mis+top-p")
    if mixed is None or homo is None or f"pass@{k}" not in mixed.eval or f"pass@{k}" not in homo.eval:
        out.append(Finding("3. mixed fleet matches homogeneous at lower cost", "inconclusive",
                           "needs `sc+mis+top-p` on both fleets with a final evaluation"))
    else:
        pm, ph = float(mixed.eval[f"pass@{k}"]), float(homo.eval[f"pass@{k}"])
        n = float(mixed.eval.get("n_tasks", 50))
        tol = 2 * math.sqrt(max(pm * (1 - pm), ph * (1 - ph), 0.05) / n)
        cm, ch = mixed.mean("cost/cumulative", last=1), homo.mean("cost/cumulative", last=1)
        ev = (f"pass@{k} mixed {pm:.3f} vs homogeneous {ph:.3f} (noise band ±{tol:.3f} over "
              f"{int(n)} tasks); modelled cost mixed ${cm:.4f} vs homogeneous ${ch:.4f}")
        if pm >= ph - tol and cm < ch:
            verdict = "reproduced"
        elif pm < ph - tol or cm >= ch:
            verdict = "not reproduced"
        else:
            verdict = "inconclusive"
        out.append(Finding("3. mixed fleet matches homogeneous at lower cost", verdict, ev))
    run = mixed or next((r for r in runs if r.fleet == "mixed" and r.groups()), None)
    stats = group_stats(run) if run else {}
    if not stats:
        out.append(Finding("4. out-of-range share follows KL, not sample share", "inconclusive",
                           "no per-group metrics on a mixed fleet"))
    else:
        total_oob = sum(run.mean(f"mismatch/ratio_oob/{g}") or 0 for g in stats)  # type: ignore[union-attr]
        g = sorted(stats)
        oob = [stats[x]["share_oob"] for x in g]
        rho_kl = _spearman(oob, [stats[x]["kl"] for x in g])
        rho_s = _spearman(oob, [stats[x]["share_samples"] for x in g])
        ev = (f"{run.name}: Spearman(oob share, KL) = {rho_kl:.2f}, "  # type: ignore[union-attr]
              f"Spearman(oob share, sample share) = {rho_s:.2f} over {len(g)} groups")
        if not total_oob or any(math.isnan(x) for x in oob) or math.isnan(rho_kl):
            verdict, ev = "inconclusive", ev + "; too few tokens left [0.2, 5] to rank groups"
        elif rho_kl > 0.5 and (math.isnan(rho_s) or rho_kl > rho_s):
            verdict = "reproduced"
        else:
            verdict = "not reproduced"
        out.append(Finding("4. out-of-range share follows KL, not sample share", verdict, ev))
    return out
