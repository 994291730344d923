"""Router: capacity-weighted sticky group choice, least-loaded replica, ready-only traffic."""

from __future__ import annotations

import pytest

from mixrl.fleet.autoscaler import decide
from mixrl.fleet.router import FAILED, READY, NoReplicaAvailable, Router


def make(throughput: dict[str, float], replicas: dict[str, int]) -> Router:
    r = Router(throughput, seed=0)
    for g, n in replicas.items():
        for i in range(n):
            r.add(f"{g}/{i}", g)
            r.set_state(f"{g}/{i}", READY)
    return r


def test_group_shares_follow_capacity() -> None:
    r = make({"fast": 3.0, "slow": 1.0}, {"fast": 1, "slow": 2})  # capacity 3 : 2
    n = 5000
    fast = sum(r.pin(f"s{i}") == "fast" for i in range(n))
    # binomial(5000, 0.6): sd ~ 35; 5 sd bounds
    assert abs(fast - 0.6 * n) < 5 * (n * 0.6 * 0.4) ** 0.5


def test_sticky_and_least_loaded() -> None:
    r = make({"a": 1.0}, {"a": 3})
    first = r.pick("s")
    first.inflight += 1
    second = r.pick("t")
    assert second.name != first.name
    assert all(r.pin("s") == "a" for _ in range(10))
    assert all(r.pick("s").name == first.name for _ in range(5))  # sticky replica
    r.set_state(first.name, FAILED)
    assert r.pick("s").name != first.name


def test_only_ready_replicas_and_repin_after_failure() -> None:
    r = make({"a": 1.0, "b": 1.0}, {"a": 1, "b": 1})
    r.add("a/9", "a")  # catching up: never picked
    g = r.pin("s")
    for _ in range(20):
        assert r.pick("x").name != "a/9"
    r.set_state(f"{g}/0", FAILED)
    other = "b" if g == "a" else "a"
    assert r.pick("s").group == other and r.pin("s") == other
    r.set_state(f"{other}/0", FAILED)
    with pytest.raises(NoReplicaAvailable):
        r.pick("s")


def test_pick_excludes_and_falls_back_to_another_group() -> None:
    r = make({"a": 1.0, "b": 1.0}, {"a": 1, "b": 1})
    g = r.pin("s")
    got = r.pick("s", exclude={f"{g}/0"})
    assert got.group != g


def test_autoscaler_decision() -> None:
    assert decide(load=40, live=1, lo=1, hi=3, target=16, tolerance=0.5) == 1
    assert decide(load=40, live=3, lo=1, hi=3, target=16, tolerance=0.5) == 0
    assert decide(load=2, live=2, lo=1, hi=3, target=16, tolerance=0.5) == -1
    assert decide(load=2, live=1, lo=1, hi=3, target=16, tolerance=0.5) == 0
    assert decide(load=16, live=2, lo=1, hi=3, target=16, tolerance=0.5) == 0
