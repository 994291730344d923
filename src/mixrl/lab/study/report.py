"""``mixrl report DIR``: a self-contained HTML file and a Markdown summary.

DIR is a run directory or a compare directory. Figures are rendered into
``DIR/figures`` and embedded into ``DIR/report.html`` as base64, so the HTML
file travels alone. ``DIR/report.md`` holds the same tables and verdicts.
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import math
import sys
from pathlib import Path
from typing import Any

from mixrl.lab.study import studydata, studyreport
from mixrl.lab.study.findings import COST_SOURCE, Finding, cell_table, hard_set, judge, summarize
from mixrl.lab.study.plots import (
    plot_curves,
    plot_groups,
    plot_passk_cost,
    plot_precision_lag,
    plot_timelines,
    precision_lag_means,
)
from mixrl.lab.study.runs import Run, load_runs

COLUMNS = ("run", "steps", "reward_first", "reward_final", "pass@1", "pass@4", "kl", "kl_growth",
           "ratio_oob", "format_error_end", "empty_last_reply", "length", "collapse_flags", "cost")
# One line per column, shown under the table ("pass@4" stands for pass@k).
COLUMN_HELP = {
    "run": "the run (inside a compare directory: fleet/arm)",
    "steps": "trainer updates taken",
    "reward_first": "mean episode reward over the first 10% of the updates",
    "reward_final": "mean episode reward over the last 10% of the updates",
    "pass@1": "held-out share of samples that are correct, final policy (unbiased estimator)",
    "pass@4": "held-out chance that at least one of k samples is correct, final policy",
    "kl": "precision KL (staleness-0 tokens: exact KL where the support is recorded, else k3), mean over the run",
    "kl_growth": "precision KL, mean of the last 10 updates / updates 11-20 (> 1: the mismatch grows)",
    "ratio_oob": "share of staleness-0 tokens whose ratio trainer/sampler is outside [0.2, 5]",
    "format_error_end": "share of episodes ended by repeated format errors, last 10% of updates",
    "empty_last_reply": "share of episodes whose last reply is empty, last 10% of updates",
    "length": "generated tokens per episode, last 10% of updates",
    "collapse_flags": "signals the collapse monitor raised (collapse.jsonl), or none",
    "cost": "sampling cost in USD, " + COST_SOURCE,
}
# One line under each figure.
FIGURE_HELP = {
    "curves": "training curves: one panel per metric, one line per run (moving average)",
    "groups": "per sampler group: precision KL, and share of samples vs share of out-of-range tokens",
    "passk_cost": "held-out pass@k against cumulative modelled sampling cost",
    "timelines": "sampled episodes: one cell per assistant reply (number: tokens; red: empty reply)",
    "precision_lag": "per sampler group, each update: precision KL (staleness-0 tokens: what the group's "
                     "number formats cost) and lag KL (stale tokens: what asynchrony costs), the "
                     "precision/ and lag/ values of metrics.jsonl",
}
PRECISION_LAG_HELP = ("Token-weighted means over the run: precision over staleness-0 tokens (the group's "
                      "number formats), lag over stale tokens (asynchrony); docs/corrections.md section 10.")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, help="a run directory or a compare directory")
    parser.add_argument("--k", type=int, default=None, help="k of the pass@k shown (default: the k the runs evaluated)")
    parser.add_argument("--png", action="store_true", help="also render report.html to report.png (headless Chromium)")


def evaluated_k(runs: list[Run]) -> int:
    """The k the runs' evaluations used (the largest pass@k they report; 4 if none says)."""
    ks = [int(r.eval["k"]) for r in runs if isinstance(r.eval.get("k"), int)]
    if ks:
        return max(ks)
    found = [int(key[5:]) for r in runs for key in r.eval if key.startswith("pass@") and key[5:].isdigit()]
    return max(found) if found else 4


def eval_rows(runs: list[Run], k: int) -> list[dict[str, Any]]:
    """Base vs final held-out evaluation, one row per run that has both or either."""
    out = []
    for r in runs:
        if not r.eval and not r.base:
            continue
        row: dict[str, Any] = {"run": r.name, "tasks": r.eval.get("n_tasks", r.base.get("n_tasks", ""))}
        for tag, ev in (("base", r.base), ("final", r.eval)):
            for key in ("pass@1", f"pass@{k}", "mean_reward"):
                row[f"{tag} {key}"] = float(ev.get(key, math.nan))
        out.append(row)
    return out


