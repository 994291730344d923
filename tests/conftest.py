"""Test-wide settings.

A run's dataset, rewards and env options are passed, never global
(``mixrl.envs.registry.activate`` returns them), so nothing of one test's run reaches the next.

Metric keys: every key has one producer; under the tests a key produced twice in one
update fails the run (``mixrl.runtime.orchestrator.merge_metrics``).
"""

from __future__ import annotations

import os

os.environ.setdefault("MIXRL_STRICT_METRICS", "1")

