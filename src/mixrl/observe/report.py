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
from pathlib import Path
from typing import Any

from mixrl.observe.findings import Finding, judge, summarize
from mixrl.observe.plots import plot_curves, plot_groups, plot_passk_cost
from mixrl.observe.runs import Run, load_runs

COLUMNS = ("run", "steps", "reward_first", "reward_final", "pass@1", "pass@4", "kl_growth",
           "ratio_oob", "format_error_end", "collapse_flags", "cost")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, help="a run directory or a compare directory")
    parser.add_argument("--k", type=int, default=4, help="k of the pass@k shown (default 4)")


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "–"
        return f"{v:.4g}" if abs(v) < 1e-2 and v != 0 else f"{v:.3f}"
    return str(v)


def build(dir_: Path, k: int = 4) -> dict[str, Any]:
    runs = load_runs(dir_)
    figs_dir = dir_ / "figures"
    figs_dir.mkdir(exist_ok=True)
    figures = [plot_curves(runs, figs_dir)]
    focus = _focus(runs)
    if focus is not None and (g := plot_groups(focus, figs_dir)) is not None:
        figures.append(g)
    figures.append(plot_passk_cost(runs, figs_dir, k))
    rows = [summarize(r, k) for r in runs]
    findings = judge(runs, k) if len(runs) > 1 else []
    return {"runs": runs, "rows": rows, "findings": findings, "figures": figures}


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
    cols = [c if c != "pass@4" else f"pass@{k}" for c in COLUMNS]
    lines = [f"# mixrl report: `{dir_}`", "", "## Runs", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in rep["rows"]:
        lines.append("| " + " | ".join(_fmt(row.get(c, "")) for c in cols) + " |")
    lines += ["", "Costs are modelled: tokens generated / profile throughput x profile price "
              "(list prices by default). KL growth = mean KL over the last 10 steps / steps 11-20 "
              "(exact KL where the support is recorded, else k3).", ""]
    if rep["findings"]:
        lines += ["## The seed's findings", ""]
        for f in rep["findings"]:
            lines.append(f"- **{f.title}: {f.verdict}.** {f.evidence}")
        lines.append("")
    lines += ["## Figures", ""]
    lines += [f"![{p.stem}](figures/{p.name})" for p in rep["figures"]]
    lines += ["", "## Config (first run)", "", "```json", _config_text(rep["runs"]), "```", ""]
    return "\n".join(lines)


def render_html(dir_: Path, rep: dict[str, Any], k: int) -> str:
    cols = [c if c != "pass@4" else f"pass@{k}" for c in COLUMNS]
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_fmt(r.get(c, '')))}</td>" for c in cols) + "</tr>"
        for r in rep["rows"])
    finds = "".join(_finding_html(f) for f in rep["findings"])
    imgs = "".join(
        f'<figure><img alt="{p.stem}" src="data:image/png;base64,'
        f'{base64.b64encode(p.read_bytes()).decode()}"/><figcaption>{p.stem}</figcaption></figure>'
        for p in rep["figures"])
    style = ("body{font-family:sans-serif;max-width:1400px;margin:auto;padding:1em}"
             "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 8px}"
             "img{max-width:100%}.reproduced{color:#070}.not{color:#a00}.inconclusive{color:#a60}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>mixrl report</title>"
            f"<style>{style}</style></head><body><h1>mixrl report: {html.escape(str(dir_))}</h1>"
            f"<h2>Runs</h2><table><tr>{head}</tr>{body}</table>"
            f"<p>Costs are modelled (tokens / profile throughput x list price).</p>"
            + (f"<h2>The seed's findings</h2><ul>{finds}</ul>" if finds else "")
            + f"<h2>Figures</h2>{imgs}<h2>Config</h2><pre>{html.escape(_config_text(rep['runs']))}"
            f"</pre></body></html>")


def _finding_html(f: Finding) -> str:
    cls = {"reproduced": "reproduced", "not reproduced": "not"}.get(f.verdict, "inconclusive")
    return (f"<li><b>{html.escape(f.title)}: <span class='{cls}'>{html.escape(f.verdict)}"
            f"</span>.</b> {html.escape(f.evidence)}</li>")


def main(args: argparse.Namespace) -> int:
    dir_ = Path(args.dir)
    if not dir_.is_dir():
        print(f"mixrl report: {dir_} is not a directory")
        return 2
    rep = build(dir_, args.k)
    (dir_ / "report.md").write_text(markdown(dir_, rep, args.k))
    (dir_ / "report.html").write_text(render_html(dir_, rep, args.k))
    print(f"wrote {dir_ / 'report.html'} and {dir_ / 'report.md'}")
    for f in rep["findings"]:
        print(f"  {f.title}: {f.verdict}")
    return 0