def _cols(k: int) -> list[str]:
    """The table's columns with pass@4 shown as the evaluated pass@k (once when k = 1)."""
    return [c if c != "pass@4" else f"pass@{k}" for c in COLUMNS if not (k == 1 and c == "pass@4")]


def _clip(text: str, n: int = 600) -> str:
    return text if len(text) <= n else text[:n] + " ..."


def _cell(v: Any) -> str:
    """An interval as 'mean [lo, hi]'; anything else as ``_fmt``."""
    if v is None:
        return "–"
    if hasattr(v, "lo") and hasattr(v, "estimate"):
        return f"{_fmt(v.estimate)} [{_fmt(v.lo)}, {_fmt(v.hi)}]"
    return _fmt(v)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "–"
        return f"{v:.4g}" if abs(v) < 1e-2 and v != 0 else f"{v:.3f}"
    return str(v)


def load(dir_: Path) -> list[Run]:
    """A study's runs from its per-run data files (``DIR/data``: what is committed) when it has
    them, else the run directories."""
    return studydata.load(dir_) or load_runs(dir_)


def build(dir_: Path, k: int | None = None, study: dict[str, Any] | None = None) -> dict[str, Any]:
    runs = load(dir_)
    k = evaluated_k(runs) if k is None else k
    two_by_two = studyreport.is_study(runs)
    figs_dir = dir_ / "figures"
    figs_dir.mkdir(exist_ok=True)
    figures = [plot_curves(runs, figs_dir)]
    focus = _focus(runs)
    if focus is not None and (g := plot_groups(focus, figs_dir)) is not None:
        figures.append(g)
    focus_pl = focus if focus is not None else runs[0]
    if (pl := plot_precision_lag(focus_pl, figs_dir)) is not None:
        figures.append(pl)
    figures.append(plot_passk_cost(runs, figs_dir, k))
    if (t := plot_timelines(runs, figs_dir)) is not None:
        figures.append(t)
    rows = [summarize(r, k) for r in runs]
    # the 2 x 2 study is read by its own section (paired effects per fleet), not per arm
    table = cell_table(runs, k) if len(runs) > 1 and not two_by_two else []
    findings = judge(runs, k) if len(runs) > 1 and not two_by_two else []
    st = studyreport.build(runs, dir_, study or {}) if two_by_two else None
    episodes = [(r.name, e) for r in runs for e in r.episodes[-4:]] if len(runs) == 1 else []
    return {"runs": runs, "rows": rows, "findings": findings, "figures": figures, "k": k,
            "evals": eval_rows(runs, k), "episodes": episodes, "cells": table,
            "hard": len(hard_set(runs)), "study": st,
            "precision_lag": (focus_pl.name, precision_lag_means(focus_pl)) if pl is not None else None}


def _focus(runs: list[Run]) -> Run | None:
    for arm in ("sc+mis+top-p", "sc+mis"):
        for r in runs:
            if r.arm == arm and r.fleet == "mixed":
                return r
    return next((r for r in runs if r.groups()), None)


def _config_text(runs: list[Run]) -> str:
    cfg = runs[0].config
    return json.dumps(cfg, indent=1, sort_keys=True)[:4000] if cfg else "(no config.json found)"


