"""The ``fp16`` study arm's trainer: FP16 weights published, FP32 master copies updated."""

from __future__ import annotations

import math

import torch

from mixrl.config.presets import get_preset
from mixrl.train.trainer import Trainer
from tests.test_trainer import make_batch, tiny_model

torch.set_num_threads(1)


def test_fp16_precision_runs_and_keeps_master_weights():
    cfg = get_preset("fp16").loss
    trajs, adv = make_batch(4, "none", seed=5)
    tr = Trainer(tiny_model(5), cfg, lr=1e-2, precision="fp16", chunk_size=8)
    before = {k: v.float() for k, v in tr.state_dict_for_samplers().items()}
    m = tr.step(trajs, adv)
    assert math.isfinite(m["loss"]) and m["optim/grad_norm"] > 0 and m["optim/skipped_steps"] == 0
    pub = tr.state_dict_for_samplers()
    assert all(v.dtype == torch.float16 for v in pub.values())
    assert any(not torch.equal(pub[k].float(), before[k]) for k in pub)
    assert tr.master is not None and all(mw.dtype == torch.float32 for mw in tr.master)
    for mw, p in zip(tr.master, tr.params, strict=True):
        assert torch.equal(mw.half(), p.detach())  # the published weights are the rounded masters
