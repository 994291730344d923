"""``--overwrite`` replaces only a run directory that ``mixrl train`` made; anything else is refused
with one line and nothing is deleted."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_data_cli import one_line_error, project, tiny  # noqa: F401  (tiny: the module's fixture)

from mixrl.commands.main import main


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): (p.read_text() if p.is_file() else "<dir>") for p in sorted(root.rglob("*"))}


def test_overwrite_refuses_a_folder_mixrl_did_not_make(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                       tiny: Path) -> None:  # noqa: F811
    cfg = project(tmp_path / "p", tiny)
    scratch = tmp_path / "scratch"
    (scratch / "notes").mkdir(parents=True)
    (scratch / "thesis.txt").write_text("years of work")
    (scratch / "notes" / "n.md").write_text("more")
    before = _tree(scratch)
    assert main(["train", str(cfg), "--no-eval", "--overwrite", "--set", f'observe.run_dir="{scratch}"']) == 2
    one_line_error(capsys, "--overwrite", str(scratch), "not a run directory", "nothing was deleted")
    assert _tree(scratch) == before
    link = tmp_path / "link"
    os.symlink(tmp_path / "p", link)  # a link to a folder that is not a run either
    assert main(["train", str(cfg), "--no-eval", "--overwrite", "--set", f'observe.run_dir="{link}"']) == 2
    one_line_error(capsys, "not a run directory")
    assert (tmp_path / "p" / "config.toml").is_file()
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert main(["train", str(cfg), "--no-eval", "--set", f'observe.run_dir="{afile}"']) == 2
    one_line_error(capsys, "is a file")
    # a run directory mixrl made (its marker) is replaced
    run = tmp_path / "p" / "run"
    assert main(["train", str(cfg), "--no-eval"]) == 0
    assert (run / ".mixrl-run").is_file()
    (run / "stale.txt").write_text("from the old run")
    assert main(["train", str(cfg), "--no-eval", "--overwrite"]) == 0, capsys.readouterr().err
    assert not (run / "stale.txt").exists() and (run / ".mixrl-run").is_file()
