"""Atomic checkpoints: round trip, RNG, keep-k, crashes mid-write leave the previous one."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from mixrl.train import checkpoint as ck


def payload(step: int) -> dict:
    torch.manual_seed(step)
    lin = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(lin.parameters(), lr=0.1)
    lin(torch.randn(4, 3)).sum().backward()
    opt.step()
    return {"trainer": {"model": lin.state_dict(), "optimizer": opt.state_dict(), "version": step},
            "orchestrator": {"cursor": step * 10, "buffer": [{"prompt_id": "p1", "tokens": [1, 2]}],
                             "inflight": ["p7", "p8"]}}


def test_round_trip_and_rng(tmp_path):
    p = payload(3)
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    ck.save_checkpoint(tmp_path, 3, p)
    expect = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    got = ck.load_latest(tmp_path)
    assert got is not None and got["step"] == 3
    assert got["orchestrator"] == p["orchestrator"]
    for k, v in p["trainer"]["model"].items():
        assert torch.equal(got["trainer"]["model"][k], v)
    assert got["trainer"]["optimizer"]["param_groups"] == p["trainer"]["optimizer"]["param_groups"]
    meta = json.loads((tmp_path / "checkpoints" / "step_000003" / "meta.json").read_text())
    assert meta["parts"] == {"trainer": "pt", "orchestrator": "json", "rng": "pt"}
    random.random(), np.random.rand(), torch.rand(1)  # move the generators on
    ck.restore_rng(got["rng"])
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expect


def test_keeps_last_k_and_latest_pointer(tmp_path):
    for s in range(5):
        ck.save_checkpoint(tmp_path, s, {"orchestrator": {"step": s}}, keep=2)
    names = [p.name for p in ck.list_checkpoints(tmp_path)]
    assert names == ["step_000003", "step_000004"]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_000004"
    assert ck.load_latest(tmp_path)["orchestrator"] == {"step": 4}


def test_exception_mid_write_leaves_previous_checkpoint(tmp_path, monkeypatch):
    ck.save_checkpoint(tmp_path, 1, payload(1))
    calls = {"n": 0}
    real = ck._write

    def failing(path, value, kind):
        calls["n"] += 1
        if calls["n"] == 2:  # after the first part is on disk
            raise OSError("disk full")
        real(path, value, kind)

    monkeypatch.setattr(ck, "_write", failing)
    with pytest.raises(OSError, match="disk full"):
        ck.save_checkpoint(tmp_path, 2, payload(2))
    monkeypatch.setattr(ck, "_write", real)
    root = tmp_path / "checkpoints"
    assert not list(root.glob(".tmp-*")) and not (root / "step_000002").exists()
    got = ck.load_latest(tmp_path)
    assert got["step"] == 1 and got["orchestrator"]["cursor"] == 10


def test_hard_crash_mid_write_leaves_previous_checkpoint(tmp_path):
    ck.save_checkpoint(tmp_path, 1, payload(1))
    script = textwrap.dedent(f"""
        import os, torch
        from mixrl.train import checkpoint as ck
        real = ck._write
        def dying(path, value, kind):
            real(path, value, kind)
            if path.name == "trainer.pt":
                os._exit(9)  # killed after one part: no cleanup runs
        ck._write = dying
        ck.save_checkpoint({str(tmp_path)!r}, 2, {{"trainer": {{"w": torch.ones(3)}}, "orchestrator": {{"cursor": 20}}}})
    """)
    rc = subprocess.run([sys.executable, "-c", script], check=False).returncode
    assert rc == 9
    root = tmp_path / "checkpoints"
    assert list(root.glob(".tmp-*"))  # the half-written directory is there ...
    got = ck.load_latest(tmp_path)  # ... and ignored
    assert got["step"] == 1 and got["orchestrator"]["cursor"] == 10
    ck.save_checkpoint(tmp_path, 2, payload(2))  # the next save cleans it up
    assert not list(root.glob(".tmp-*")) and ck.load_latest(tmp_path)["step"] == 2


def test_dangling_latest_falls_back_to_newest_complete(tmp_path):
    ck.save_checkpoint(tmp_path, 1, {"orchestrator": {"a": 1}})
    ck.save_checkpoint(tmp_path, 2, {"orchestrator": {"a": 2}})
    (tmp_path / "checkpoints" / "latest").write_text("step_000009\n")
    assert ck.load_latest(tmp_path)["step"] == 2
    os.remove(tmp_path / "checkpoints" / "step_000002" / "meta.json")  # incomplete
    assert ck.load_latest(tmp_path)["step"] == 1


def test_resave_same_step_and_empty_dir(tmp_path):
    assert ck.load_latest(tmp_path) is None
    ck.save_checkpoint(tmp_path, 5, {"orchestrator": {"v": 1}})
    ck.save_checkpoint(tmp_path, 5, {"orchestrator": {"v": 2}})
    assert ck.load_latest(tmp_path)["orchestrator"] == {"v": 2}
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


@pytest.mark.parametrize("name", ["rng", "meta", "a/b", ""])
def test_bad_part_names(tmp_path, name):
    with pytest.raises(ValueError, match="part name"):
        ck.save_checkpoint(tmp_path, 0, {name: 1})


def test_part_that_weights_only_loading_would_reject_fails_at_save(tmp_path):
    with pytest.raises(ValueError, match=r"orchestrator\['cursor'\] holds a int64"):
        ck.save_checkpoint(tmp_path, 0, {"orchestrator": {"cursor": np.int64(3), "w": torch.ones(1)}})
    assert ck.load_latest(tmp_path) is None


def test_runtime_style_trainer_state_round_trips(tmp_path):
    """Tuples (python RNG state), None and tensors in one part load back under weights_only."""
    part = {"model": {"w": torch.ones(2)}, "master": None, "version": 3,
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}}
    ck.save_checkpoint(tmp_path, 1, {"trainer": part, "format": 1, "cost": None})
    got = ck.load_latest(tmp_path)
    assert got["trainer"]["rng"]["python"] == random.getstate() and got["format"] == 1
    assert got["cost"] is None and got["trainer"]["master"] is None
