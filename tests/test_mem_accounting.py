"""Memory measured, not estimated: tensor bytes by storage, PSS by process, the trainer's parts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from mixrl.config.presets import get_preset
from mixrl.lab.bench.memwatch import PeakMemory
from mixrl.train.trainer import Trainer
from mixrl.weights import shared as sw
from mixrl.weights.accounting import process_pss, tensor_bytes
from tests.test_trainer import make_batch, tiny_model

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_tensor_bytes_counts_each_storage_once_and_tells_mapped_from_owned(tmp_path: Path) -> None:
    a = torch.zeros(1000)  # 4000 bytes
    view = a[10:20]
    objs = {"a": a, "again": [a, view], "b": torch.zeros(10, dtype=torch.float64)}
    got = tensor_bytes(objs)
    assert got["owned"] == 4000 + 80 and got["mapped"] == 0 and got["tensors"] == 3
    man = sw.write_tensors({"w": torch.ones(256)}, tmp_path / "v.bin")
    # a view of a mapped file counts as mapped only when the file is a weight version's (mixrl-w-*)
    assert tensor_bytes(sw.map_manifest(man))["owned"] == 1024
    v = sw.SharedVersion.from_state_dict({"w": torch.ones(256)})
    try:
        m = tensor_bytes(v.tensors())
        assert (m["mapped"], m["owned"]) == (1024, 0)  # the mapped file's storage: one tensor's bytes
    finally:
        v.retire()


def test_trainer_tensor_bytes_are_its_parameters_gradients_and_adam_moments() -> None:
    trajs, adv = make_batch(4, "none", seed=1)
    tr = Trainer(tiny_model(1), get_preset("grpo").loss, lr=1e-3)
    params = sum(p.numel() * 4 for p in tr.model.parameters())  # tied: once
    before = tr.tensor_bytes()
    assert before["params"] >= params and before["optimizer"] == 0 and before["grads_in_step"] == 0
    tr.step(trajs, adv)
    after = tr.tensor_bytes()
    assert after["grads_in_step"] == params  # measured before the step frees them
    # AdamW: two moments per parameter plus a scalar step count each
    assert 2 * params <= after["optimizer"] <= 2 * params + 8 * len(tr.params)
    assert after["master"] == 0 and after["ref_model"] == 0


@linux
def test_process_pss_parts_add_up() -> None:
    p = process_pss()
    assert p is not None and p["pss"] > 0
    assert abs(p["anon"] + p["file"] + p["shmem"] - p["pss"]) <= 16 << 10  # rounding per line, kB
    assert process_pss(2**22 + 12345) is None  # no such process


@linux
def test_peak_breakdown_names_processes_and_total_counts_unmapped_shared_files() -> None:
    extra = [0]
    with PeakMemory(every=0.05, extra_bytes=lambda: extra[0]) as mem:
        mem.phase("a")
        extra[0] = 512 << 20  # a shared-memory file nobody maps: invisible to PSS
        mem._sample()
        hold = torch.ones(32 << 20, dtype=torch.uint8)  # 32 MB private
        mem._sample()
    out = mem.gb()
    b = mem.breakdown()
    assert out["peak_total_gb"] >= out["peak_pss_gb"] + 0.45
    assert b["processes"] and b["processes"][0]["pid"] > 0 and b["processes"][0]["name"]
    assert b["phase"] == "a" and b["extra_mb"] == 512.0
    assert b["processes"][0]["anon"] >= 32
    del hold
