"""Fair shares between clients (``serve.fair.FairGate``): round robin, bounded queues, headroom."""

from __future__ import annotations

import asyncio

import pytest

from mixrl.serve.fair import FairGate, QueueFull


async def _hold(gate: FairGate, client: str, release: asyncio.Event, order: list[str]) -> None:
    async with gate.slot(client):
        order.append(client)
        await release.wait()


def test_one_slot_is_given_round_robin() -> None:
    async def main() -> list[str]:
        gate, order, holders = FairGate(capacity=1, reserve=0, max_queued=10), [], []

        async def hold(client: str) -> None:
            ev = asyncio.Event()
            async with gate.slot(client):
                order.append(client)
                holders.append(ev)
                await ev.wait()

        tasks = []
        for client, n in (("a", 4), ("b", 3), ("c", 1)):  # a queues first and most
            gate.admit(client, n)
            tasks += [asyncio.ensure_future(hold(client)) for _ in range(n)]
        for i in range(8):  # the holder ends; the slot goes to the next client in turn
            for _ in range(10):
                await asyncio.sleep(0)
            assert len(order) == i + 1 and gate.total == 1
            holders[-1].set()
        await asyncio.gather(*tasks)
        assert gate.total == 0 and not gate.held and not gate.waiting and not gate.queued
        return order

    assert asyncio.run(main()) == ["a", "b", "c", "a", "b", "a", "b", "a"]


def test_a_clients_queue_is_bounded() -> None:
    gate = FairGate(capacity=2, max_queued=16)
    gate.admit("a", 16)
    with pytest.raises(QueueFull):
        gate.admit("a", 1)
    gate.admit("b", 16)  # another client's queue is its own


def test_headroom_lets_a_light_client_in_at_once() -> None:
    async def main() -> None:
        gate, order, release = FairGate(capacity=8, reserve=2, max_queued=100), [], asyncio.Event()
        gate.admit("heavy", 20)
        heavy = [asyncio.ensure_future(_hold(gate, "heavy", release, order)) for _ in range(20)]
        await asyncio.sleep(0)
        assert gate.held["heavy"] == 6  # capacity - reserve: it is past its share of the last two
        gate.admit("light", 2)
        light = [asyncio.ensure_future(_hold(gate, "light", release, order)) for _ in range(2)]
        await asyncio.sleep(0)
        assert gate.held["light"] == 2 and gate.total == 8  # both started without waiting for a slot
        release.set()
        await asyncio.gather(*heavy, *light)
        assert order.count("heavy") == 20 and gate.total == 0

    asyncio.run(main())


def test_a_cancelled_waiter_gives_its_place_back() -> None:
    async def main() -> None:
        gate, order, release = FairGate(capacity=1, reserve=0, max_queued=4), [], asyncio.Event()
        gate.admit("a", 3)
        first = asyncio.ensure_future(_hold(gate, "a", release, order))
        second = asyncio.ensure_future(_hold(gate, "a", release, order))
        third = asyncio.ensure_future(_hold(gate, "a", release, order))
        await asyncio.sleep(0)
        second.cancel()
        await asyncio.sleep(0)
        release.set()
        await asyncio.gather(first, third)
        assert second.cancelled() and order == ["a", "a"] and gate.total == 0 and not gate.queued

    asyncio.run(main())
