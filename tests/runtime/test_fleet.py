"""Fleet over real tiny engines: catch-up before traffic, failures, malformed results, scaling."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import torch

from mixrl.config import build_config
from mixrl.fleet.fleet import Fleet, GroupSpec, SessionFailed
from mixrl.fleet.router import READY, NoReplicaAvailable
from mixrl.records.generation import GenerationRequest, SamplingParams
from mixrl.runtime.backends.embedded import EmbeddedBackend
from mixrl.weights.store import WeightStore, copy_state_dict


def _setup(path: Path, replicas: dict[str, int]) -> tuple[EmbeddedBackend, Fleet, dict]:
    from transformers import AutoModelForCausalLM

    groups = [{"name": g, "profile": p, "replicas": n, "min_replicas": 0, "max_replicas": 4}
              for g, (p, n) in replicas.items()]
    cfg = build_config({"fleet": {"groups": groups}})
    backend = EmbeddedBackend(cfg, str(path), None)
    specs = [GroupSpec(g.name, 1.0, g.replicas, 0, 4) for g in cfg.fleet.groups]
    fleet = Fleet(specs, backend.make_sampler, WeightStore(), seed=0, max_retries=4)
    sd = AutoModelForCausalLM.from_pretrained(str(path)).state_dict()
    return backend, fleet, sd


def req(i: int) -> GenerationRequest:
    return GenerationRequest([4, 20 + i, 30, 5], SamplingParams(max_new_tokens=6, seed=i), request_id=f"r{i}")


def test_failover_malformed_and_catch_up(tiny_policy: Path) -> None:
    async def main() -> None:
        backend, fleet, sd = _setup(tiny_policy, {"a": ("fp32", 1), "b": ("h100-fp8", 1)})
        fleet.publish(0, copy_state_dict(sd))
        await fleet.start()
        assert all(r.state == READY for r in fleet.router.replicas.values())
        assert fleet.versions == {"a/0": 0, "b/0": 0}
        # A new version: every replica serves it; the latency is recorded.
        sd1 = {k: v + 0.01 for k, v in sd.items()}
        fleet.publish(1, sd1)
        await fleet.wait_synced(1)
        assert set(fleet.versions.values()) == {1} and 1 in fleet.store.latencies
        res = await fleet.generate("s0", req(0))
        assert res.version == 1
        # Kill the replica the session is pinned to: the same request completes elsewhere.
        pinned = fleet.router.pin("s1")
        backend.kill(f"{pinned}/0")
        res = await fleet.generate("s1", req(1))
        assert res.group != pinned and fleet.counts["replica_failures"] == 1
        # A replacement replica is started and serves only after catching up.
        deadline = time.monotonic() + 600  # a worker process starts in seconds, minutes on a loaded machine
        while time.monotonic() < deadline and len(fleet.router.ready(pinned)) != 1:
            await asyncio.sleep(0.05)
        new = fleet.router.ready(pinned)[0]
        assert new.name == f"{pinned}/1" and fleet.versions[new.name] == 1
        # Malformed results (NaN log-prob, missing log-prob) are rejected, counted and retried.
        for name in list(fleet.handles):
            backend.corrupt(name, 1)
        res = await fleet.generate("s2", req(2))
        assert all(torch.isfinite(torch.tensor(res.logprobs)))
        assert len(res.logprobs) == len(res.token_ids)
        assert fleet.counts["malformed_results"] >= 1
        # Scale up and down mid-run through the API.
        name = await fleet.add_replica("a")
        assert fleet.versions[name] == 1 and fleet.live("a") == len(fleet.router.ready("a"))
        await fleet.remove_replica(name)
        assert name not in fleet.handles
        # Every replica dead and no restart: the session fails loudly (it becomes infra_failed upstream).
        fleet.restart_failed = False
        fleet.wait_for_replica_s = 0.2
        for name in list(fleet.handles):
            backend.kill(name)
        try:
            await fleet.generate("s3", req(3))
        except Exception as e:  # noqa: BLE001
            assert isinstance(e, SessionFailed | NoReplicaAvailable), e
        else:
            raise AssertionError("generate succeeded with every replica dead")
        await fleet.close()

    asyncio.run(main())


def test_autoscaler_scales_a_group_up_and_down(tiny_policy: Path) -> None:
    from mixrl.fleet.autoscaler import Autoscaler

    async def main() -> None:
        backend, fleet, sd = _setup(tiny_policy, {"a": ("fp32", 1)})
        fleet.specs["a"].min_replicas = 1
        fleet.publish(0, copy_state_dict(sd))
        await fleet.start()
        scaler = Autoscaler(fleet, target=4, tolerance=0.5)
        fleet.router.replicas["a/0"].inflight = 10  # load 10 per replica > 4 * 1.5
        await scaler.tick()
        await asyncio.gather(*fleet._sync_tasks.values())
        assert fleet.live("a") == 2 and fleet.versions["a/1"] == 0  # caught up before serving
        fleet.router.replicas["a/0"].inflight = 0  # idle: load 0 < 4 * 0.5
        await scaler.tick()
        for _ in range(100):
            if len(fleet.router.replicas) == 1:
                break
            await asyncio.sleep(0.02)
        assert fleet.live("a") == 1 and scaler.events == [("a", 1), ("a", -1)]
        await scaler.tick()  # at min_replicas: no further removal
        assert fleet.live("a") == 1
        await fleet.close()

    asyncio.run(main())


def test_process_replicas_quantize_once_per_version_and_format(tiny_policy: Path) -> None:
    """Two worker processes of one NVFP4 group: the version is quantized once (by whichever
    worker asks first), both serve exactly what an engine quantizing on load serves, and a
    BF16 group's worker builds its own format of the same version."""
    from mixrl.runtime.backends.embedded import EmbeddedBackend
    from mixrl.runtime.backends.embedded.threads import group_profile, replica_seed
    from mixrl.sampling.factory import make_engine
    from mixrl.weights.shared import SharedVersion

    fp32 = {"compute_dtype": "float32"}
    groups = [{"name": "q", "profile": "b200-nvfp4", "replicas": 2, "overrides": fp32},
              {"name": "h", "profile": "b200-bf16", "replicas": 1, "overrides": fp32}]
    cfg = build_config({"fleet": {"groups": groups}, "runtime": {"torch_threads": 1}})
    from transformers import AutoModelForCausalLM

    sd = AutoModelForCausalLM.from_pretrained(str(tiny_policy)).state_dict()
    sd = {k: v + 0.003 * torch.randn_like(v) for k, v in sd.items()}  # a version the checkpoint is not
    reqs = [req(i) for i in range(3)]

    quant_calls: list[str] = []

    async def main() -> tuple[SharedVersion, dict]:
        backend = EmbeddedBackend(cfg, str(tiny_policy), None, workers="process")
        try:
            hs = [await backend.make_sampler("q", f"q/{i}") for i in range(2)] + [await backend.make_sampler("h", "h/0")]
            for h in hs:  # count the quantizations the workers are asked for
                def counted(kind: str, payload: object, h=h, call=h._call) -> object:  # type: ignore[no-untyped-def]
                    if kind == "quant":
                        quant_calls.append(h.group)
                    return call(kind, payload)

                h._call = counted  # type: ignore[method-assign]
            sv = SharedVersion.from_state_dict(sd)
            await asyncio.gather(*(h.load_weights(sv, 1) for h in hs))
            out = {h.name: [await h.generate(r) for r in reqs] for h in hs}
            return sv, out
        finally:
            await backend.shutdown()

    sv, out = asyncio.run(main())
    assert sorted(quant_calls) == ["h", "q"]  # one quantization per format, not per replica
    assert sorted(sv.quantize_s) == ["bf16", "nvfp4"]
    # the format's manifest: the changed weights in its own file, the rest mapping the base file
    base, q = sv.manifest(), sv.manifest("nvfp4")
    assert q["model.embed_tokens.weight"] == base["model.embed_tokens.weight"]
    assert q["model.layers.0.mlp.down_proj.weight"][0] != base["model.layers.0.mlp.down_proj.weight"][0]
    for group, names in (("q", ["q/0", "q/1"]), ("h", ["h/0"])):
        own = make_engine(str(tiny_policy), group_profile(cfg, group), group, seed=replica_seed(cfg.runtime.seed, names[0]))
        own.load_weights(sd, 1)
        want = [own.generate_batch([r])[0] for r in reqs]
        for n in names:
            assert [r.token_ids for r in out[n]] == [r.token_ids for r in want], n
            for a, b in zip(out[n], want, strict=True):
                torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=0)
    sv.retire()
    assert not any(p.exists() for p in sv._files)


