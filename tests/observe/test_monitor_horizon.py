"""The collapse monitor fires within a study's horizon, on sparse precision KL too."""

import random

import pytest

from mixrl.telemetry.monitor import MonitorConfig, monitor_config, replay


def _series(n, start, seed, every=1):
    """Reward flat then falling from ``start``; precision KL growing 7x, measured on one step in
    ``every`` (async runs have staleness-0 tokens on few steps); format errors rising."""
    rng = random.Random(seed)
    rows = []
    for i in range(1, n + 1):
        t = max(0, i - start) / 20 if start else 0.0
        row = {"step": i, "rollout/reward": 0.5 - 0.45 * min(t, 1) + rng.gauss(0, 0.03),
               "rollout/format_error_end": max(0.0, min(1.0, 0.03 + 0.9 * t + rng.gauss(0, 0.01)))}
        if i % every == 0:
            row["precision/kl_k3"] = 2e-3 * (1 + 6 * min(t, 1)) * (1 + rng.gauss(0, 0.1))
        rows.append(row)
    return rows


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("every", [1, 3])
def test_fires_within_forty_updates(seed, every):
    mon, events = replay(_series(40, start=12, seed=seed, every=every))  # the default settings
    assert mon.collapsed and 12 < mon.first_collapse_step <= 40
    assert any(e["signal"] == "collapse" for e in events)
    # the former settings (10 warm-up steps, then 10 precision-KL steps) cannot flag the KL
    # signal here when KL is measured on one step in three: 10 + 3 * 10 = 40
    old, _ = replay(_series(40, start=12, seed=seed, every=every), MonitorConfig(early_steps=10, warmup_steps=10))
    if every == 3:
        assert not old.active["kl_growth"]


@pytest.mark.parametrize("seed", range(4))
def test_quiet_on_stable_series(seed):
    mon, events = replay(_series(150, start=0, seed=seed, every=2))
    assert not mon.collapsed and events == []


@pytest.mark.parametrize("warmup,early", [(3, 5), (10, 10), (0, 2)])
def test_earliest_possible_flag(warmup, early):
    """Reward gone after the warm-up, KL 1000x from step warm-up + early + 1: flagged at that step,
    not one before (the KL signal needs its early level first)."""
    jump = warmup + early + 1
    rows = [{"step": i, "rollout/reward": 1.0 if i <= warmup + 1 else 0.0, "precision/kl_k3": 1e-3 if i < jump else 1.0}
            for i in range(1, 40)]
    mon, _ = replay(rows, MonitorConfig(warmup_steps=warmup, early_steps=early, ema=1.0))
    assert mon.first_collapse_step == jump


def test_monitor_config_from_a_table():
    assert monitor_config({"warmup_steps": 2, "early_steps": 4}).early_steps == 4
    assert monitor_config(None) == MonitorConfig()
    with pytest.raises(ValueError, match="warmup"):
        monitor_config({"warmup": 2})
    with pytest.raises(ValueError, match="kl_factor"):
        monitor_config({"kl_factor": 0.5})
