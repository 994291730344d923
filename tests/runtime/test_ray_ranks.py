"""FSDP2 trainer ranks as Ray actors in one placement group: they match one in-process trainer."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from .test_run import tiny_cfg

pytestmark = pytest.mark.ray


def test_two_rank_actors_match_one_trainer(tiny_policy: Path, tmp_path: Path) -> None:
    pytest.importorskip("ray")
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from test_fsdp import batch, max_abs_diff

    from mixrl.config.presets import needs
    from mixrl.runtime.backends.ray_backend import RayBackend
    from mixrl.runtime.run import resolve_loss
    from mixrl.runtime.trainer_state import build_trainer

    cfg = tiny_cfg(tiny_policy, tmp_path, trainer={"world_size": 2}, runtime={"backend": "ray"})
    cfg.optim.packing = False
    loss_cfg = resolve_loss(cfg)[0]
    one = cfg.model_copy(deep=True)
    one.trainer.world_size = 1
    single = build_trainer(one, str(tiny_policy), loss_cfg)[0]
    vocab = int(single.model.lm_head.weight.shape[0])
    batches = [batch(vocab, needs(loss_cfg).cand_kind, 8, seed=s) for s in range(2)]
    for trajs, adv in batches:
        single.step(trajs, adv)

    async def main() -> tuple[dict, list]:
        import ray

        backend = RayBackend(cfg, str(tiny_policy), loss_cfg)
        await backend.start()
        try:
            ranks = await backend.make_trainer()
            for trajs, adv in batches:
                await ranks.step(trajs, adv)
            w = await (await ranks.weights())
            placed = await backend.placement()
            await ranks.close()
            return w, placed
        finally:
            ray.shutdown()

    w2, placed = asyncio.run(main())
    assert max_abs_diff(single.state_dict_for_samplers(), w2) <= 1e-5
    assert [r["actor"] for r in placed] == ["trainer"]