def test_a_weights_load_error_fails_the_replica_never_a_stall(tiny_policy: Path) -> None:
    # A load error that is not a ReplicaFailure (an engine rejecting a state dict with a
    # ValueError, as vLLM's loader does) once ended the catch-up task silently, and
    # wait_synced then waited forever. The replica's handle is real; its engine's loader
    # is made to raise for version 1.
    from transformers import AutoModelForCausalLM

    async def main() -> None:
        cfg = build_config({"fleet": {"groups": [{"name": "a", "profile": "fp32", "replicas": 1}]},
                            "runtime": {"sampler_workers": "thread"}})
        backend = EmbeddedBackend(cfg, str(tiny_policy), None)

        async def make(group: str, name: str) -> Any:
            h = await backend.make_sampler(group, name)
            real = h.load_weights

            async def load_weights(ref: Any, version: int) -> None:
                if version >= 1:
                    raise ValueError("state_dict does not match the engine's checkpoint")
                await real(ref, version)

            h.load_weights = load_weights
            return h

        fleet = Fleet([GroupSpec("a", 1.0, 1, 0, 4)], make, WeightStore(), seed=0)
        fleet.restart_failed = False
        sd = AutoModelForCausalLM.from_pretrained(str(tiny_policy)).state_dict()
        fleet.publish(0, copy_state_dict(sd))
        await fleet.start()
        fleet.publish(1, copy_state_dict(sd))
        await asyncio.wait_for(fleet.wait_synced(1), timeout=120)
        assert fleet.counts["replica_failures"] == 1
        assert "a/0" not in fleet.handles
        await fleet.close()

    asyncio.run(main())


def test_a_replica_that_dies_idle_fails_over_without_a_request(tiny_policy: Path) -> None:
    """The health watch finds a dead replica that no request or load touches."""
    async def main() -> None:
        backend, fleet, sd = _setup(tiny_policy, {"a": ("fp32", 2)})
        fleet.health_s, fleet.restart_failed = 0.05, False
        fleet.publish(0, copy_state_dict(sd))
        await fleet.start()
        backend.kill("a/0")
        deadline = time.monotonic() + 30
        while fleet.counts["replica_failures"] < 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert fleet.counts["replica_failures"] == 1
        assert "a/0" not in fleet.handles and "a/1" in [r.name for r in fleet.router.ready("a")]
        await fleet.close()
        await backend.shutdown()

    asyncio.run(main())
