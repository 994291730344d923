"""The correction ablation: which ingredient of a preset costs (or buys) held-out pass@1.

    mixrl compare --arms grpo,grpo+top-p,sc,grpo+mis,sc+mis,sc+mis+top-p \\
        --fleets exact,mixed --modes sync --seeds 5 --steps 80 --out OUT
    mixrl compare --ablation OUT          # this table, from OUT/data alone

Every arm is compared with ``grpo`` on the same fleet (same seeds: same prompts; same
held-out tasks and sampling seeds), pass@1 per seed and task, with both intervals of
``lab/study/paired.py``. On the ``exact`` fleet (one FP32 sampler group = the trainer's
numerics, sync) there is no mismatch to correct: an ingredient whose interval there
excludes 0 changes what is learned, not how mismatch is handled. Each ingredient is
also isolated by the pair that differs by it alone:

    top-p support replay   grpo+top-p − grpo,   sc+mis+top-p − sc+mis
    score centering        sc − grpo,           sc+mis − grpo+mis
    MIS                    grpo+mis − grpo,     sc+mis − sc

``OUT/topp/<fleet>/<arm>/seed<s>.json`` (``mixrl compare --ablation OUT --ablation-top-p
0.9``, which writes them from the run directories' final policies) holds the same held-out
tasks and sampling seeds scored inside the nucleus (``mixrl eval RUN/policy --top-p 0.9``):
what a top-p arm was trained for, beside the full distribution that the run's own held-out
evaluation scores. They are committed with ``OUT/data``, so the table needs no run directory.
"""

from __future__ import annotations

import copy
import json
import sys
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mixrl.lab.study import studydata
from mixrl.lab.study.design import by_seed, effect, fmt_iv, found
from mixrl.lab.study.stats import passk_matrix
from mixrl.records.run_dir import RunDir
from mixrl.system.files import atomic_write_json

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


def score_top_p(out: Path, top_p: float, jobs: int = 2) -> int:
    """Score every finished run's final policy inside the nucleus ``top_p`` (held-out tasks,
    samples and seed of its own evaluation); files already written are kept. Returns how many
    runs were scored."""
    todo = []
    for policy in sorted(Path(out).glob("*/*/seed*/policy")):
        run = policy.parent
        rel = run.relative_to(out)
        dest = Path(out) / "topp" / rel.parent / f"{rel.name}.json"
        if not dest.exists() and RunDir(run).summary.exists():
            todo.append((run, dest))

    def one(item: tuple[Path, Path]) -> bool:
        run, dest = item
        ev = tomllib.loads(RunDir(run).config.read_text()).get("runtime", {}).get("eval", {})
        res = studydata.fp32_score(run / "policy", run, int(ev.get("n_tasks", 64)), int(ev.get("n", 4)),
                                   int(ev.get("seed", 1234)), top_p=top_p)
        if "error" in res:
            print(f"  {run}: eval failed: {res['error']}", flush=True)
            return False
        dest.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(dest, {"top_p": top_p, "pass@1": res["pass@1"], "per_task": res["per_task"]})
        return True

    with ThreadPoolExecutor(max(1, jobs)) as pool:
        return sum(pool.map(one, todo))


