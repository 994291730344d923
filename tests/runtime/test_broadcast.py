"""Weights by broadcast over gloo on CPU (the NCCL path differs only in device and backend).

- a channel (two-rank group on a private store) carries versions bit-exact, the layout
  only when it changes; ``Sender`` holds the newest versions, packed once, says in-band
  when a version was evicted (the fleet then loads the newest), and closing a channel
  ends a send waiting for its replica;
- a Ray run with ``runtime.ray.weight_transport = "broadcast"``: every replica receives
  its versions over its own channel from the trainer actor, a replica killed mid-run is
  replaced (its channel alone is lost) and the run completes with nothing lost.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from mixrl.weights.broadcast import Sender, WeightBroadcast, join, listen, open_channel


def _versions() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    base = {"a.weight": torch.randn(3, 5, generator=g), "b.bias": torch.randn(7, generator=g).to(torch.bfloat16),
            "empty": torch.zeros(0), "step": torch.tensor(3, dtype=torch.int64)}
    v2 = {k: v + 1 for k, v in base.items()}
    v3 = {**v2, "c.weight": torch.randn(2, 2, generator=g)}  # a new layout
    return [base, v2, v3]


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return set(got) == set(want) and all(
        got[k].dtype == want[k].dtype and got[k].shape == want[k].shape and torch.equal(got[k], want[k]) for k in want)


def test_a_channel_carries_versions_bit_exact_and_the_layout_only_when_it_changes() -> None:
    store = listen("127.0.0.1", timeout_s=30)
    received: list[dict[str, torch.Tensor]] = []
    layouts: list[Any] = []

    def replica() -> None:
        wb = join("127.0.0.1", int(store.port))
        for _ in range(3):
            received.append(wb.recv())
            layouts.append(wb.layout)

    t = threading.Thread(target=replica)
    t.start()
    sender = WeightBroadcast(open_channel(0, store=store, timeout_s=30), src=0)
    sent_layout_bytes = []
    real = sender._bcast

    def counting(x: torch.Tensor) -> None:
        if x.dtype == torch.int64 and x.numel() == 2:
            sent_layout_bytes.append(int(x[0]))  # the header: layout bytes that follow, buffer size
        real(x)

    sender._bcast = counting  # type: ignore[method-assign]
    for sd in _versions():
        sender.send(sd)
    t.join(timeout=30)
    assert len(received) == 3 and all(_same(g, w) for g, w in zip(received, _versions(), strict=True))
    assert sent_layout_bytes[0] > 0 and sent_layout_bytes[1] == 0 and sent_layout_bytes[2] > 0
    assert layouts[0] is layouts[1] and layouts[2] is not layouts[1]


def test_sender_holds_the_newest_versions_and_names_what_it_lacks() -> None:
    s = Sender(keep=2)
    for v in (1, 2, 3):
        s.hold(v, _versions()[0])
    assert sorted(s.held) == [2, 3]
    with pytest.raises(KeyError, match="no weights channel to replica 'a/0'"):
        s.send("a/0", 3)


def _joined(s: Sender, name: str, n: int) -> tuple[threading.Thread, list[Any]]:
    """Replica ``name``'s end of a channel in a thread, receiving ``n`` versions."""
    host, port = s.open(name, "127.0.0.1")
    got: list[Any] = []

    def replica() -> None:
        wb = join(host, port)
        got.extend(wb.recv() for _ in range(n))

    t = threading.Thread(target=replica)
    t.start()
    return t, got


def test_sender_packs_a_version_once_and_says_in_band_when_it_was_evicted() -> None:
    s = Sender(keep=2)
    v1, v2, v3 = _versions()
    s.hold(1, v1)
    packed = s.held[1][1]
    ta, got_a = _joined(s, "a/0", 3)
    tb, got_b = _joined(s, "b/0", 1)
    assert s.send("a/0", 1) and s.send("b/0", 1)
    assert s.held[1][1] is packed  # both replicas were sent the one buffer packed at hold
    s.hold(2, v2)
    s.hold(3, v3)  # evicts 1
    assert s.send("a/0", 1) is False  # evicted: the replica is told, not left waiting
    assert s.send("a/0", 3)  # and the channel still carries the next version exactly
    ta.join(timeout=30)
    tb.join(timeout=30)
    assert _same(got_a[0], v1) and _same(got_b[0], v1)
    assert got_a[1] is None and _same(got_a[2], v3)