def markdown(dir_: Path, rep: dict[str, Any], k: int) -> str:
    cols = _cols(k)
    lines = [f"# mixrl report: `{dir_}`", "", "## Runs", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in rep["rows"]:
        lines.append("| " + " | ".join(_fmt(row.get(c, "")) for c in cols) + " |")
    lines += ["", "Columns:", ""]
    lines += [f"- **{c}**: {COLUMN_HELP[c if c != f'pass@{k}' else 'pass@4']}" for c in cols]
    lines += ["", "Costs are modelled (list prices by default); KL is the exact KL where the support "
              "is recorded, else k3.", ""]
    if rep["study"]:
        lines += [studyreport.markdown(rep["study"]), ""]
    if rep["cells"]:
        ccols = list(rep["cells"][0])
        lines += ["## Per arm: mean over seeds [95% bootstrap interval]", "",
                  f"pass@{k} over seeds x held-out tasks; hard: the {rep['hard']} held-out tasks the base "
                  "policy solves < 25% of the time; other columns over seeds. Cost is "
                  + COST_SOURCE + ".", "",
                  "| " + " | ".join(ccols) + " |", "|" + "---|" * len(ccols)]
        lines += ["| " + " | ".join(_cell(r.get(c)) for c in ccols) + " |" for r in rep["cells"]]
        lines.append("")
    if rep["evals"]:
        ecols = list(rep["evals"][0])
        lines += [f"## Held-out evaluation: base vs final (pass@{k})", "",
                  "| " + " | ".join(ecols) + " |", "|" + "---|" * len(ecols)]
        lines += ["| " + " | ".join(_fmt(r.get(c, "")) for c in ecols) + " |" for r in rep["evals"]]
        lines.append("")
    if rep["episodes"]:
        lines += ["## Sample episodes", ""]
        for _name, e in rep["episodes"]:
            lines += [f"**step {e.get('step')}, {e.get('prompt_id')}** - reward {e.get('reward')}, "
                      f"status {e.get('status')}, {e.get('turns')} turn(s), group {e.get('group') or '-'}", "",
                      "```", "PROMPT: " + _clip(str(e.get("prompt", ""))),
                      "EPISODE (replies, tool calls and tool output): " + _clip(str(e.get("completion", ""))), "```", ""]
    if rep["findings"]:
        lines += ["## The seed's findings", ""]
        for f in rep["findings"]:
            lines.append(f"- **{f.title}: {f.verdict}.** {f.evidence}")
        lines.append("")
    if rep["precision_lag"]:
        name, prow = rep["precision_lag"]
        pcols = list(prow[0])
        lines += [f"## Precision vs lag KL per sampler group (`{name}`)", "", PRECISION_LAG_HELP, "",
                  "| " + " | ".join(pcols) + " |", "|" + "---|" * len(pcols)]
        lines += ["| " + " | ".join(_fmt(r.get(c, "")) for c in pcols) + " |" for r in prow]
        lines.append("")
    lines += ["## Figures", ""]
    for p in rep["figures"]:
        lines += [f"![{p.stem}](figures/{p.name})", "", f"*{p.stem}: {FIGURE_HELP.get(p.stem, '')}*", ""]
    lines += ["", "## Config (first run)", "", "```json", _config_text(rep["runs"]), "```", ""]
    return "\n".join(lines)


def render_html(dir_: Path, rep: dict[str, Any], k: int) -> str:
    cols = _cols(k)
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_fmt(r.get(c, '')))}</td>" for c in cols) + "</tr>"
        for r in rep["rows"])
    finds = "".join(_finding_html(f) for f in rep["findings"])
    imgs = "".join(
        f'<figure><img alt="{p.stem}" src="data:image/png;base64,'
        f'{base64.b64encode(p.read_bytes()).decode()}"/><figcaption><b>{p.stem}</b>: '
        f'{html.escape(FIGURE_HELP.get(p.stem, ""))}</figcaption></figure>'
        for p in rep["figures"])
    style = ("body{font-family:sans-serif;max-width:1400px;margin:auto;padding:1em}"
             "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 8px}"
             "img{max-width:100%}.reproduced{color:#070}.not{color:#a00}.inconclusive{color:#a60}")
    helps = "".join(f"<li><b>{html.escape(c)}</b>: {html.escape(COLUMN_HELP[c if c != f'pass@{k}' else 'pass@4'])}</li>"
                    for c in cols)
    cells = ""
    if rep["cells"]:
        ccols = list(rep["cells"][0])
        cells = (f"<h2>Per arm: mean over seeds [95% bootstrap interval]</h2><p>pass@{k} over seeds x "
                 f"held-out tasks; hard: the {rep['hard']} tasks the base policy solves &lt; 25% of the time. "
                 f"Cost is {html.escape(COST_SOURCE)}.</p><table><tr>"
                 + "".join(f"<th>{html.escape(c)}</th>" for c in ccols) + "</tr>"
                 + "".join("<tr>" + "".join(f"<td>{html.escape(_cell(r.get(c)))}</td>" for c in ccols) + "</tr>"
                           for r in rep["cells"]) + "</table>")
    evals = ""
    if rep["evals"]:
        ecols = list(rep["evals"][0])
        evals = (f"<h2>Held-out evaluation: base vs final (pass@{k})</h2><table><tr>"
                 + "".join(f"<th>{html.escape(c)}</th>" for c in ecols) + "</tr>"
                 + "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(r.get(c, '')))}</td>" for c in ecols) + "</tr>"
                           for r in rep["evals"]) + "</table>")
    plag = ""
    if rep["precision_lag"]:
        name, prow = rep["precision_lag"]
        pcols = list(prow[0])
        plag = (f"<h2>Precision vs lag KL per sampler group ({html.escape(name)})</h2>"
                f"<p>{html.escape(PRECISION_LAG_HELP)}</p><table><tr>"
                + "".join(f"<th>{html.escape(c)}</th>" for c in pcols) + "</tr>"
                + "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(r.get(c, '')))}</td>" for c in pcols) + "</tr>"
                          for r in prow) + "</table>")
    if rep["study"]:
        from markdown_it import MarkdownIt

        md = studyreport.markdown(rep["study"])
        for p in rep["study"]["figures"]:  # the figures travel inside the file
            md = md.replace(f"(figures/{p.name})", f"(data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()})")
        cells = MarkdownIt("commonmark").enable("table").render(md) + cells
    eps = "".join(
        f"<h3>step {e.get('step')}, {html.escape(str(e.get('prompt_id')))}: reward {e.get('reward')}, "
        f"status {html.escape(str(e.get('status')))}, {e.get('turns')} turn(s)</h3>"
        f"<pre>PROMPT: {html.escape(_clip(str(e.get('prompt', ''))))}\n"
        f"EPISODE: {html.escape(_clip(str(e.get('completion', ''))))}</pre>"
        for _, e in rep["episodes"])
    title = f"one run: {rep['runs'][0].name}" if len(rep["runs"]) == 1 else f"{len(rep['runs'])} runs"
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>mixrl report</title>"
            f"<style>{style}</style></head><body><h1>mixrl report: {html.escape(str(dir_))} ({html.escape(title)})</h1>"
            f"<h2>Runs</h2><table><tr>{head}</tr>{body}</table><ul>{helps}</ul>"
            f"<p>Costs are modelled (tokens / profile throughput x list price).</p>" + cells + evals
            + (f"<h2>Sample episodes (prompt, replies with tool calls, reward)</h2>{eps}" if eps else "")
            + (f"<h2>The seed's findings</h2><ul>{finds}</ul>" if finds else "")
            + plag + f"<h2>Figures</h2>{imgs}<h2>Config</h2><pre>{html.escape(_config_text(rep['runs']))}"
            f"</pre></body></html>")


