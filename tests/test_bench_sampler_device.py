"""``mixrl bench sampler --device``: the accelerator variant, run here on the fake device.

``tests/fake_device`` stands in for a GPU (its tensors live in CPU memory): the bench must put
the built-in engine of every profile and HF ``generate`` there, and report each side."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from mixrl.lab.bench.sampler import resolve_model
from mixrl.lab.bench.sampler_device import PROFILES, device_problem, run_device
from tests import fake_device

pytestmark = pytest.mark.fakegpu  # installs the device in this process: runs last (tests/conftest.py)


def test_every_profile_and_hf_generate_run_on_the_device() -> None:
    dev = fake_device.install()
    args = argparse.Namespace(device=str(dev), model="random", seed=0, batch=4, prompt_len=6, new_tokens=5, repeats=1)
    out = run_device(args, resolve_model)
    assert out["device"] == str(dev)
    for p in PROFILES:
        assert out[f"builtin_{p}_tok_s"] > 0 and out[f"builtin_{p}_over_hf"] > 0
    assert out["hf_tok_s"] > 0 and out["builtin_fp32_peak_mb"] == 0.0  # peak memory is CUDA's only


@pytest.mark.parametrize("device,line", [("cuda", "shows no CUDA device"), ("blah", "not a torch device")])
def test_a_device_it_cannot_use_is_one_line_and_exit_2(device: str, line: str) -> None:
    import torch

    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    assert line in (device_problem(device) or "")
    p = subprocess.run([sys.executable, "-m", "mixrl.commands.main", "bench", "sampler", "--device", device, "--json"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == "" and line in p.stderr and len(p.stderr.strip().splitlines()) == 1
