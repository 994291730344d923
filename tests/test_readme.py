"""The result tables of the README and the docs pages are exactly what the committed artifacts say
(scripts/readme_tables.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_tables_match_the_artifacts() -> None:
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "readme_tables.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_a_changed_artifact_changes_the_table(tmp_path: Path) -> None:
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("readme_tables", ROOT / "scripts" / "readme_tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.ARTIFACTS = tmp_path
    (tmp_path / "eval_bundled.json").write_text(json.dumps({
        "command": "mixrl eval bundled --k 4 --json", "machine": {"cores": 2, "cpu_flags": ["avx2"], "load_avg_1m": 0.1},
        "result": {"pass@1": 0.123, "pass@4": 0.456, "k": 4, "n": 4, "n_tasks": 200, "weights_sha256": "ab" * 32}}))
    out = mod.render("x\n<!-- table:eval -->\nold\n<!-- /table:eval -->\ny")
    assert "0.123" in out and "0.456" in out and "old" not in out and out.startswith("x\n") and out.endswith("y")


def _tables(tmp_path: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("readme_tables", ROOT / "scripts" / "readme_tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.ARTIFACTS = tmp_path
    return mod


def _artifact(path: Path, command: str, result: dict, flags: list[str]) -> None:
    import json

    path.write_text(json.dumps({"command": command, "result": result,
                                "machine": {"cores": 2, "cpu_flags": flags, "load_avg_1m": 0.5}}))


def test_headline_rows_state_value_goal_limit_and_met(tmp_path: Path) -> None:
    mod = _tables(tmp_path)
    _artifact(tmp_path / "bench_e2e.json", "mixrl bench e2e --json",
              {"async_over_sync": 1.2, "cpu_ceiling": {"async_over_sync_cpu_ceiling": 1.25},
               "mixrl_over_trl": 2.5, "unrelated": 7}, ["avx2", "avx512f"])
    _artifact(tmp_path / "bench_moe.json", "mixrl bench moe --json",
              {"kl_replay": 0.02, "kl_no_replay": 0.01}, ["avx2"])
    out = mod.table_bench()
    rows = {line.split(" | ")[1]: line.split(" | ") for line in out.splitlines() if line.startswith("| [")}
    ratio = rows["async over sync training, samples/s (`async_over_sync`)"]
    assert ratio[2] == "1.2" and ratio[3] == "≥ 1.6; CPU ceiling 1.25 (value = 0.96x it)" and ratio[4] == "**no**"
    assert ratio[5] == "2 cores, AVX-512, load 0.5 |"
    assert rows["mixrl over TRL GRPOTrainer, steps/s (`mixrl_over_trl`)"][4] == "yes"
    replay = next(v for k, v in rows.items() if "`kl_replay`" in k)  # a goal that is another key
    assert replay[3] == "≤ `kl_no_replay` 0.01" and replay[4] == "**no**" and replay[5].startswith("2 cores, AVX2, no")
    # keys the artifact lacks (trainer_idle_frac, publish_over_floor) are skipped, not errors
    assert not any("trainer_idle_frac" in k for k in rows) and "unrelated" not in out
    assert "[e2e](docs/artifacts/bench_e2e.json): `mixrl bench e2e --json`" in out


def test_a_benchmark_without_declared_headlines_is_still_linked(tmp_path: Path) -> None:
    mod = _tables(tmp_path)
    _artifact(tmp_path / "bench_newthing.json", "mixrl bench newthing --json", {"x": 1.0}, [])
    out = mod.table_bench()
    assert "| [" not in out and "[newthing](docs/artifacts/bench_newthing.json)" in out


def test_headline_evaluation_against_python_comparisons() -> None:
    import itertools

    from mixrl.lab.bench.headlines import Headline, evaluate, meets

    for v, g in itertools.product((0.5, 1.0, 1.5), (0.5, 1.0, 1.5)):
        assert meets(v, ">=", g) is (v >= g) and meets(v, "<=", g) is (v <= g) and meets(v, "==", g) is (v == g)
    assert meets("text", ">=", 1.0) is None and meets(True, "<=", 1.0) is None
    h = Headline("a.b", "nested", ">=", "goal", limit="lim", interval="ci")
    row = evaluate(h, {"a": {"b": 3}, "goal": 2, "lim": 4, "ci": [2.5, 3.5, 0.95]})
    assert row is not None and (row.value, row.goal, row.limit, row.interval, row.met) == (3, 2, 4, [2.5, 3.5, 0.95], True)
    assert evaluate(h, {"a": {}}) is None and evaluate(h, {"a": {"b": None}}) is None
    assert evaluate(Headline("x", "no goal"), {"x": 1}).met is None
    assert evaluate(h, {"a": {"b": 3}}).met is None  # its goal key missing: undecided, still shown


def test_every_committed_benchmark_artifact_has_a_headline_row() -> None:
    import json

    from mixrl.lab.bench.headlines import rows

    for path in sorted((ROOT / "docs" / "artifacts").glob("bench_*.json")):
        assert rows(path.stem.removeprefix("bench_"), json.loads(path.read_text())["result"]), path.name


def test_every_file_with_tables_is_rendered_and_checked() -> None:
    mod = _tables(ROOT / "docs" / "artifacts")
    holders = {str(p.relative_to(ROOT)) for p in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
               if "<!-- table:" in p.read_text()}
    assert holders == set(mod.FILES), f"files with tables that readme_tables.py does not render: {holders ^ set(mod.FILES)}"
    readme = (ROOT / "README.md").read_text()
    for name in ("make_run", "eval", "headlines"):  # the README keeps its headline tables
        assert f"<!-- table:{name} -->" in readme, name


def test_artifact_links_are_relative_to_the_file_that_holds_the_table(tmp_path: Path) -> None:
    mod = _tables(tmp_path)
    _artifact(tmp_path / "bench_e2e.json", "mixrl bench e2e --json", {"mixrl_over_trl": 2.5}, ["avx2"])
    text = "<!-- table:bench -->\n<!-- /table:bench -->"
    assert "[e2e](docs/artifacts/bench_e2e.json)" in mod.render(text, "README.md")
    assert "[e2e](artifacts/bench_e2e.json)" in mod.render(text, "docs/results.md")
    assert "[e2e](../artifacts/bench_e2e.json)" in mod.render(text, "docs/guides/x.md")


def test_the_headline_table_keeps_the_figures_with_a_goal(tmp_path: Path) -> None:
    mod = _tables(tmp_path)
    _artifact(tmp_path / "bench_e2e.json", "mixrl bench e2e --json",
              {"mixrl_over_trl": 2.5, "async_over_sync": 1.2}, ["avx2"])
    _artifact(tmp_path / "bench_serve.json", "mixrl bench serve --json",
              {"endpoint_over_direct": 0.9, "server_cpu_ms_per_request": 0.3}, ["avx2"])
    full, head = mod.table_bench(), mod.table_headlines("artifacts/")
    assert "server_cpu_ms_per_request" in full and "server_cpu_ms_per_request" not in head  # no goal
    assert "`endpoint_over_direct`" in head and "`mixrl_over_trl`" in head and "Full results" not in head
    assert "](artifacts/bench_serve.json)" in head


def test_a_stale_table_in_a_docs_page_fails_the_check(tmp_path: Path) -> None:
    mod = _tables(ROOT / "docs" / "artifacts")
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    page.write_text("# p\n\n<!-- table:eval -->\nstale\n<!-- /table:eval -->\n")
    (tmp_path / "README.md").write_text("no tables\n")
    mod.ROOT, mod.FILES = tmp_path, ("README.md", "docs/page.md")
    assert mod.main(["--check"]) == 1 and "stale" in page.read_text()
    assert mod.main([]) == 0 and "stale" not in page.read_text() and mod.main(["--check"]) == 0
