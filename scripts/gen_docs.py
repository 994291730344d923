#!/usr/bin/env python
"""Generate the documentation site's reference pages from the code, the docs and the artifacts.

    mkdocs build --strict            # mkdocs.yml runs this file as a hook: every build regenerates
    python scripts/gen_docs.py OUT   # write the generated pages under OUT, to read them

Nothing generated is committed, so nothing drifts:

- the configuration reference, one page per section, from the pydantic models
  (``mixrl.config``, ``mixrl.sampling.profiles.Profile``): every field with its
  type, default, bounds and description, nested models and each variant of a
  discriminated union included (``config_fields`` lists them; a test compares
  that list with the models');
- the CLI reference from the argparse parsers (``mixrl.commands.main.COMMANDS`` and the
  benchmarks of ``mixrl.lab.bench.cli.BENCHES``);
- the API reference: one mkdocstrings page per module of ``API_MODULES``;
- the precision page from ``src/mixrl/sampling/profiles.toml`` and the probe's artifact
  (its table by scripts/readme_tables.py);
- the metrics and guard-rail pages cut from docs/corrections.md by heading.

The hand-written pages (every other ``docs/**/*.md``: the home page, the quickstart,
the guides, the concepts, the results) are source files, used as they are;
scripts/readme_tables.py renders the result tables they hold.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import posixpath
import re
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "scripts")]

# imported now: mkdocs restores sys.path once this hook file is loaded
import readme_tables  # noqa: E402
from pydantic import BaseModel  # noqa: E402
from pydantic.fields import FieldInfo  # noqa: E402

import mixrl  # noqa: E402, F401

# modules whose public symbols the API reference documents (each must have docstrings)
API_MODULES = (
    "mixrl.corrections.loss", "mixrl.corrections.ratios", "mixrl.corrections.behaviour",
    "mixrl.corrections.centering", "mixrl.corrections.objectives", "mixrl.corrections.aggregation",
    "mixrl.corrections.advantages", "mixrl.corrections.metrics", "mixrl.corrections.replay",
    "mixrl.corrections.regularizers", "mixrl.corrections.types",
    "mixrl.config.schema", "mixrl.config.io", "mixrl.config.loss", "mixrl.config.presets",
    "mixrl.envs.base", "mixrl.envs.rewards", "mixrl.sampling.base", "mixrl.sampling.profiles",
    "mixrl.records.trajectory", "mixrl.runtime.run", "mixrl.lab.bench.headlines",
)

# ----------------------------------------------------------------- configuration reference


@dataclass(frozen=True)
class FieldDoc:
    """One configuration field as the reference shows it."""

    path: str  # dotted TOML path; list items as [], union variants as [type=NAME]
    type: str
    default: str
    bounds: str
    description: str


def _type_name(t: Any) -> str:
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(_type_name(a) for a in args)}]"
    if t is type(None):
        return "None"
    if t is Any:
        return "Any"
    return getattr(t, "__name__", str(t))


def _is_list(t: Any) -> bool:
    """``list[...]``, also inside Optional or Annotated."""
    return typing.get_origin(t) is list or any(_is_list(a) for a in typing.get_args(t)
                                               if typing.get_origin(t) is not dict)


def _models(t: Any) -> list[type[BaseModel]]:
    """The pydantic models inside an annotation (through Optional, list, unions)."""
    origin, args = typing.get_origin(t), typing.get_args(t)
    if isinstance(t, type) and issubclass(t, BaseModel):
        return [t]
    if origin is dict:
        return []
    return [m for a in args for m in _models(a)]


def _value(v: Any) -> str:
    if isinstance(v, BaseModel):
        return json.dumps(v.model_dump(mode="json", exclude_defaults=True)) if v.model_fields_set else "{}"
    if isinstance(v, list) and v and isinstance(v[0], BaseModel):
        return json.dumps([x.model_dump(mode="json", exclude_defaults=True) for x in v])
    if v is None:
        return "None"
    return json.dumps(v, ensure_ascii=False) if isinstance(v, str | bool | int | float | list | dict) else str(v)


def _default(f: FieldInfo) -> str:
    if f.is_required():
        return "required"
    if f.default_factory is not None:
        return _value(f.default_factory())  # type: ignore[call-arg]
    return _value(f.default)


def _num(x: Any) -> str:
    if isinstance(x, int) and x > 4096 and (x & (x - 1)) == 0:
        return f"2^{x.bit_length() - 1}"
    if isinstance(x, int) and x > 4096 and ((x + 1) & x) == 0:
        return f"2^{(x + 1).bit_length() - 1} - 1"
    return str(x)


def _bounds(f: FieldInfo) -> str:
    names = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}
    out = []
    for m in f.metadata:
        for attr, sym in names.items():
            if getattr(m, attr, None) is not None:
                out.append(f"{sym} {_num(getattr(m, attr))}")
        if getattr(m, "min_length", None) is not None:
            out.append(f"length ≥ {m.min_length}")
        if getattr(m, "max_length", None) is not None:
            out.append(f"length ≤ {m.max_length}")
        if getattr(m, "pattern", None) is not None:
            out.append(f"pattern `{m.pattern}`")
    return ", ".join(out)


def model_fields(model: type[BaseModel], prefix: str) -> list[FieldDoc]:
    """Every field of ``model`` under ``prefix``, nested models and union variants included."""
    out = []
    for name, f in model.model_fields.items():
        path = f"{prefix}.{name}" if prefix else name
        out.append(FieldDoc(path, _type_name(f.annotation), _default(f), _bounds(f),
                            " ".join((f.description or "").split())))
        subs = _models(f.annotation)
        listed = _is_list(f.annotation)
        for sub in subs:
            tag = sub.model_fields.get("type")
            variant = f"[type={tag.default}]" if len(subs) > 1 and tag is not None else ""
            out += model_fields(sub, path + ("[]" if listed else "") + variant)
    return out


def config_sections() -> dict[str, tuple[str, list[tuple[str, type[BaseModel], str]]]]:
    """Page name -> (title, [(heading, model, prefix)]), one page per section of RunConfig."""
    from mixrl.config import RunConfig
    from mixrl.config.loss import LossConfig
    from mixrl.sampling.profiles import Profile

    pages = {}
    for name, f in RunConfig.model_fields.items():
        model = _models(f.annotation)[0]
        parts = [(f"[{name}]", model, name)]
        if name == "loss":
            parts.append(("loss.overrides: the LossConfig fields a preset sets", LossConfig, "loss.overrides"))
        if name == "fleet":
            parts.append(("[profiles.NAME]: precision profiles (a user TOML, or fleet.groups[].overrides)",
                          Profile, "profiles.NAME"))
        pages[name] = (f"[{name}]", parts)
    return pages


def config_fields() -> list[FieldDoc]:
    """Every field the configuration reference documents."""
    return [fd for _, parts in config_sections().values() for _, model, prefix in parts
            for fd in model_fields(model, prefix)]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _path_cell(path: str) -> str:
    """A field path as code that may wrap only after a dot and before a bracket (``<wbr>``), so
    long paths fit a narrow column without breaking a name; copying it gives the path unchanged."""
    escaped = path.replace("&", "&amp;").replace("<", "&lt;")
    return "<code>" + re.sub(r"(?<=\.)|(?=\[)", "<wbr>", escaped).removeprefix("<wbr>") + "</code>"


def config_page(name: str) -> str:
    title, parts = config_sections()[name]
    lines = [f"# `{title}`", ""]
    for i, (heading, model, prefix) in enumerate(parts):
        doc = " ".join((model.__doc__ or "").split())
        lines += ([f"## {heading}", ""] if i else []) + [doc, "", "| field | type | default | bounds | description |",
                                                         "|---|---|---|---|---|"]
        for fd in model_fields(model, prefix):
            what = fd.description or ("selects this variant" if fd.path.endswith("].type") else "—")
            # a pipe inside a code span is not a cell border (Python-Markdown); elsewhere it is escaped
            lines.append(f"| {_path_cell(fd.path)} | `{fd.type}` | `{fd.default}` | {_cell(fd.bounds) or '—'} | "
                         f"{_cell(what)} |")
        lines.append("")
    if name == "loss":
        from mixrl.config.presets import PRESETS

        lines += ["## Presets", "", "`loss.preset` takes one of: " + ", ".join(f"`{p}`" for p in PRESETS) + ".", ""]
    return "\n".join(lines)


def config_index() -> str:
    lines = ["# Configuration reference", "",
             "A run is a TOML file plus `--set key.path=value` overrides (`mixrl train CONFIG.toml --set "
             "optim.lr=1e-4`). Unknown keys are errors; an invalid value exits with status 2 naming the field "
             "path; `mixrl train --dry-run` prints the resolved configuration. These pages are generated from "
             "the pydantic models, so every field is here with its type, default, bounds and description. "
             "Lists of tables are written `[]`, and the variants of a field that takes one of several tables "
             "`[type=NAME]` (the `type` key selects the variant).", "",
             "| section | what it configures |", "|---|---|"]
    for name, (title, parts) in config_sections().items():
        doc = " ".join((parts[0][1].__doc__ or "").split())
        lines.append(f"| [`{title}`]({name}.md) | {doc} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------- CLI reference


def _help(prog: str, description: str, configure: Any) -> str:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    configure(parser)
    return parser.format_help()


def _rst(text: str) -> str:
    """A module docstring as Markdown: ``x`` is already valid code; indented blocks become code blocks."""
    out, block = [], False
    for line in text.strip().splitlines():
        if line.startswith("    ") and not block:
            out += ["```text"]
            block = True
        elif block and line and not line.startswith("    "):
            out += ["```"]
            block = False
        out.append(line[4:] if block else line)
    return "\n".join(out + (["```"] if block else []))


def cli_page() -> str:
    from mixrl.commands.main import COMMANDS
    from mixrl.lab.bench.cli import BENCHES

    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal width: fix it
    try:
        lines = ["# Command-line reference", "",
                 "Generated from the argparse parsers of `mixrl` (each command's `--help`).", ""]
        for name, (module, help_) in COMMANDS.items():
            mod = importlib.import_module(module)
            lines += [f"## `mixrl {name}`", "", help_ + ".", "", "```text",
                      _help(f"mixrl {name}", help_, mod.configure).rstrip(), "```", ""]
            if name == "bench":
                for bname, (bmod, bhelp) in BENCHES.items():
                    m = importlib.import_module(bmod)
                    lines += [f"### `mixrl bench {bname}`", "", _rst(m.__doc__ or bhelp), "", "```text",
                              _help(f"mixrl bench {bname}", bhelp, m.configure).rstrip(), "```", ""]
        return "\n".join(lines)
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old


# ------------------------------------------------------------- pages cut from docs


def section(text: str, title: str, level: int = 2) -> str:
    """The body of the heading ``title`` (its own heading excluded) up to the next heading of its level."""
    lines, out, inside, fence = text.splitlines(), [], False, False
    mark = "#" * level + " "
    for line in lines:
        if line.startswith("```"):
            fence = not fence
        is_head = not fence and re.match(rf"#{{1,{level}}} ", line) is not None
        if inside and is_head:
            break
        if inside:
            out.append(line)
        if not fence and line.startswith(mark) and line[len(mark):].strip() == title:
            inside = True
    if not inside:
        raise SystemExit(f"gen_docs: no heading {mark}{title!r} found")
    return "\n".join(out).strip() + "\n"


def relink(text: str, page: str, source_dir: str = "") -> str:
    """Rewrite relative links of a text from ``source_dir`` (repo-relative) for a site page at ``page``.

    Targets inside docs/ become site-relative links; other repository files
    (src/, examples/) have no page: the link text stays, as code."""
    page_dir = posixpath.dirname(page)

    def repl(m: re.Match) -> str:
        label, target = m.group(1), m.group(2)
        if re.match(r"[a-z]+:|#", target):
            return m.group(0)
        path = posixpath.normpath(posixpath.join(source_dir, target))
        if path.startswith("docs/"):
            return f"[{label}]({posixpath.relpath(path[5:], page_dir or '.')})"
        return label if label.startswith("`") else f"`{label}`"

    return re.sub(r"(?<!!)\[([^\]]+)\]\(([^)\s]+)\)", repl, text)


def _promote(text: str) -> str:
    out, fence = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
        out.append(line[1:] if not fence and line.startswith("##") else line)
    return "\n".join(out) + "\n"


def precision_page() -> str:
    import tomllib

    profiles = tomllib.loads((ROOT / "src/mixrl/sampling/profiles.toml").read_text())["profiles"]
    rows = [f"| `{n}` | {p.get('engine', 'builtin')} | {p.get('weight_format', 'none')} | "
            f"{p.get('kv_format', 'none')} | {p.get('compute_dtype', 'bfloat16')} | {p.get('accelerator')} | "
            f"{p.get('price_per_hour')} |" for n, p in profiles.items()]
    probe = readme_tables.table_probe()
    return "\n".join([
        "# Precision profiles and the probe", "",
        "Each sampler group runs one precision profile: the format its weights are quantized to on load, "
        "its KV cache's format, the dtype its matmuls run in, its engine, and the price and throughput "
        "the router and the cost model use. The catalogue below is `src/mixrl/sampling/profiles.toml`; "
        "a TOML of yours with the same layout merges over it (fields: "
        "[configuration reference](../reference/config/fleet.md)).", "",
        "| profile | engine | weights | KV cache | compute | accelerator | USD/hour |", "|---|---|---|---|---|---|---|",
        *rows, "",
        "## What each profile costs in mismatch: `mixrl probe`", "",
        "`mixrl probe` samples the same prompts with each profile's sampler and scores exactly those tokens "
        "with the FP32 trainer, so the figures are the cost of the profile's numerics alone "
        "([measurements](../measurements.md)). The committed run:", "",
        probe.replace("](docs/", "](../"), "",
        "In a training run the same split is recorded per group and step as `precision/*` (staleness-0 "
        "tokens) and `lag/*` (stale tokens); `mixrl report` plots both ([metrics](../concepts/metrics.md)).",
    ]) + "\n"


def corrections_page(page: str, title: str, heading: str, after: str = "") -> str:
    text = (ROOT / "docs/corrections.md").read_text()
    body = relink(_promote(section(text, heading)), page, "docs")
    return f"# {title}\n\nFrom [the corrections reference](../corrections.md).\n\n" + body + after


def api_pages() -> dict[str, str]:
    pages = {"reference/api/index.md": "# API reference\n\nThe modules a user program calls or extends:\n\n"
             + "\n".join(f"- [`{m}`]({m}.md): " + (importlib.import_module(m).__doc__ or "").strip().splitlines()[0]
                         for m in API_MODULES) + "\n"}
    for m in API_MODULES:
        pages[f"reference/api/{m}.md"] = f"# `{m}`\n\n::: {m}\n"
    return pages


PRECISION_LAG_EXAMPLE = """
`mixrl report RUN_DIR` plots the precision and lag KL of every sampler group over the updates
(`figures/precision_lag.png`, embedded in `report.html`). The demo, 12 async updates
(`mixrl train --set runtime.steps=12 --no-eval`, then `mixrl report`): staleness-0 tokens are
rare in an async run, so the precision line has few points, and lag dominates the plain
`mismatch/` values.

