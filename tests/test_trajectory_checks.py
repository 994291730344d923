"""One verdict per trajectory: the fleet, the advantages' screening and the trainer agree.

A sampled token's log q slightly above 0 is float rounding up to ``LOGPROB_TOL``
and a broken record beyond it, for every layer: the fleet's check of the result
(retried elsewhere when broken), the trajectory's own check (``Trajectory.check``),
the screening before advantages, and the trainer's conversion.
"""

from __future__ import annotations

import pytest

from mixrl.config.loss import LossConfig
from mixrl.fleet.fleet import check_result
from mixrl.records.generation import GenerationRequest, GenerationResult, SamplingParams
from mixrl.records.trajectory import LOGPROB_TOL, Trajectory
from mixrl.rollout.advantages import batch_advantages
from mixrl.train.batch import prepare

V = 16
PARAMS = SamplingParams(max_new_tokens=4)


def _episode(lq: float, idx: int, reward: float) -> tuple[Trajectory, str]:
    req = GenerationRequest([1, 2], PARAMS, f"p/{idx}/0")
    res = GenerationResult([3, 4], [-0.2, lq], [0, 0, 0], [], [], "none", 0, "g", "stop")
    t = Trajectory("p", idx, reward=reward)
    t.append_env(req.prompt_ids)
    t.append_generated(res, req.params)
    return t, check_result(res, req)


@pytest.mark.parametrize(("lq", "usable"), [(-0.5, True), (1e-7, True), (5e-5, True), (LOGPROB_TOL, True),
                                            (2e-4, False), (0.5, False)])
def test_a_sampled_log_q_gets_one_verdict_everywhere(lq: float, usable: bool) -> None:
    t, fleet = _episode(lq, 0, 1.0)
    assert (fleet == "") == usable  # the fleet's check of the engine's result
    assert (t.check(V, "none") is None) == usable  # the trajectory's own check
    fresh = Trajectory.from_dict(t.to_dict())
    other, _ = _episode(-0.3, 1, 0.0)
    _, adv, m = batch_advantages([[t, other]], LossConfig(), vocab_size=V, cand_kind="none")
    assert m["rollout/malformed"] == (0.0 if usable else 1.0)  # screened before the group statistics
    assert (adv[0] != 0.0) == usable
    for tr in (t, fresh):  # the verdict kept by screening, and one computed by the trainer itself
        records, stats = prepare([tr], [1.0], vocab_size=V)
        assert len(records) == int(usable) and stats.dropped_malformed == int(not usable)
        if not usable:
            assert "positive log-probability" in stats.errors[0]


def test_the_verdict_is_computed_once_and_travels_with_the_record() -> None:
    t, _ = _episode(0.5, 0, 1.0)
    assert t.verdict is None and t.screen(V, "none") is not None and t.verdict
    t.sampler_logprobs[-1] = -0.5  # later readers take the verdict, they do not check again
    assert t.screen(V, "none") == t.verdict and Trajectory.from_dict(t.to_dict()).screen(V, "none") == t.verdict
    ok, _ = _episode(-0.5, 1, 1.0)
    assert ok.screen(V, "none") is None and ok.verdict == ""
