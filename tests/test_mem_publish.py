"""A publication costs one copy of the weights: written from the trainer's own tensors (no copy
first), tied weights once, and the samplers get exactly what ``state_dict_for_samplers`` copies."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from mixrl.config.presets import get_preset
from mixrl.config.schema import LoraConfig
from mixrl.runtime.backends.embedded.threads import EmbeddedTrainer
from mixrl.train.lora import LoraTrainer, apply_lora
from mixrl.train.trainer import Trainer
from mixrl.weights import shared as sw
from tests.test_trainer import make_batch, tiny_model


def test_tied_entries_are_written_once_and_map_to_the_same_values(tmp_path: Path) -> None:
    emb = torch.randn(48, 32)
    other = torch.randn(48, 32)  # same shape, other memory: written on its own
    man = sw.write_tensors({"embed": emb, "head": emb, "other": other, "half": emb[:24]}, tmp_path / "v.bin")
    assert man["embed"][3] == man["head"][3] != man["other"][3]
    assert man["half"][3] not in (man["embed"][3], man["other"][3])  # a different view: its own bytes
    # embed + other + half, each 64-byte aligned: one copy of the tied table, not two
    assert os.path.getsize(tmp_path / "v.bin") == 48 * 32 * 4 * 2 + 24 * 32 * 4
    got = sw.map_manifest(man)
    for k, want in (("embed", emb), ("head", emb), ("other", other), ("half", emb[:24])):
        assert torch.equal(got[k], want)


def _published(handle: EmbeddedTrainer) -> dict[str, torch.Tensor]:
    v = asyncio.run(handle.weights())
    try:
        return {k: t.clone() for k, t in v.tensors().items()}
    finally:
        v.retire()


@pytest.mark.parametrize("lora", [False, True])
def test_the_published_version_is_the_trainers_weights_written_without_a_copy(lora: bool,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    trajs, adv = make_batch(4, "none", seed=5)
    model = tiny_model(5)
    if lora:
        model = apply_lora(model, LoraConfig(rank=4, alpha=8.0))
        tr: Any = LoraTrainer(model, get_preset("grpo").loss, lr=1e-2)
    else:
        tr = Trainer(model, get_preset("grpo").loss, lr=1e-2)
    handle = EmbeddedTrainer(tr, None)
    seen: list[dict[str, torch.Tensor]] = []
    write = sw.write_tensors
    monkeypatch.setattr(sw, "write_tensors", lambda ts, path: (seen.append(dict(ts)), write(ts, path))[1])
    for _ in range(2):
        tr.step(trajs, adv)
        want = tr.state_dict_for_samplers()
        got = _published(handle)
        assert got.keys() == want.keys()
        for k in want:  # bit for bit
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    params = {p.data_ptr() for p in tr.model.parameters()}
    written = {t.data_ptr() for t in seen[-1].values()}
    # the tensors written into shared memory are the trainer's own (no copy first); with LoRA the
    # adapted projections are merged (new tensors) and the rest is the base model's own
    assert written & params and (lora or written <= params)


def test_the_embedded_trainer_returns_freed_memory_after_each_update(monkeypatch: pytest.MonkeyPatch) -> None:
    from mixrl.runtime.backends.embedded import threads

    calls: list[int] = []
    monkeypatch.setattr(threads, "release_freed_memory", lambda: calls.append(1) or True)
    trajs, adv = make_batch(4, "none", seed=6)
    handle = EmbeddedTrainer(Trainer(tiny_model(6), get_preset("grpo").loss, lr=1e-2), None)
    m = asyncio.run(handle.step(trajs, adv))
    assert calls == [1] and "loss" in m


def test_a_run_keeps_one_version_and_a_load_in_progress_keeps_its_own(tmp_path: Path) -> None:
    from mixrl.config import load_config
    from mixrl.runtime.run import train
    from mixrl.weights.store import WeightStore

    seen: dict[str, int] = {}

    async def hook(orch: Any) -> None:
        seen["keep"] = orch.fleet.store.keep

    cfg = load_config(None, ["runtime.steps=1", "rollout.prompts_per_step=2", "rollout.group_size=2",
                             "runtime.eval.enabled=false", "observe.tensorboard=false", "observe.progress=false",
                             "runtime.checkpoint_every=0", f'observe.run_dir="{(tmp_path / "run").as_posix()}"'])
    assert train(cfg, evaluate=False, progress=False, hook=hook)["steps"] == 1
    assert seen["keep"] == 1
    # what keep=1 relies on: an evicted version's files outlive the store while a load holds them
    store = WeightStore(put=None, keep=1)
    v1 = sw.SharedVersion.from_state_dict({"w": torch.ones(8)})
    store.publish(1, v1, [])
    v1.acquire()  # a replica's load of version 1 in progress
    store.publish(2, sw.SharedVersion.from_state_dict({"w": torch.zeros(8)}), [])
    assert store.get()[0] == 2 and torch.equal(sw.map_manifest(v1.manifest())["w"], torch.ones(8))
    v1.release()  # the load is done: version 1 is deleted (renamed away at once)
    assert not Path(v1.manifest()["w"][0]).exists()
