"""The README's result tables are exactly what the committed artifacts say (scripts/readme_tables.py)."""

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
