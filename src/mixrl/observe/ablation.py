"""The correction ablation: which ingredient of a preset costs (or buys) held-out pass@1.

    mixrl compare --arms grpo,grpo+top-p,sc,grpo+mis,sc+mis,sc+mis+top-p \\
        --fleets exact,mixed --modes sync --seeds 5 --steps 80 --out OUT
    mixrl compare --ablation OUT          # this table, from OUT/data alone

Every arm is compared with ``grpo`` on the same fleet (same seeds: same prompts; same
held-out tasks and sampling seeds), pass@1 per seed and task, with both intervals of
``observe/paired.py``. On the ``exact`` fleet (one FP32 sampler group = the trainer's
numerics, sync) there is no mismatch to correct: an ingredient whose interval there
excludes 0 changes what is learned, not how mismatch is handled. Each ingredient is
also isolated by the pair that differs by it alone:

    top-p support replay   grpo+top-p − grpo,   sc+mis+top-p − sc+mis
    score centering        sc − grpo,           sc+mis − grpo+mis
    MIS                    grpo+mis − grpo,     sc+mis − sc

``topp_eval`` (optional) holds the same runs' final policies scored with the
sampler's nucleus (``mixrl eval RUN/policy --top-p 0.9``): what a top-p arm was
trained for, beside the full distribution the held-out evaluation scores.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mixrl.observe import studydata
from mixrl.observe.design import _by_seed, _fmt, _found, effect
from mixrl.observe.stats import passk_matrix

ARMS = ("grpo", "grpo+top-p", "sc", "grpo+mis", "sc+mis", "sc+mis+top-p")
PAIRS = {
    "top-p support replay": (("grpo+top-p", "grpo"), ("sc+mis+top-p", "sc+mis")),
    "score centering": (("sc", "grpo"), ("sc+mis", "grpo+mis")),
    "MIS [0.2, 5]": (("grpo+mis", "grpo"), ("sc+mis", "sc")),
}


def cell_mean(cell: dict[str, Any]) -> float:
    """Mean held-out pass@1 over the cell's seeds and tasks."""
    seeds = sorted(cell)
    tasks = sorted(set.intersection(*(set(cell[s].eval.get("per_task") or {}) for s in seeds)))
    return float(passk_matrix([cell[s].eval["per_task"] for s in seeds], tasks, 1).mean())


def judge(out: Path) -> dict[str, Any]:
    cells = _by_seed(studydata.load(Path(out)))
    fleets = sorted({c.split("/")[0] for c in cells})
    res: dict[str, Any] = {"metric": "held-out pass@1", "fleets": {}}
    for f in fleets:
        here = {a: cells[f"{f}/{a}"] for a in ARMS if f"{f}/{a}" in cells}
        arms = {a: {"pass@1": cell_mean(c), "seeds": len(c)} for a, c in here.items()}
        for a in arms:
            if a != "grpo":
                e = effect(cells, [f"{f}/{a}"], [f"{f}/grpo"], 1)
                arms[a]["vs grpo"] = e
                arms[a]["verdict"] = _found(e)
        ingredients = {}
        for name, pairs in PAIRS.items():
            ingredients[name] = []
            for plus, minus in pairs:
                e = effect(cells, [f"{f}/{plus}"], [f"{f}/{minus}"], 1)
                ingredients[name].append({"contrast": f"{plus} − {minus}", "effect": e, "verdict": _found(e)})
        res["fleets"][f] = {"arms": arms, "ingredients": ingredients}
    return res


def markdown(res: dict[str, Any]) -> str:
    lines = ["# Correction ablation: held-out pass@1, paired with grpo on the same fleet", "",
             "Intervals: 95% paired t over seeds | 95% hierarchical bootstrap (seeds, tasks).", ""]
    for f, v in res["fleets"].items():
        lines += [f"## {f}", "", "| arm | seeds | pass@1 | − grpo: t | − grpo: bootstrap | verdict |",
                  "|---|---|---|---|---|---|"]
        for a, r in v["arms"].items():
            e = r.get("vs grpo") or {}
            lines.append(f"| {a} | {r['seeds']} | {r['pass@1']:.3f} | {_fmt(e.get('t'))} | "
                         f"{_fmt(e.get('boot'))} | {r.get('verdict', '(reference)')} |")
        lines += ["", "| ingredient | contrast | t | bootstrap | verdict |", "|---|---|---|---|---|"]
        for name, rows in v["ingredients"].items():
            for row in rows:
                e = row["effect"] or {}
                lines.append(f"| {name} | {row['contrast']} | {_fmt(e.get('t'))} | {_fmt(e.get('boot'))} | "
                             f"{row['verdict']} |")
        lines.append("")
    return "\n".join(lines)


def main(out: Path) -> int:
    """``mixrl compare --ablation OUT``: writes OUT/ablation.json and OUT/ablation.md."""
    if not any((Path(out) / "data").glob("*/*/seed*.json")):
        print(f"mixrl compare: no data files under {Path(out) / 'data'}", flush=True)
        return 2
    res = judge(Path(out))
    (Path(out) / "ablation.json").write_text(json.dumps(res, indent=1, default=float) + "\n")
    text = markdown(res)
    (Path(out) / "ablation.md").write_text(text)
    print(text)
    return 0
