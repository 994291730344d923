"""One home each: atomic writes, stable seeds, the "head:K" spec, the run directory's layout."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mixrl.records.generation import SamplingParams, parse_record
from mixrl.records.run_dir import RunDir
from mixrl.system.files import atomic_write, atomic_write_json
from mixrl.system.seeds import stable_seed


def test_atomic_write_replaces_whole_or_not_at_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "a.json"
    atomic_write_json(f, {"x": 1}, indent=2)
    assert f.read_text() == '{\n  "x": 1\n}\n'
    atomic_write(f, b"new")
    assert f.read_bytes() == b"new"

    def crash(*_: object) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk gone"):
        atomic_write(f, "half")
    assert f.read_bytes() == b"new" and sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]


def test_stable_seed_is_the_same_in_every_process() -> None:
    want = int.from_bytes(hashlib.blake2b(b"7|p/0/1", digest_size=8).digest(), "big") >> 1
    assert stable_seed(7, "p/0/1") == want and 0 <= want < 2**63
    code = "from mixrl.system.seeds import stable_seed; print(stable_seed('serve', 'fp8'))"
    got = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONHASHSEED": s}).stdout.strip() for s in ("1", "2", "3")}
    assert got == {str(stable_seed("serve", "fp8"))}
    assert stable_seed("eval", 0, "a") != stable_seed("eval", 0, "b")


@pytest.mark.parametrize(("spec", "want"), [("support", ("support", 0)), ("none", ("none", 0)),
                                            ("head:1", ("head", 1)), ("head:64", ("head", 64))])
def test_parse_record_reads_the_spec(spec: str, want: tuple[str, int]) -> None:
    assert parse_record(spec) == want
    assert SamplingParams(record=spec).head_k == want[1]


@pytest.mark.parametrize("spec", ["head:0", "head:", "head:x", "head:-1", "auto", "Support", ""])
def test_parse_record_refuses_anything_else(spec: str) -> None:
    with pytest.raises(ValueError, match="rollout.record must be"):
        parse_record(spec, "rollout.record")
    with pytest.raises(ValueError, match="SamplingParams.record"):
        SamplingParams(record=spec)


def test_run_dir_names_each_file_once(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    paths = [run.config, run.derived, run.inputs, run.metrics, run.batches, run.collapse, run.eval,
             run.summary, run.log, run.checkpoints]
    assert len(set(paths)) == len(paths) and all(p.parent == tmp_path for p in paths)
    assert run.checkpoint(40) == tmp_path / "checkpoints" / "step_000040"
