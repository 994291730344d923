"""Test-wide settings.

A run's dataset, rewards and env options are passed, never global
(``mixrl.envs.registry.activate`` returns them), so nothing of one test's run reaches the next.

The stand-in device (tests/fake_device.py) cannot be unregistered once installed, and
torch then reports an accelerator to every library that asks (peft loads adapters onto
``torch.accelerator.current_accelerator()``): tests marked ``fakegpu`` run after all others.

Metric keys: every key has one producer; under the tests a key produced twice in one
update fails the run (``mixrl.runtime.orchestrator.merge_metrics``).
"""

from __future__ import annotations

import os

os.environ.setdefault("MIXRL_STRICT_METRICS", "1")



def pytest_collection_modifyitems(items: list) -> None:
    items.sort(key=lambda item: item.get_closest_marker("fakegpu") is not None)  # stable: order kept otherwise
