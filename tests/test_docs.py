"""The documentation site: generated references cover the code, and the site builds strictly.

``scripts/gen_docs.py`` generates the configuration, CLI and API references on
every ``mkdocs build``; these tests hold it to the code it documents.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import re
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gen_docs"] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def pages(gen) -> dict[str, str]:
    return gen.pages()


def _leaf_models(annotation) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in typing.get_args(annotation) for m in _leaf_models(a)]


def _expected(model: type[BaseModel], prefix: str) -> set[str]:
    """Every field path of ``model``, written independently of the generator's walk."""
    out = set()
    for name, f in model.model_fields.items():
        path = f"{prefix}.{name}"
        out.add(path)
        subs = _leaf_models(f.annotation)
        in_list = typing.get_origin(f.annotation) is list or any(
            typing.get_origin(a) is list for a in typing.get_args(f.annotation))
        for sub in subs:
            tag = f"[type={sub.model_fields['type'].default}]" if len(subs) > 1 else ""
            out |= _expected(sub, path + ("[]" if in_list else "") + tag)
    return out


def _documented(pages: dict[str, str]) -> dict[str, list[str]]:
    """Field path -> the table row's cells, read back from the generated configuration pages."""
    rows = {}
    for name, text in pages.items():
        if name.startswith("reference/config/") and name != "reference/config/index.md":
            for line in text.splitlines():
                m = re.match(r"\| <code>(.+?)</code> \| (.*) \|$", line)
                if m:
                    path = m.group(1).replace("<wbr>", "").replace("&lt;", "<").replace("&amp;", "&")
                    rows[path] = _cells(m.group(2))
    return rows


def _cells(text: str) -> list[str]:
    """Split a table row's cells on `` | ``, not inside code spans (as Python-Markdown does)."""
    cells, cur, code, i = [], "", False, 0
    while i < len(text):
        if not code and text.startswith(" | ", i):
            cells.append(cur)
            cur, i = "", i + 3
            continue
        code ^= text[i] == "`"
        cur += text[i]
        i += 1
    return [c.strip() for c in [*cells, cur]]


def test_configuration_reference_covers_every_field(gen, pages) -> None:
    from mixrl.config import RunConfig
    from mixrl.config.loss import LossConfig
    from mixrl.sampling.profiles import Profile

    expected = set()
    for name, f in RunConfig.model_fields.items():
        expected |= _expected(_leaf_models(f.annotation)[0], name)
    expected |= _expected(LossConfig, "loss.overrides") | _expected(Profile, "profiles.NAME")
    documented = _documented(pages)
    assert not expected - set(documented), f"undocumented: {sorted(expected - set(documented))}"
    assert not set(documented) - expected, f"documented but not a field: {sorted(set(documented) - expected)}"
    assert len(expected) > 150  # the whole tree, not one section
    assert [fd.path for fd in gen.config_fields()] == list(documented)  # the generator's own list, in page order


def test_each_field_row_states_type_default_bounds_description(pages) -> None:
    from mixrl.config import RolloutConfig

    rows = _documented(pages)
    for path, cells in rows.items():
        assert len(cells) == 4 and all(c.strip() for c in cells), path
    f = RolloutConfig.model_fields["group_size"]
    assert rows["rollout.group_size"] == ["`int`", f"`{f.default}`", "≥ 2, ≤ 1024", f.description]
    assert rows["rollout.top_p"][:3] == ["`float | None`", "`None`", "> 0, ≤ 1"]
    assert rows["fleet.groups[].name"][1] == "`required`"
    assert rows["fleet.autoscaler[type=inflight].target"][2] == "> 0, ≤ 2^16"


def test_field_paths_wrap_only_between_names(gen) -> None:
    """The path column may wrap after a dot and before a bracket, never inside a name (1280 px windows)."""
    assert gen._path_cell("fleet.autoscaler[type=inflight].target") == (
        "<code>fleet.<wbr>autoscaler<wbr>[type=inflight].<wbr>target</code>")
    assert gen._path_cell("seed") == "<code>seed</code>" and gen._path_cell("a[]") == "<code>a<wbr>[]</code>"


def test_every_config_section_has_its_page_and_index_row(pages) -> None:
    from mixrl.config import RunConfig

    for name in RunConfig.model_fields:
        assert f"reference/config/{name}.md" in pages
        assert f"]({name}.md)" in pages["reference/config/index.md"]


def test_cli_reference_lists_every_command_and_option(pages) -> None:
    from mixrl.commands.main import COMMANDS
    from mixrl.lab.bench.cli import BENCHES

    text = pages["reference/cli.md"]
    parsers = [(f"mixrl {n}", m) for n, (m, _) in COMMANDS.items()]
    parsers += [(f"mixrl bench {n}", m) for n, (m, _) in BENCHES.items()]
    for prog, module in parsers:
        assert f"## `{prog}`" in text, prog
        parser = argparse.ArgumentParser(prog=prog)
        importlib.import_module(module).configure(parser)
        for action in parser._actions:
            for opt in action.option_strings:
                if action.help != argparse.SUPPRESS:
                    assert opt in text, f"{prog} {opt}"


