"""/dev/shm too small for the shared weight versions is refused at start-up in one line."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

from mixrl.models.policy import load_policy, resolve
from mixrl.weights import shared as sw

Usage = collections.namedtuple("Usage", "total used free")


def test_checkpoint_bytes_counts_every_weight_in_fp32() -> None:
    model, _ = load_policy("bundled")
    want = sum(p.numel() for p in model.parameters()) * 4  # parameters(): tied weights once, as stored
    assert sw.checkpoint_bytes(resolve("bundled")) == want > 0
    assert sw.checkpoint_bytes(resolve("bundled"), itemsize=2) == want // 2


def test_shortfall_names_the_room_and_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sw.shutil, "disk_usage", lambda p: Usage(64 << 20, 0, 64 << 20))
    assert sw.shm_shortfall(64 << 20, str(tmp_path)) is None
    line = sw.shm_shortfall(3 << 30, str(tmp_path))
    assert line is not None and "\n" not in line
    assert f"{tmp_path} has 64 MiB free" in line and "about 3072 MiB" in line and "--shm-size=4g" in line
    assert sw.shm_shortfall(1 << 40, str(tmp_path / "absent")) is None  # no /dev/shm: a temporary directory


def test_train_with_a_small_dev_shm_exits_2_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from mixrl.commands.main import main

    monkeypatch.setattr(sw.shutil, "disk_usage", lambda p: Usage(64 << 20, 63 << 20, 1 << 20))
    rc = main(["train", "--no-eval", "--set", "runtime.steps=1", "--set", f"observe.run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "/dev/shm has 1 MiB free" in err[0], err
