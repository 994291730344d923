#!/usr/bin/env python
"""Regenerate the result tables of the README and the documentation pages from docs/artifacts/.

    python scripts/readme_tables.py           # rewrite every file of FILES in place
    python scripts/readme_tables.py --check   # exit 1 if one of them is out of date

Each table sits between ``<!-- table:NAME -->`` and ``<!-- /table:NAME -->`` in
one of ``FILES`` (README.md and the pages under docs/ that hold tables) and is
made only from artifact files (``scripts/record.py`` and ``mixrl bench --save``
write them, with the command and the machine's facts): no figure in those tables
is typed by hand. Links to the artifacts are written relative to the file that
holds the table. The benchmark table shows each benchmark's headline figures as
``mixrl.lab.bench.headlines`` declares them, one row each, and links the full
JSON; the README's ``headlines`` table keeps the figures that have a goal.
Standard library only.
"""

from __future__ import annotations

import json
import posixpath
import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "docs" / "artifacts"
# the files whose tables are rendered and checked, relative to ROOT
FILES = ("README.md", "docs/quickstart.md", "docs/results.md", "docs/guides/data.md", "docs/guides/real_model.md")
sys.path.insert(0, str(ROOT / "src"))

from mixrl.lab.bench import headlines  # noqa: E402 - standard library only, found through src/


def _load(name: str) -> dict | None:
    path = ARTIFACTS / name
    return json.loads(path.read_text()) if path.exists() else None


def _fmt(v: object) -> str:
    if isinstance(v, bool) or v is None:
        return str(v).lower()
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if v != 0 and (abs(v) < 1e-2 or abs(v) >= 1e5):
            return f"{v:.2e}"
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


def _machine(m: dict) -> str:
    flags = "+".join(m.get("cpu_flags") or []) or "no AVX2"
    return f"{m.get('cores')} cores, {flags}, load {m.get('load_avg_1m')}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def table_eval() -> str:
    rows = []
    for name, label in (("eval_bundled.json", "bundled policy"), ("eval_demo.json", "after `mixrl train` (the demo)")):
        art = _load(name)
        if art is None:
            continue
        r = art["result"]
        k = r.get("k", 4)
        digest = str(r.get("weights_sha256") or "")[:12]
        rows.append([label, f"`{art['command']}`", _fmt(r.get("pass@1")), _fmt(r.get(f"pass@{k}")),
                     f"{r.get('n_tasks')} x {r.get('n')}", digest or "-", _machine(art["machine"])])
    return _table(["policy", "command", "pass@1", "pass@k", "tasks x samples", "weights digest", "machine"], rows)