def _finding_html(f: Finding) -> str:
    cls = {"reproduced": "reproduced", "not reproduced": "not"}.get(f.verdict, "inconclusive")  # and "not distinguishable"
    return (f"<li><b>{html.escape(f.title)}: <span class='{cls}'>{html.escape(f.verdict)}"
            f"</span>.</b> {html.escape(f.evidence)}</li>")


def main(args: argparse.Namespace, study: dict[str, Any] | None = None) -> int:
    """``study``: the ``[study]`` table (the collapse monitor's settings, the F3 margin); by
    default the one of the config a study in DIR was started with."""
    dir_ = Path(args.dir)
    if study is None:
        from mixrl.lab.study.settings import saved_config, study_table

        study = study_table(saved_config(dir_))
    if not dir_.is_dir():
        print(f"mixrl report: {dir_} is not a directory", file=sys.stderr)
        return 2
    try:
        rep = build(dir_, args.k, study)
    except FileNotFoundError as e:
        print(f"mixrl report: {e}", file=sys.stderr)
        return 2
    k = rep["k"]
    (dir_ / "report.md").write_text(markdown(dir_, rep, k))
    (dir_ / "report.html").write_text(render_html(dir_, rep, k))
    if rep["study"]:  # the cells as numbers, for tables made from them (scripts/readme_tables.py)
        cells = {"k": rep["study"]["design"]["k"], "cells": rep["study"]["cells"], "regime": rep["study"]["regime"]}
        (dir_ / "cells.json").write_text(json.dumps(cells, indent=1, default=float))
    print(f"wrote {dir_ / 'report.html'} and {dir_ / 'report.md'}")
    if getattr(args, "png", False):
        from mixrl.lab.study.screenshot import screenshot

        print(f"wrote {screenshot(dir_ / 'report.html', dir_ / 'report.png')}")
    for f in rep["findings"]:
        print(f"  {f.title}: {f.verdict}")
    return 0
