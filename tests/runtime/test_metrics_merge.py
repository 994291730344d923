"""Every metric key has one producer: a key written twice fails under the tests."""

from __future__ import annotations

import pytest

from mixrl.runtime.orchestrator import merge_metrics


def test_a_key_produced_twice_raises_under_the_tests(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    parts = [("trainer", {"loss": 1.0, "train/version": 3.0}), ("buffer", {"rollout/staleness_mean": 0.5})]
    assert merge_metrics(parts) == {"loss": 1.0, "train/version": 3.0, "rollout/staleness_mean": 0.5}
    clash = [*parts, ("orchestrator", {"train/version": 2.0})]
    with pytest.raises(RuntimeError, match="'train/version' is produced by both trainer and orchestrator"):
        merge_metrics(clash)
    monkeypatch.setenv("MIXRL_STRICT_METRICS", "0")  # a user's run: the first producer's value, reported once
    assert merge_metrics(clash)["train/version"] == 3.0
    assert "train/version" in capsys.readouterr().err
