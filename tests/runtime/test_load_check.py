"""``fleet.check_loads``: every replica proves after every load that it serves the version it loaded."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest

from mixrl.fleet.load_check import FACTOR, SLACK, LoadCheck, StaleWeights
from mixrl.records.generation import GenerationResult

from .test_run import metrics, tiny_cfg


class _Replica:
    """Samples token ``tok`` with log q ``lq`` (a planted answer, for the bound's arithmetic)."""

    def __init__(self, tok: int, lq: float, version: int) -> None:
        self.tok, self.lq, self.version = tok, lq, version

    async def generate(self, req):  # type: ignore[no-untyped-def]
        return GenerationResult(token_ids=[self.tok], logprobs=[self.lq], cand_offsets=[0, 0], cand_ids=[],
                                cand_logprobs=[], cand_kind="none", finish_reason="length", version=self.version,
                                group="g")


def test_the_bound_is_the_groups_first_deviation_times_factor_plus_slack() -> None:
    check = LoadCheck(vocab_size=16)
    lp = [[math.log(1 / 16)] * 16 for _ in check.prompts]
    check.expect(0, lp)
    d0 = 0.01
    assert asyncio.run(check.after_load("r0", "g", _Replica(3, math.log(1 / 16) + d0, 0), 0)) == pytest.approx(d0)
    check.expect(1, lp)
    ok = FACTOR * d0 + SLACK - 1e-9  # just inside the bound, computed here in float64
    assert asyncio.run(check.after_load("r0", "g", _Replica(5, math.log(1 / 16) - ok, 1), 1)) == pytest.approx(ok)
    check.expect(2, lp)
    with pytest.raises(StaleWeights, match="replica r0 does not serve weights version 2"):
        asyncio.run(check.after_load("r0", "g", _Replica(5, math.log(1 / 16) - ok - 1e-6, 2), 2))
    assert check.failure is not None
    with pytest.raises(StaleWeights, match="answered with version 1"):
        asyncio.run(LoadCheck(16)._fail("r1", 2, "answered with version 1"))  # type: ignore[func-returns-value]


def _cfg(tiny_policy: Path, run_dir: Path):  # type: ignore[no-untyped-def]
    return tiny_cfg(tiny_policy, run_dir, fleet={"check_loads": True},
                    runtime={"steps": 3, "mode": "sync", "sampler_workers": "thread"})


def test_a_run_checks_every_load_of_every_group(tiny_policy: Path, tmp_path: Path) -> None:
    from mixrl.runtime.run import train

    cfg = _cfg(tiny_policy, tmp_path / "run")
    cfg.runtime.sampler_workers = "process"  # the worker processes' loads are checked the same way
    train(cfg, evaluate=False)
    rows = metrics(tmp_path / "run")
    for g in ("fp32", "fp8"):
        devs = [r[f"fleet/load_check/max_abs_logq/{g}"] for r in rows]
        assert len(devs) == 3 and all(math.isfinite(d) for d in devs), devs
    assert max(r["fleet/load_check/max_abs_logq/fp32"] for r in rows) < 1e-3  # FP32 sampler = FP32 trainer


def test_a_replica_that_keeps_old_weights_stops_the_run(tiny_policy: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A planted fault: the fp32 group's engine takes the new version number but keeps its weights."""
    from mixrl.runtime.orchestrator import RunError
    from mixrl.runtime.run import train
    from mixrl.sampling.builtin.engine import BuiltinEngine

    real = BuiltinEngine.load_weights

    def stale(self, state_dict, version):  # type: ignore[no-untyped-def]
        if self.group == "fp32" and version > 0:
            self.version = version  # says it serves the new version...
            return  # ...and keeps the old weights
        real(self, state_dict, version)

    monkeypatch.setattr(BuiltinEngine, "load_weights", stale)
    cfg = _cfg(tiny_policy, tmp_path / "run")
    cfg.optim.lr = 3e-2  # weights that move at once
    with pytest.raises(RunError, match=r"replica fp32/\d+ does not serve weights version \d+"):
        train(cfg, evaluate=False)
