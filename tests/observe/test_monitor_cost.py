import math
import random

import pytest

from mixrl.fleet.cost import CostModel, GroupPrice
from mixrl.telemetry.monitor import CollapseMonitor, MonitorConfig


def _run(series):
    mon = CollapseMonitor(MonitorConfig(early_steps=5, warmup_steps=5))
    events = []
    for step, m in enumerate(series, 1):
        events += mon.update(step, m)
    return mon, events


def _stable(n=80, seed=0):
    rng = random.Random(seed)
    return [
        {
            "rollout/reward": 0.4 + 0.1 * min(i, 40) / 40 + rng.gauss(0, 0.05),
            "mismatch/kl_k3": 2e-3 * (1 + rng.gauss(0, 0.15)),
            "rollout/format_error_end": max(0.0, rng.gauss(0.05, 0.02)),
        }
        for i in range(n)
    ]


def _collapsing(n=80, seed=0):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        t = max(0, i - 30) / 50  # collapse starts at step 31
        out.append({
            "rollout/reward": 0.5 - 0.45 * t + rng.gauss(0, 0.03),
            "mismatch/kl_k3": 2e-3 * (1 + 6 * t) * (1 + rng.gauss(0, 0.1)),
            "rollout/format_error_end": min(1.0, 0.05 + 0.9 * t),
        })
    return out


@pytest.mark.parametrize("seed", range(5))
def test_monitor_quiet_on_stable_series(seed):
    mon, events = _run(_stable(seed=seed))
    assert not mon.collapsed
    assert events == []


@pytest.mark.parametrize("seed", range(5))
def test_monitor_fires_on_collapsing_series(seed):
    mon, events = _run(_collapsing(seed=seed))
    assert mon.collapsed
    assert 31 < mon.first_collapse_step < 80
    fired = {e["signal"] for e in events if e["active"]}
    assert fired == {"reward_drop", "kl_growth", "format_errors", "collapse"}
    kl_event = next(e for e in events if e["signal"] == "kl_growth")
    assert kl_event["kl_growth"] >= 3.0


def test_monitor_prefers_exact_kl_and_ignores_k1():
    mon = CollapseMonitor()
    mon.update(1, {"mismatch/kl_k1": -5.0, "mismatch/kl_k3": 1e-3, "mismatch/kl_exact": 2e-3})
    assert mon.kl_key == "mismatch/kl_exact"
    assert mon.kl_ema == pytest.approx(2e-3)


def test_monitor_state_roundtrip():
    series = _collapsing()
    a, _ = _run(series[:40])
    b = CollapseMonitor(MonitorConfig(early_steps=5, warmup_steps=5))
    b.load_state_dict(a.state_dict())
    for step, m in enumerate(series[40:], 41):
        a.update(step, m)
        b.update(step, m)
    assert a.summary() == b.summary()


def test_monitor_config_errors_name_field():
    with pytest.raises(ValueError, match="kl_factor"):
        MonitorConfig(kl_factor=1.0)
    with pytest.raises(ValueError, match="ema"):
        MonitorConfig(ema=0.0)


def test_cost_per_group_sums_to_total():
    cm = CostModel({"a": GroupPrice(3.6, 1000.0), "b": GroupPrice(7.2, 4000.0)})
    m = cm.update({"a": 2000, "b": 4000})
    # a: 2 GPU-s at $3.6/h = 0.002; b: 1 GPU-s at $7.2/h = 0.002
    assert m["cost/update/a"] == pytest.approx(0.002)
    assert m["cost/update/b"] == pytest.approx(0.002)
    assert m["cost/update"] == pytest.approx(0.004)
    m = cm.update({"a": 1000})
    assert m["cost/update"] == pytest.approx(0.001)
    assert m["cost/cumulative"] == pytest.approx(0.005)
    assert math.isclose(m["cost/cumulative"], m["cost/cumulative/a"] + m["cost/cumulative/b"])
    assert m["cost/gpu_seconds/a"] == pytest.approx(3.0)


def test_cost_bad_input():
    cm = CostModel({"a": GroupPrice(1.0, 10.0)})
    with pytest.raises(ValueError, match="unknown sampler group 'z'"):
        cm.update({"z": 1})
    with pytest.raises(ValueError, match="tokens_per_second"):
        GroupPrice(1.0, 0.0)
