"""Rollout buffer: group assembly, staleness, drop/requeue, order, checkpoint round trip."""

from __future__ import annotations

import pytest

from mixrl.records.trajectory import Trajectory
from mixrl.rollout.buffer import RolloutBuffer


def traj(pid: str, i: int, versions: list[int]) -> Trajectory:
    n = len(versions) + 2  # two prompt tokens, then generated ones
    return Trajectory(
        prompt_id=pid, sample_idx=i, tokens=list(range(n)), loss_mask=[0, 0] + [1] * len(versions),
        sampler_logprobs=[0.0] * n, versions=[-1, -1] + versions, groups=["", ""] + ["g"] * len(versions),
        reward=1.0,
    )


def test_docstring_worked_example() -> None:
    b = RolloutBuffer(2, max_staleness=1, policy="requeue")
    b.open("p0", {"prompt_id": "p0"})
    b.open("p1", {"prompt_id": "p1"})
    assert not b.add(traj("p0", 0, [0, 0]))
    assert not b.add(traj("p1", 0, [0]))
    assert b.add(traj("p0", 1, [0]))
    groups, m = b.take(1, trainer_version=0)
    assert [t.prompt_id for t in groups[0]] == ["p0", "p0"]
    assert m["rollout/staleness_mean"] == 0.0 and m["rollout/staleness_max"] == 0.0
    assert b.add(traj("p1", 1, [2, 2]))
    assert b.take(1, trainer_version=2) is None
    assert b.requeued() == [{"prompt_id": "p1"}] and b.requeued() == []
    assert b.counts["requeued_groups"] == 1


def test_staleness_is_over_generated_tokens_only() -> None:
    b = RolloutBuffer(2)
    b.open("p", {})
    b.add(traj("p", 0, [3, 3, 5]))  # staleness at v5: 2, 2, 0
    b.add(traj("p", 1, [4]))  # 1
    _, m = b.take(1, trainer_version=5)
    assert m["rollout/staleness_mean"] == pytest.approx(5 / 4)
    assert m["rollout/staleness_max"] == 2.0


def test_drop_policy_and_unbounded_default() -> None:
    for bound, expect in ((None, 1), (0, 0)):
        b = RolloutBuffer(1, max_staleness=bound, policy="drop")
        b.open("p", {})
        b.add(traj("p", 0, [0]))
        got = b.take(1, trainer_version=10)
        assert (0 if got is None else len(got[0])) == expect
        assert b.counts["dropped_groups"] == 1 - expect


def test_oldest_issued_first_regardless_of_completion_order() -> None:
    b = RolloutBuffer(1)
    for p in ("a", "b", "c"):
        b.open(p, {})
    for p in ("c", "a", "b"):
        b.add(traj(p, 0, [0]))
    groups, _ = b.take(2, 0)
    assert [g[0].prompt_id for g in groups] == ["a", "b"]


def test_rejects_duplicates_and_unknown_prompts() -> None:
    b = RolloutBuffer(2)
    b.open("p", {})
    b.add(traj("p", 0, [0]))
    with pytest.raises(ValueError, match="duplicate"):
        b.add(traj("p", 0, [0]))
    with pytest.raises(ValueError, match="not open"):
        b.add(traj("q", 0, [0]))
    with pytest.raises(ValueError, match="sample_idx"):
        b.add(traj("p", 2, [0]))
    with pytest.raises(ValueError, match="already"):
        b.open("p", {})


def test_state_dict_round_trip() -> None:
    b = RolloutBuffer(2, max_staleness=3, policy="requeue")
    b.open("p", {"x": 1})
    b.open("q", {"x": 2})
    b.add(traj("p", 1, [0]))
    b.add(traj("q", 0, [0]))
    b.add(traj("q", 1, [1]))
    c = RolloutBuffer(2, max_staleness=3, policy="requeue")
    c.load_state_dict(b.state_dict())
    assert c.missing("p") == [0] and c.num_complete() == 1 and c.open_prompts() == ["p"]
    c.add(traj("p", 0, [1]))
    groups, _ = c.take(2, 1)
    assert [g[0].prompt_id for g in groups] == ["p", "q"]