def _topp_cells(out: Path, cells: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The runs again with their nucleus-scored ``per_task`` (cells ``<fleet>/<arm>@top-p``)."""
    res: dict[str, dict[str, Any]] = {}
    for f in sorted(Path(out, "topp").glob("*/*/seed*.json")):
        cell, seed = f"{f.parent.parent.name}/{f.parent.name}", f.stem
        if seed in cells.get(cell, {}):
            r = copy.copy(cells[cell][seed])
            r.eval = {"per_task": json.loads(f.read_text())["per_task"]}
            res.setdefault(f"{cell}@top-p", {})[seed] = r
    return res


def judge(out: Path) -> dict[str, Any]:
    cells = by_seed(studydata.load(Path(out)))
    cells.update(_topp_cells(Path(out), cells))
    fleets = sorted({c.split("/")[0] for c in cells})
    res: dict[str, Any] = {"metric": "held-out pass@1", "fleets": {}}
    for f in fleets:
        here = {a: cells[f"{f}/{a}"] for a in ARMS if f"{f}/{a}" in cells}
        arms = {a: {"pass@1": cell_mean(c), "seeds": len(c)} for a, c in here.items()}
        for a in arms:
            if a != "grpo":
                e = effect(cells, [f"{f}/{a}"], [f"{f}/grpo"], 1)
                arms[a]["vs grpo"] = e
                arms[a]["verdict"] = found(e)
        ingredients = {}
        for name, pairs in PAIRS.items():
            ingredients[name] = []
            for plus, minus in pairs:
                e = effect(cells, [f"{f}/{plus}"], [f"{f}/{minus}"], 1)
                ingredients[name].append({"contrast": f"{plus} − {minus}", "effect": e, "verdict": found(e)})
        topp = {}
        for a in ARMS:  # each arm inside the nucleus, against grpo scored on its full distribution
            if f"{f}/{a}@top-p" in cells:
                e = effect(cells, [f"{f}/{a}@top-p"], [f"{f}/grpo"], 1)
                en = effect(cells, [f"{f}/{a}@top-p"], [f"{f}/grpo@top-p"], 1) if a != "grpo" else None
                topp[a] = {"pass@1": cell_mean(cells[f"{f}/{a}@top-p"]), "vs grpo (full)": e, "verdict": found(e),
                           "vs grpo (nucleus)": en, "verdict_nucleus": found(en) if en else "(reference)"}
        res["fleets"][f] = {"arms": arms, "ingredients": ingredients, "scored_in_nucleus": topp}
    return res


def markdown(res: dict[str, Any]) -> str:
    lines = ["# Correction ablation: held-out pass@1, paired with grpo on the same fleet", "",
             "Intervals: 95% paired t over seeds | 95% hierarchical bootstrap (seeds, tasks).", ""]
    for f, v in res["fleets"].items():
        lines += [f"## {f}", "", "| arm | seeds | pass@1 | − grpo: t | − grpo: bootstrap | verdict |",
                  "|---|---|---|---|---|---|"]
        for a, r in v["arms"].items():
            e = r.get("vs grpo") or {}
            lines.append(f"| {a} | {r['seeds']} | {r['pass@1']:.3f} | {fmt_iv(e.get('t'))} | "
                         f"{fmt_iv(e.get('boot'))} | {r.get('verdict', '(reference)')} |")
        lines += ["", "| ingredient | contrast | t | bootstrap | verdict |", "|---|---|---|---|---|"]
        for name, rows in v["ingredients"].items():
            for row in rows:
                e = row["effect"] or {}
                lines.append(f"| {name} | {row['contrast']} | {fmt_iv(e.get('t'))} | {fmt_iv(e.get('boot'))} | "
                             f"{row['verdict']} |")
        if v.get("scored_in_nucleus"):
            lines += ["", "Scored inside the sampler's nucleus (`mixrl eval --top-p`): against grpo on its full "
                      "distribution, and against grpo scored inside the same nucleus:", "",
                      "| arm | pass@1 in the nucleus | − grpo (full): t | verdict | − grpo (nucleus): t | bootstrap "
                      "| verdict |", "|---|---|---|---|---|---|---|"]
            for a, r in v["scored_in_nucleus"].items():
                e, en = r["vs grpo (full)"] or {}, r.get("vs grpo (nucleus)") or {}
                lines.append(f"| {a} | {r['pass@1']:.3f} | {fmt_iv(e.get('t'))} | {r['verdict']} | "
                             f"{fmt_iv(en.get('t'))} | {fmt_iv(en.get('boot'))} | {r.get('verdict_nucleus', '')} |")
        lines.append("")
    return "\n".join(lines)


def main(out: Path, top_p: float | None = None, jobs: int = 2) -> int:
    """``mixrl compare --ablation OUT [--ablation-top-p P]``: writes OUT/ablation.json and OUT/ablation.md."""
    if top_p is not None:
        if not 0 < top_p <= 1:
            print(f"mixrl compare: --ablation-top-p must be in (0, 1], got {top_p}", file=sys.stderr)
            return 2
        print(f"scored {score_top_p(Path(out), top_p, jobs)} final policies inside top-p {top_p}", flush=True)
    if not any((Path(out) / "data").glob("*/*/seed*.json")):
        print(f"mixrl compare: no data files under {Path(out) / 'data'}", flush=True, file=sys.stderr)
        return 2
    res = judge(Path(out))
    (Path(out) / "ablation.json").write_text(json.dumps(res, indent=1, default=float) + "\n")
    text = markdown(res)
    (Path(out) / "ablation.md").write_text(text)
    print(text)
    return 0