def wilson(p: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson interval of a success rate ``p`` over ``n`` independent trials."""
    centre, half = p + z * z / (2 * n), z * ((p * (1 - p) + z * z / (4 * n)) / n) ** 0.5
    return (centre - half) / (1 + z * z / n), (centre + half) / (1 + z * z / n)


def table_data() -> str:
    """The "Train on your data" example: the base and the trained policy on its held-out rows."""
    rows = []
    for name, label in (("eval_arithmetic_base.json", "bundled policy (base)"),
                        ("eval_arithmetic_final.json", "after `mixrl train examples/arithmetic/config.toml`")):
        art = _load(name)
        if art is None:
            continue
        r = art["result"]
        # One sample per row: the rows are independent trials, so the binomial interval holds.
        lo, hi = wilson(r["pass@1"], r["n_tasks"])
        ci = f"{lo:.3f}-{hi:.3f}" if r.get("n") == 1 else "-"
        rows.append([label, f"`{art['command']}`", _fmt(r.get("pass@1")), ci, f"{r.get('n_tasks')} x {r.get('n')}",
                     str(r.get("weights_sha256") or "-")[:12], _machine(art["machine"])])
    return _table(["policy", "command", "pass@1", "95% interval", "rows x samples", "weights digest", "machine"], rows)


def machine_short(m: dict) -> str:
    """Cores, whether the CPU has AVX-512 (the figures differ by integer factors), load."""
    flags = m.get("cpu_flags") or []
    isa = "AVX-512" if "avx512f" in flags else ("AVX2, no AVX-512" if "avx2" in flags else "no AVX2")
    return f"{m.get('cores')} cores, {isa}, load {m.get('load_avg_1m')}"


_OPS = {">=": "≥", "<=": "≤", "==": "="}


def goal_cell(row: headlines.Row) -> str:
    """The goal (with the figure it names, if any) and the machine's limit beside it."""
    h, parts = row.headline, []
    if h.op is not None and row.goal is not None:
        goal = f"`{h.goal}` {_fmt(row.goal)}" if isinstance(h.goal, str) else _fmt(row.goal)
        parts.append(f"{_OPS[h.op]} {goal}")
    if row.limit is not None:
        times = ""
        if isinstance(row.value, int | float) and isinstance(row.limit, int | float) and row.limit:
            times = f" (value = {row.value / row.limit:.2f}x it)"
        parts.append(f"{h.limit_label} {_fmt(row.limit)}{times}")
    return "; ".join(parts) or "—"


def table_real() -> str:
    """The real pretrained model's example: base and trained on its held-out rows, with the gain."""
    rows, got = [], {}
    for name, label in (("eval_real_base.json", "SmolLM2-135M-Instruct (base)"),
                        ("eval_real_final.json", "after `mixrl train examples/real_model/config.toml`")):
        art = _load(name)
        if art is None:
            continue
        r = art["result"]
        got[name] = r
        lo, hi = wilson(r["pass@1"], r["n_tasks"])
        ci = f"{lo:.3f}-{hi:.3f}" if r.get("n") == 1 else "-"
        rows.append([label, f"`{art['command']}`", _fmt(r.get("pass@1")), ci, f"{r.get('n_tasks')} x {r.get('n')}",
                     str(r.get("weights_sha256") or "-")[:12], _machine(art["machine"])])
    table = _table(["policy", "command", "pass@1", "95% interval", "rows x samples", "weights digest", "machine"],
                   rows)
    if len(got) == 2:
        b, f = got["eval_real_base.json"], got["eval_real_final.json"]
        lo, hi = newcombe(b["pass@1"], b["n_tasks"], f["pass@1"], f["n_tasks"])
        table += (f"\n\nGain {f['pass@1'] - b['pass@1']:+.3f}, 95% interval {lo:+.3f} to {hi:+.3f} "
                  "(Newcombe's hybrid score interval from the two Wilson intervals; "
                  + ("it excludes 0)." if lo > 0 or hi < 0 else "it does **not** exclude 0).")
                  )
    paired = _load("real_model_paired.json")  # the same rows and seed: the gain paired by row
    if paired is not None:
        t, bt = paired["paired_t"], paired["paired_bootstrap"]
        table += (f" Paired by row (`examples/real_model/paired_gain.py`, per-row data in "
                  f"docs/artifacts/real_model_paired.json): {paired['gain']:+.3f}, 95% paired t "
                  f"{t['lo']:+.3f} to {t['hi']:+.3f}, paired bootstrap {bt['lo']:+.3f} to {bt['hi']:+.3f}, "
                  f"McNemar exact p = {paired['mcnemar_exact_p']:.3f}.")
    return table


def table_real_learn() -> str:
    """The real model's 60-update sync run: base and trained held-out pass@1, paired by row."""
    rows = []
    for name, label in (("real_learn/eval_base.json", "SmolLM2-135M-Instruct (base)"),
                        ("real_learn/eval_final.json", "after `mixrl train examples/real_model/learn.toml`")):
        art = _load(name)
        if art is None or "command" not in art:
            continue
        r = art["result"]
        rows.append([label, f"`{art['command']}`", _fmt(r.get("pass@1")), _fmt(r.get("mean_generated")),
                     f"{r.get('n_tasks')} x {r.get('n')}", _machine(art["machine"])])
    table = _table(["policy", "command", "pass@1", "reply tokens", "rows x samples", "machine"], rows)
    paired, train = _load("real_learn/paired.json"), _load("real_learn/train.json")
    if paired is not None:
        t, bt = paired["paired_t"], paired["paired_bootstrap"]
        verdict = "excludes 0" if t["lo"] > 0 or t["hi"] < 0 else "does **not** exclude 0"
        table += (f"\n\nGain {paired['gain']:+.3f}, paired by row (the pre-registered test, "
                  f"docs/artifacts/real_learn/PREREGISTRATION.md): 95% paired t {t['lo']:+.3f} to {t['hi']:+.3f} "
                  f"({verdict}), paired bootstrap {bt['lo']:+.3f} to {bt['hi']:+.3f}.")
    if train is not None:
        table += f" Training: {train['steps']} updates in {train['wall_s']:.0f} s."
    return table


def table_vs_trl_learning() -> str:
    """The same real-model run under mixrl and TRL's GRPOTrainer, held out by the same mixrl eval."""
    sm = _load("real_learn/trl/summary.json")
    if sm is None:
        return "(no artifact: python -m mixrl.lab.bench.vs_trl_learning)"
    p, w, mem = sm["pass@1"], sm["wall_s"], sm["peak_memory_gb"]
    rows = [["mixrl, sync on-policy (`examples/real_model/learn.toml`)", _fmt(p["mixrl"]), f"{w['mixrl']:.0f}",
             "not recorded" if mem["mixrl"] is None else _fmt(mem["mixrl"])],
            [f"TRL {sm['trl_version']} GRPOTrainer, its defaults (loss {sm['trl_defaults'].get('loss_type')})",
             _fmt(p["trl"]), f"{w['trl']:.0f}", _fmt(round(mem["trl"], 2))]]
    table = _table(["trainer", "held-out pass@1", "training s", "peak RSS GB"], rows)
    g = sm["trl_minus_mixrl"]
    t = g["paired_t"]
    return table + (f"\n\nBase model {_fmt(p['base'])}. TRL minus mixrl, paired by row over {sm['rows']} rows x "
                    f"{sm['k']}: {g['gain']:+.3f}, 95% paired t {t['lo']:+.3f} to {t['hi']:+.3f} (one run each, seed 0; "
                    "not pre-registered; the interval covers the held-out rows, not seeds). Held equal and what "
                    "differs: docs/artifacts/real_learn/trl/summary.json.")


def newcombe(p1: float, n1: int, p2: float, n2: int) -> tuple[float, float]:
    """95% interval of ``p2 - p1`` for two independent proportions (Newcombe 1998, method 10)."""
    l1, u1 = wilson(p1, n1)
    l2, u2 = wilson(p2, n2)
    d = p2 - p1
    return d - ((p2 - l2) ** 2 + (u1 - p1) ** 2) ** 0.5, d + ((u2 - p2) ** 2 + (p1 - l1) ** 2) ** 0.5


def table_probe_real() -> str:
    """The probe on the real pretrained model beside the bundled policy's, per profile."""
    real, toy = _load("probe_real.json"), _load("probe.json")
    if real is None or toy is None:
        return ""
    t = toy["result"]["profiles"]
    rows = []
    for name, r in real["result"]["profiles"].items():
        b = t.get(name, {})
        rows.append([name, f"{r.get('weight_format')} / {r.get('kv_format')}",
                     _fmt(r.get("mismatch/kl_exact")), _fmt(b.get("mismatch/kl_exact")),
                     _fmt(r.get("mismatch/tv")), _fmt(b.get("mismatch/tv")),
                     _fmt(r.get("mismatch/ratio_oob")), _fmt(b.get("mismatch/ratio_oob")),
                     _fmt(r.get("max_abs_log_ratio")), str(r.get("tokens"))])
    table = _table(["profile", "weights / KV", "exact KL (real)", "exact KL (toy)", "TV (real)", "TV (toy)",
                    "outside [0.2, 5] (real)", "outside [0.2, 5] (toy)", "max abs log-ratio (real)",
                    "tokens (real)"], rows)
    return (f"Real: `{real['command']}` on {_machine(real['machine'])}; toy: `{toy['command']}` on "
            f"{_machine(toy['machine'])}.\n\n{table}")


def _bench_rows(link: str, with_goal_only: bool = False) -> tuple[list[list[str]], list[str]]:
    rows, commands = [], []
    for path in sorted(ARTIFACTS.glob("bench_*.json")):
        art = json.loads(path.read_text())
        name = path.stem.removeprefix("bench_")
        ref = f"[{name}]({link}{path.name})"
        commands.append(f"- {ref}: `{art['command']}`")
        for r in headlines.rows(name, art["result"]):
            if with_goal_only and (r.headline.op is None or r.goal is None):
                continue
            value = _fmt(r.value)
            if isinstance(r.interval, list) and len(r.interval) >= 2:  # [lo, hi, coverage]
                value += f" [{_fmt(r.interval[0])}, {_fmt(r.interval[1])}]"
            met = "—" if r.met is None else ("yes" if r.met else "**no**")
            rows.append([ref, f"{r.headline.label} (`{r.headline.key}`)", value, goal_cell(r), met,
                         machine_short(art["machine"])])
    return rows, commands


BENCH_HEADER = ["benchmark", "figure", "value", "goal or limit", "met?", "machine"]


def table_bench(link: str = "docs/artifacts/") -> str:
    """One row per headline figure (``mixrl.lab.bench.headlines``), each linking its full JSON."""
    rows, commands = _bench_rows(link)
    table = _table(BENCH_HEADER, rows)
    return table + "\n\nFull results (every figure the command printed, with the machine's facts):\n\n" + "\n".join(commands)


def table_headlines(link: str = "docs/artifacts/") -> str:
    """The benchmark rows that are held to a goal (the README's summary of ``table_bench``)."""
    rows, _ = _bench_rows(link, with_goal_only=True)
    return _table(BENCH_HEADER, rows)


def table_probe() -> str:
    art = _load("probe.json")
    if art is None:
        return ""
    rows = []
    for name, r in art["result"].get("profiles", {}).items():
        rows.append([name, str(r.get("weight_format")), str(r.get("kv_format")),
                     _fmt(r.get("mismatch/kl_exact")), _fmt(r.get("mismatch/kl_k3")), _fmt(r.get("mismatch/tv")),
                     _fmt(r.get("mismatch/ratio_oob")), _fmt(r.get("max_abs_log_ratio"))])
    for name, why in (art["result"].get("skipped") or {}).items():
        rows.append([name, "skipped", why, "", "", "", "", ""])
    table = _table(["profile", "weights", "KV", "exact KL", "k3", "TV", "outside [0.2, 5]", "max abs log-ratio"], rows)
    return f"`{art['command']}` on {_machine(art['machine'])}:\n\n{table}"


def table_make_run() -> str:
    art = _load("make_run.json")
    if art is None:
        return ""
    r = art["result"]
    row = [f"{r['environment_s']:.0f} s", f"{r['train_s']:.0f} s", f"{r['total_min']:.1f} min",
           f"{_machine(art['machine'])} (at the start)", str(r["commit"])[:10]]
    return _table(["environment (`scripts/bootstrap.sh`)", "`mixrl train`", "total", "machine", "commit"], [row])


def _iv(d: dict | None) -> str:
    return "–" if not d else f"{d['estimate']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]"


def _study(name: str) -> str:
    """A study's cells and effects from ``docs/artifacts/<name>/`` (cells.json and design.json,
    which ``mixrl compare --recompute`` writes from the committed per-run data)."""
    cells, design = _load(f"{name}/cells.json"), _load(f"{name}/design.json")
    if cells is None or design is None:
        return ""
    k = cells["k"]

    def est(v: object) -> str:
        if isinstance(v, dict):
            return f"{v['estimate']:.3f} [{v['lo']:.3f}, {v['hi']:.3f}]"
        return "–" if isinstance(v, float) and v != v else _fmt(v)  # NaN: not measured in this cell

    rows = [[f"`{c['cell']}`", str(c["seeds"])] + [est(c[key]) for key in (
             f"pass@{k}", "reward_fp32", "precision_kl", "precision_oob", "lag_kl", "staleness")] + [c["collapsed"]]
            for c in cells["cells"]]
    out = [_table(["cell", "seeds", f"pass@{k} [95% t over seeds]", "FP32-sampler reward", "precision KL",
                   "precision outside [0.2, 5]", "lag KL", "staleness", "collapsed"], rows), ""]
    eff_rows = []
    for fleet, v in design["fleets"].items():
        for eff, e in v["effects"].items():
            e = e or {}
            eff_rows.append([fleet, eff, _iv(e.get("t")), _iv(e.get("boot")), e.get("verdict", "inconclusive")])
    out += [_table(["fleet", "effect", f"pass@{k}: paired t over seeds", "paired bootstrap over seeds x tasks",
                    "verdict"], eff_rows), ""]
    hp = design.get("holm", {}).get("p_holm", {})

    def p(x: object) -> str:
        return "–" if not isinstance(x, float) or x != x else f"{x:.3g}"

    for fleet, v in design["fleets"].items():
        f4 = v["F4"]
        out.append(f"- {fleet}: F1 (uncorrected GRPO hurt by precision alone) **{v['F1']}** (Holm p "
                   f"{p(hp.get(f'{fleet}: F1'))}); F2 (the correction beats GRPO, precision alone) **{v['F2']}** "
                   f"(Holm p {p(hp.get(f'{fleet}: F2'))}); F4 (out-of-range rate follows precision KL, trend test "
                   f"on token counts) **{f4['verdict']}**; collapsed: "
                   + ", ".join(f"{c} {n}" for c, n in sorted(v["collapsed"].items())))
    if design["F3"]["verdict"] != "not run":
        out.append(f"- F3 (mixed not worse than homogeneous by more than {design['F3']['margin']}, one-sided): "
                   f"**{design['F3']['verdict']}** (Holm p {p(design['F3'].get('p_holm'))})")
    corrected = design.get("corrected", "sc+mis+top-p")
    out.append(f"\nFrom `docs/artifacts/{name}/` (`mixrl compare --recompute docs/artifacts/{name}`); G = `grpo`, "
               f"C = `{corrected}`; primary outcome held-out pass@{k}; precision = sync cell − on-policy, "
               "lag = async − sync; F1–F3 are the pre-registered tests (paired t over seeds, Holm over F1–F3 at "
               f"α = {design.get('alpha', 0.05)}); the other effects are exploratory and count when both intervals "
               "exclude 0; collapsed = monitor, FP32-sampler or held-out drop (`src/mixrl/lab/study/outcome.py`); KL and "
               "out-of-range share over staleness-0 tokens (precision) or stale tokens (lag).")
    return "\n".join(out)


def table_ablation() -> str:
    """The correction ablation (docs/artifacts/ablation/ablation.json, ``mixrl compare --ablation``)."""
    res = _load("ablation/ablation.json")
    if res is None:
        return ""
    fleets = list(res["fleets"])
    head = ["arm"] + [h for f in fleets for h in (f"{f}: pass@1", "− grpo [95% paired t]", "in the nucleus")]
    rows = []
    for arm in res["fleets"][fleets[0]]["arms"]:
        row = [f"`{arm}`"]
        for f in fleets:
            a = res["fleets"][f]["arms"].get(arm, {})
            e = (a.get("vs grpo") or {}).get("t")
            nuc = res["fleets"][f].get("scored_in_nucleus", {}).get(arm, {})
            row += [f"{a['pass@1']:.3f}" if a else "–", _iv(e) if e else "–",
                    f"{nuc['pass@1']:.3f}" if nuc else "–"]
        rows.append(row)
    return (_table(head, rows) + "\n\nFrom `docs/artifacts/ablation/` (`mixrl compare --ablation "
            "docs/artifacts/ablation`): 5 seeds x 80 updates per cell, sync, held-out pass@1 on 48 tasks x 16 "
            "samples on the full distribution; \"in the nucleus\": the same final policies scored with top-p 0.9.")


def table_gpu(link: str = "docs/artifacts/") -> str:
    """The device check's steps (docs/artifacts/gpu_steps.json, ``scripts/gpu_check.sh --out``)."""
    art = _load("gpu_steps.json")
    if art is None:
        return "(no docs/artifacts/gpu_steps.json yet: `scripts/gpu_check.sh --out docs/artifacts/gpu_steps.json`)"
    m, st = art["machine"], art["steps"]
    where = (f"on {m.get('gpu')} ({m.get('memory_gib')} GiB), torch {m.get('torch')}" if art["mode"] == "gpu" else
             f"**CPU mode** (`--cpu`): no GPU ran these figures; {m.get('cpu')}, {machine_short(m)}, torch {m.get('torch')}")
    cells: dict[str, str] = {}
    if "model" in st.get("setup", {}):
        cells["setup"] = f"model `{st['setup']['model']}`, train config: {st['setup']['config']}"
    if "collected" in st.get("tests", {}):
        t = st["tests"]
        cells["tests"] = f"`pytest -m gpu`: {t['passed']} passed, {t['skipped']} skipped, {t['failed']} failed"
    if "groups" in st.get("train", {}):
        t = st["train"]
        groups = "; ".join(f"`{g['profile']}` KL k3 {_fmt(g['kl_k3'])}, TV {_fmt(g['tv'])}, "
                           f"outside [0.2, 5] {_fmt(g['ratio_oob'])} ({_fmt(int(g['tokens']))} tokens)"
                           for g in t["groups"].values())
        cells["train"] = (f"{t['updates']} updates, resumed at {t['resumed_at']}, trainer {t['trainer_precision']} on "
                          f"{t['trainer_device']}: {groups}; reward {_fmt(t['reward_mean'])}")
    if "profiles" in st.get("probe", {}):
        p = st["probe"]
        kl = ", ".join(f"`{n}` {_fmt(r['kl_exact'])}" for n, r in p["profiles"].items())
        cells["probe"] = (f"exact KL on {p['builtin_device']}: {kl}; real over emulated FP8 "
                          f"{_fmt(p.get('real_over_emulated'))}")
    if "builtin_tok_s" in st.get("bench", {}):
        b = st["bench"]
        cells["bench"] = (f"built-in {_fmt(b['builtin_tok_s'])} tokens/s on {b['device']}, "
                          f"{_fmt(b['builtin_over_hf'])}x HF generate (batch {b['batch']}, {b['new_tokens']} new)")
    rows = [[name, row["status"], _fmt(row.get("seconds")), cells.get(name, row.get("reason", "—"))]
            for name, row in st.items()]
    head = (f"`{art['command']}`, {art['started_utc']}, {where}; {_fmt(art['seconds'])} s in all "
            f"([JSON]({link}gpu_steps.json)).")
    return head + "\n\n" + _table(["step", "status", "s", "figures"], rows)


TABLES: dict[str, Callable[[], str]] = {"eval": table_eval, "data": table_data, "bench": table_bench,
                                        "headlines": table_headlines,
                                        "probe": table_probe, "make_run": table_make_run, "real": table_real, "real_learn": table_real_learn, "vs_trl_learning": table_vs_trl_learning,
                                        "probe_real": table_probe_real, "study": lambda: _study("study"),
                                        "study_real": lambda: _study("study_real"), "ablation": table_ablation,
                                        "study_prereg": lambda: _study("study_prereg"), "gpu": table_gpu}
LINKED = {"bench": table_bench, "headlines": table_headlines, "gpu": table_gpu}  # tables that link the artifacts


def artifacts_link(file: str) -> str:
    """The relative link prefix of docs/artifacts/ from ``file`` (relative to ROOT)."""
    return posixpath.relpath("docs/artifacts", posixpath.dirname(file) or ".") + "/"


def render(text: str, file: str = "README.md") -> str:
    """``text`` (the contents of ``file``) with every table regenerated."""
    def repl(m: re.Match) -> str:
        name = m.group(1)
        if name not in TABLES:
            raise SystemExit(f"readme_tables: unknown table {name!r} in {file} (known: {', '.join(TABLES)})")
        body = LINKED[name](artifacts_link(file)) if name in LINKED else TABLES[name]()
        return f"<!-- table:{name} -->\n{body}\n<!-- /table:{name} -->"

    return re.sub(r"<!-- table:(\w+) -->.*?<!-- /table:\1 -->", repl, text, flags=re.S)


def main(argv: list[str]) -> int:
    stale = []
    for name in FILES:
        path = ROOT / name
        old = path.read_text()
        new = render(old, name)
        if new != old:
            stale.append(name)
            if "--check" not in argv:
                path.write_text(new)
    if "--check" in argv and stale:
        print(f"tables out of date in {', '.join(stale)}: run python scripts/readme_tables.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