def _public_symbols(module_name: str):
    mod = importlib.import_module(module_name)
    for name, obj in vars(mod).items():
        if name.startswith("_") or getattr(obj, "__module__", None) != module_name:
            continue
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        yield f"{module_name}.{name}", obj
        if inspect.isclass(obj):
            for mname, member in vars(obj).items():
                fn = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
                if not mname.startswith("_") and inspect.isfunction(fn):
                    yield f"{module_name}.{name}.{mname}", fn


def test_every_public_symbol_of_the_api_reference_has_a_docstring(gen) -> None:
    missing = []
    for module_name in gen.API_MODULES:
        assert (importlib.import_module(module_name).__doc__ or "").strip(), module_name
        for qual, obj in _public_symbols(module_name):
            doc = obj.__doc__ or ""
            # a dataclass without a docstring gets its signature as __doc__
            if not doc.strip() or (inspect.isclass(obj) and doc.startswith(obj.__name__ + "(")):
                missing.append(qual)
    assert not missing, f"public symbols without a docstring: {missing}"
    assert set(gen.API_MODULES) == {p[len("reference/api/"):-3] for p in gen.api_pages()} - {"index"}


def test_site_links_of_generated_pages_stay_links(pages) -> None:
    assert "](../reference/config/fleet.md)" in pages["guides/precision.md"]
    assert "](../corrections.md)" in pages["concepts/metrics.md"]
    assert "A run directory holds" in pages["concepts/metrics.md"]  # the quickstart's paragraph
    home, results = (ROOT / "docs/index.md").read_text(), (ROOT / "docs/results.md").read_text()
    assert "](quickstart.md)" in home and "](reference/config/index.md)" in home
    assert "](artifacts/bench_e2e.json)" in results and "](docs/artifacts/" not in results


def _nav_paths(nav) -> list[str]:
    """Every page path of a mkdocs ``nav`` (nested lists of ``title: path`` and bare paths)."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [p for v in nav.values() for p in _nav_paths(v)]
    return [p for item in nav or [] for p in _nav_paths(item)]


def _config() -> dict:
    yaml = pytest.importorskip("yaml")

    return yaml.safe_load((ROOT / "mkdocs.yml").read_text())


def test_every_page_is_in_the_nav_or_not_in_nav(pages) -> None:
    pathspec = pytest.importorskip("pathspec")  # mkdocs' own not_in_nav matcher

    config = _config()
    nav = _nav_paths(config["nav"])
    hidden = pathspec.gitignore.GitIgnoreSpec.from_lines(config["not_in_nav"].splitlines())
    sources = [p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")]
    assert not set(pages) & set(sources), "a page is both generated and a file under docs/"
    for page in [*pages, *sources]:
        assert page in nav or hidden.match_file(page), f"{page} is neither in the nav nor in not_in_nav"
    # and no nav entry names a page that nothing makes (the build below fails on one too)
    missing = [p for p in nav if p not in pages and not (ROOT / "docs" / p).exists()]
    assert not missing, f"nav entries without a page: {missing}"


def test_readme_links_point_to_files() -> None:
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"(?<!!)\[[^\]]+\]\(([^)\s]+)\)", text)
    assert len(links) > 20
    for target in links:
        if re.match(r"[a-z]+:", target):
            continue
        path = target.split("#")[0]
        assert not path.startswith("/") and (ROOT / path).exists(), target
    assert len(text.splitlines()) <= 250


def test_readme_links_become_site_links(gen) -> None:
    text = "see [docs/study.md](docs/study.md), [x](src/mixrl/x.py), [`y`](examples/y), [w](https://a.b)"
    out = gen.relink(text, "guides/data.md")
    assert out == "see [docs/study.md](../study.md), `x`, `y`, [w](https://a.b)"


_NO_MKDOCS = pytest.mark.skipif(shutil.which("mkdocs") is None and importlib.util.find_spec("mkdocs") is None,
                                reason="mkdocs is not installed (pip install -e '.[dev]')")


def _build(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"})


@_NO_MKDOCS
def test_site_builds_strictly(tmp_path: Path) -> None:
    r = _build(["-q", "-d", str(tmp_path / "site")])
    assert r.returncode == 0, r.stderr[-3000:]
    page = (tmp_path / "site" / "reference" / "config" / "rollout" / "index.html").read_text()
    assert "<code>rollout.<wbr>group_size</code>" in page  # the path, wrapping only between names


@_NO_MKDOCS
def test_a_dangling_nav_entry_fails_the_strict_build(tmp_path: Path) -> None:
    """The same configuration with one nav entry that names no page: the strict build refuses it."""
    import yaml

    config = _config()
    config["nav"].append({"Nowhere": "guides/no_such_page.md"})
    # the copy lives in tmp_path: every path that is relative to the config file made absolute
    config["docs_dir"], config["site_dir"] = str(ROOT / "docs"), str(tmp_path / "site")
    config["hooks"] = [str(ROOT / h) for h in config["hooks"]]
    for plugin in config["plugins"]:
        if isinstance(plugin, dict) and "mkdocstrings" in plugin:
            handler = plugin["mkdocstrings"]["handlers"]["python"]
            handler["paths"] = [str(ROOT / p) for p in handler["paths"]]
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config, sort_keys=False, allow_unicode=True))
    r = _build(["-f", str(tmp_path / "mkdocs.yml")])
    assert r.returncode != 0
    assert "guides/no_such_page.md" in r.stderr and "not found in the documentation files" in r.stderr, r.stderr[-3000:]
