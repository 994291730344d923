"""GPU placement on one host: which device each sampler worker sees, and the memory check.

The device plan is arithmetic over the config (``runtime.backends.placement``); the
worker test starts real worker processes on a host narrowed by ``CUDA_VISIBLE_DEVICES``
(as a scheduler narrows a container) and reads what each worker's environment shows.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from mixrl.config import ConfigError, build_config
from mixrl.runtime.backends.placement import check_gpu_plan, replica_device, visible_env


def cfg_with(groups: list[dict[str, Any]], **trainer: Any) -> Any:
    return build_config({"model": {"path": "bundled"}, "fleet": {"groups": groups}, "trainer": trainer})


def group(name: str, **kw: Any) -> dict[str, Any]:
    return {"name": name, "profile": "h100-vllm-fp8", "replicas": 1, "min_replicas": 0, **kw}


def test_replicas_spread_over_the_hosts_gpus_not_all_on_gpu0() -> None:
    cfg = cfg_with([group("fp8", num_gpus=1, max_replicas=4), group("bf16", num_gpus=1, max_replicas=4),
                    group("pinned", cuda_devices=[2, 5], max_replicas=4), {"name": "cpu", "profile": "fp32"}])
    assert [replica_device(cfg, "fp8", i, 8) for i in range(4)] == [0, 1, 2, 3]
    assert [replica_device(cfg, "bf16", i, 8) for i in range(4)] == [4, 5, 6, 7]  # after fp8's, not from 0
    assert [replica_device(cfg, "pinned", i, 8) for i in range(4)] == [2, 5, 2, 5]
    assert replica_device(cfg, "cpu", 0, 8) is None and visible_env(None) == ""  # a CPU worker sees no GPU


def test_visible_env_maps_to_the_parents_own_device_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    assert [visible_env(0), visible_env(1)] == ["5", "7"]


def test_gpu_memory_is_checked_against_each_device() -> None:
    two = [group("fp8", num_gpus=1, max_replicas=1), group("bf16", num_gpus=1, max_replicas=1)]
    with pytest.raises(ConfigError, match=r"engines on GPU 0 \(fp8/0, bf16/0\) would take 1.80"):
        check_gpu_plan(cfg_with(two), 1)  # vLLM's default 0.9 each
    plan = check_gpu_plan(cfg_with(two), 2)
    assert plan == {0: ["fp8/0"], 1: ["bf16/0"]}
    shared = [group("fp8", num_gpus=1, max_replicas=1, gpu_memory_utilization=0.3),
              group("bf16", num_gpus=1, max_replicas=1, gpu_memory_utilization=0.3)]
    assert check_gpu_plan(cfg_with(shared, num_gpus=1), 1) == {0: ["trainer", "fp8/0", "bf16/0"]}
    with pytest.raises(ConfigError, match=r"groups\[1\].gpu_memory_utilization: unset.*bf16/0.*GPU 0"):
        check_gpu_plan(cfg_with([shared[0], group("bf16", num_gpus=1, max_replicas=1)], num_gpus=1), 1)
    with pytest.raises(ConfigError, match=r"groups\[0\].cuda_devices: device 3 does not exist"):
        check_gpu_plan(cfg_with([group("fp8", cuda_devices=[3])]), 2)
    with pytest.raises(ConfigError, match="asks for a GPU.*this host has none"):
        check_gpu_plan(cfg_with([group("fp8", num_gpus=1)]), 0)


def test_each_sampler_worker_sees_only_its_gpu(tiny_policy: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from mixrl.runtime.backends.embedded import EmbeddedBackend
    from mixrl.runtime.run import resolve_loss

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")  # this host shows two GPUs, ids 5 and 7
    cfg = build_config({
        "model": {"path": str(tiny_policy)},
        "fleet": {"groups": [
            {"name": "gpu", "profile": "fp32", "replicas": 2, "max_replicas": 2, "num_gpus": 1,
             "gpu_memory_utilization": None},
            {"name": "cpu", "profile": "fp32", "replicas": 1, "max_replicas": 1},
        ]},
        "observe": {"run_dir": str(tmp_path), "progress": False, "tensorboard": False},
    })
    backend = EmbeddedBackend(cfg, str(tiny_policy), resolve_loss(cfg)[0])
    from mixrl.runtime.backends.embedded.process import ProcessSampler

    asked: dict[str, Any] = {}
    start = ProcessSampler.start

    async def record(self: Any, *a: Any, engine_kw: Any = None, **kw: Any) -> Any:
        """What the built-in engine is asked to compute on; the worker itself starts on this
        GPU-less host without it (``device="cuda"`` would refuse: it sees no CUDA device)."""
        asked[self.name] = dict(engine_kw or {})
        return await start(self, *a, engine_kw={k: v for k, v in (engine_kw or {}).items() if k != "device"}, **kw)

    monkeypatch.setattr(ProcessSampler, "start", record)

    async def main() -> dict[str, Any]:
        try:
            for name in ("gpu/0", "gpu/1", "cpu/0"):
                await backend.make_sampler(name.split("/")[0], name)
            return {n: (await h.stats())["cuda_visible_devices"] for n, h in backend.samplers.items()}
        finally:
            await backend.shutdown()

    assert asyncio.run(main()) == {"gpu/0": "5", "gpu/1": "7", "cpu/0": ""}
    assert asked == {"gpu/0": {"device": "cuda"}, "gpu/1": {"device": "cuda"}, "cpu/0": {}}


def test_broadcast_refuses_two_nccl_ranks_that_may_share_a_device() -> None:
    from mixrl.runtime.backends.placement import check_broadcast

    def cfg(trainer_gpus: float, group_gpus: float) -> Any:
        return build_config({"model": {"path": "bundled"}, "runtime": {"ray": {"weight_transport": "broadcast"}},
                             "trainer": {"num_gpus": trainer_gpus},
                             "fleet": {"groups": [group("fp8", num_gpus=group_gpus)]}})

    with pytest.raises(ConfigError, match=r"^runtime.ray.weight_transport = \"broadcast\" with fractional GPUs "
                                          r"\(trainer.num_gpus=0.5, fleet.groups\[0\].num_gpus=0.5\)"):
        check_broadcast(cfg(0.5, 0.5))
    with pytest.raises(ConfigError, match="fractional GPUs"):
        check_broadcast(cfg(1, 0.25))
    check_broadcast(cfg(1, 1))  # whole GPUs: distinct devices
    check_broadcast(cfg(0, 0))  # gloo between CPU processes


@pytest.mark.ray
def test_each_ray_sampler_actor_sees_only_its_gpus(tiny_policy: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A local cluster declaring two (logical) GPUs: every replica of a num_gpus = 1 group gets
    its own, and a CPU replica none (Ray's assignment, read inside each actor)."""
    import secrets
    import shutil
    import tempfile

    ray = pytest.importorskip("ray")
    from mixrl.runtime.backends.ray_backend import RayBackend
    from mixrl.runtime.backends.ray_backend import auth as ray_auth
    from mixrl.runtime.run import resolve_loss

    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", secrets.token_hex(32))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    ray_auth.require_token_mode()
    cfg = build_config({
        "model": {"path": str(tiny_policy)}, "runtime": {"backend": "ray"},
        "fleet": {"groups": [
            {"name": "gpu", "profile": "fp32", "replicas": 2, "max_replicas": 2, "num_gpus": 1, "num_cpus": 0.5},
            {"name": "cpu", "profile": "fp32", "replicas": 1, "max_replicas": 1, "num_cpus": 0.5},
        ]},
        "observe": {"run_dir": str(tmp_path), "progress": False, "tensorboard": False},
    })
    temp = tempfile.mkdtemp(prefix="mixrl-ray-")  # short: Ray's socket paths live under it
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=temp)
    backend = RayBackend(cfg, str(tiny_policy), resolve_loss(cfg)[0])
    import mixrl.runtime.backends.ray_backend as rb

    asked: list[Any] = []
    real = rb.SamplerActor

    class Recorded:  # what the built-in engine is asked to compute on (logical GPUs: none to use)
        @staticmethod
        def options(**o: Any) -> Any:
            class Remote:
                @staticmethod
                def remote(*a: Any) -> Any:
                    asked.append(a[-1])
                    kw = {k: v for k, v in (a[-1] or {}).items() if k != "device"}
                    return real.options(**o).remote(*a[:-1], kw or None)
            return Remote

    monkeypatch.setattr(rb, "SamplerActor", Recorded)

    async def main() -> dict[str, Any]:
        try:
            for name in ("gpu/0", "gpu/1", "cpu/0"):
                await backend.make_sampler(name.split("/")[0], name)
            assert asked == [{"device": "cuda"}, {"device": "cuda"}, None]
            return {n: await h.actor.where.remote() for n, h in backend.samplers.items()}
        finally:
            for h in backend.samplers.values():
                await h.close()

    try:
        got = asyncio.run(main())
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
    gpu_ids = sorted(got[n]["gpu_ids"][0] for n in ("gpu/0", "gpu/1"))
    assert gpu_ids == ["0", "1"] and all(len(got[n]["gpu_ids"]) == 1 for n in ("gpu/0", "gpu/1"))
    for n in ("gpu/0", "gpu/1"):
        assert got[n]["cuda_visible_devices"] == got[n]["gpu_ids"][0]  # the actor sees its GPU only
    assert got["cpu/0"] == {"gpu_ids": [], "cuda_visible_devices": ""}  # on a GPU node: sees none


def test_built_in_groups_share_the_trainers_gpu_without_a_memory_fraction() -> None:
    """The built-in engine reserves nothing up front: beside a trainer it needs no
    gpu_memory_utilization (vLLM groups still do, and they still sum)."""
    cfg = cfg_with([group("fp8", profile="h100-fp8-scaled", cuda_devices=[0]),
                    group("bf16", profile="h100-bf16", cuda_devices=[0])], num_gpus=1)
    engines = {"fp8": "builtin", "bf16": "builtin"}
    assert check_gpu_plan(cfg, 1, engines) == {0: ["trainer", "fp8/0", "fp8/1", "fp8/2", "fp8/3",
                                                    "bf16/0", "bf16/1", "bf16/2", "bf16/3"]}
    with pytest.raises(ConfigError, match="gpu_memory_utilization: unset"):
        check_gpu_plan(cfg, 1)  # the same groups taken for vLLM ones
