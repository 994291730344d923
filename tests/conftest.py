"""Test-wide isolation: a run's active dataset, rewards and env options never leak into the next test.

``mixrl.envs.registry.activate(cfg)`` (called by ``train`` and by ``--dry-run``) makes a config's
``[data]`` the task source of every family in the process; tests that run the CLI or ``train``
in-process would otherwise leave it active for the tests after them.

Metric keys: every key has one producer; under the tests a key produced twice in one
update fails the run (``mixrl.runtime.orchestrator.merge_metrics``).
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("MIXRL_STRICT_METRICS", "1")


@pytest.fixture(autouse=True)
def _no_active_run_inputs():
    yield
    from mixrl.envs.registry import deactivate

    deactivate()