![precision vs lag KL per group, the demo](../figures/demo_precision_lag.png)
"""


def _paragraph(text: str, start: str) -> str:
    """The paragraph of ``text`` that begins with ``start``."""
    return next(p for p in text.split("\n\n") if p.startswith(start)).strip() + "\n"


def pages() -> dict[str, str]:
    """Every generated page: site path -> Markdown."""
    quickstart = (ROOT / "docs/quickstart.md").read_text()
    out = {
        "guides/precision.md": precision_page(),
        "concepts/metrics.md": corrections_page(
            "concepts/metrics.md", "Metrics reference", "10. Metrics",
            "\n## Where they are written\n\n" + relink(_paragraph(quickstart, "A run directory holds"),
                                                     "concepts/metrics.md", "docs") + PRECISION_LAG_EXAMPLE),
        "concepts/guard-rails.md": corrections_page("concepts/guard-rails.md", "Guard rails", "12. Guard rails"),
        "reference/config/index.md": config_index(),
        "reference/cli.md": cli_page(),
        **{f"reference/config/{name}.md": config_page(name) for name in config_sections()},
        **api_pages(),
    }
    clash = [p for p in out if (ROOT / "docs" / p).exists()]
    if clash:
        raise SystemExit(f"gen_docs: generated pages also exist as files under docs/: {clash}")
    return out


def on_files(files: Any, config: Any) -> Any:
    """mkdocs hook: add the generated pages to the site's files."""
    from mkdocs.structure.files import File

    for path, text in pages().items():
        files.append(File.generated(config, path, content=text))
    return files


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    out = Path(argv[0])
    for path, text in pages().items():
        (out / path).parent.mkdir(parents=True, exist_ok=True)
        (out / path).write_text(text)
    print(f"wrote the generated pages under {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