def test_closing_a_channel_wakes_a_send_waiting_for_its_replica() -> None:
    # A replica that died before joining its channel once held the trainer's send for the
    # full channel timeout (300 s); closing the channel now ends that wait at once.
    s = Sender()
    s.hold(1, _versions()[0])
    s.open("gone/0", "127.0.0.1")  # nobody joins
    err: list[BaseException] = []

    def send() -> None:
        try:
            s.send("gone/0", 1)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            err.append(e)

    t = threading.Thread(target=send)
    t.start()
    time.sleep(0.3)
    s.close("gone/0")
    t.join(timeout=5)
    assert not t.is_alive() and err and isinstance(err[0], KeyError), err


def test_the_fleet_loads_the_newest_version_when_a_load_was_superseded(tiny_policy: Path) -> None:
    from transformers import AutoModelForCausalLM

    from mixrl.config import build_config
    from mixrl.fleet.fleet import Fleet, GroupSpec
    from mixrl.fleet.handles import Superseded
    from mixrl.runtime.backends.embedded import EmbeddedBackend
    from mixrl.weights.store import WeightStore, copy_state_dict

    async def main() -> None:
        cfg = build_config({"fleet": {"groups": [{"name": "a", "profile": "fp32", "replicas": 1}]},
                            "runtime": {"sampler_workers": "thread"}})
        backend = EmbeddedBackend(cfg, str(tiny_policy), None)
        fleet: Fleet
        asked: list[int] = []

        async def make(group: str, name: str) -> Any:
            h = await backend.make_sampler(group, name)
            real = h.load_weights

            async def load_weights(ref: Any, version: int) -> None:
                asked.append(version)
                if version == 1:  # the source evicted 1 before this replica's turn; 2 is out
                    fleet.publish(2, copy_state_dict(sd))
                    raise Superseded("version 1 is gone")
                await real(ref, version)

            h.load_weights = load_weights
            return h

        fleet = Fleet([GroupSpec("a", 1.0, 1, 0, 4)], make, WeightStore(), seed=0)
        sd = AutoModelForCausalLM.from_pretrained(str(tiny_policy)).state_dict()
        fleet.publish(0, copy_state_dict(sd))
        await fleet.start()
        fleet.publish(1, copy_state_dict(sd))
        await asyncio.wait_for(fleet.wait_synced(2), timeout=120)
        assert asked == [0, 1, 2] and fleet.versions["a/0"] == 2
        assert fleet.counts["replica_failures"] == 0  # superseded is not a failure
        await fleet.close()

    asyncio.run(main())


@pytest.mark.ray
def test_ray_run_over_broadcast_channels_survives_a_killed_replica(tiny_policy: Path, tmp_path: Path) -> None:
    pytest.importorskip("ray")
    from mixrl.runtime.run import train

    from .test_run import B, G, assert_complete_and_unique, metrics, tiny_cfg

    seen: dict[str, Any] = {}

    async def hook(orch: Any) -> None:
        async def chaos() -> None:
            while orch.step < 1:
                await asyncio.sleep(0.01)
            seen["joined"] = {n: h._joined for n, h in orch.backend.samplers.items()}
            seen["stored"] = type(orch.fleet.store.get()[1]).__name__
            orch.backend.kill("fp32/0")

        asyncio.ensure_future(chaos())

    cfg = tiny_cfg(tiny_policy, tmp_path, runtime={"steps": 3, "backend": "ray", "checkpoint_every": 0,
                                                    "ray": {"weight_transport": "broadcast"}})
    s = train(cfg, evaluate=False, hook=hook)
    assert s["steps"] == 3
    assert seen["stored"] == "Broadcast"  # the store holds version numbers, not object references
    assert seen["joined"] and all(seen["joined"].values()), seen  # every replica has its channel
    assert_complete_and_unique(tmp_path, 3)
    ms = metrics(tmp_path)
    assert ms[-1]["fleet/replica_failures"] >= 1
    assert sum(m["rollout/infra_failed"] for m in ms) == 0
    assert sum(m["rollout/episodes"] for m in ms) == 3 * B * G
