"""Ctrl-C on ``mixrl train``: a checkpoint is written and the exit status is 130."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def test_sigint_saves_a_checkpoint(tiny_policy: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "mixrl.commands.main", "train",
           "--set", f'model.path="{tiny_policy}"', "--set", 'env.name="reverse"', "--set", "env.options={}",
           "--set", "rollout.group_size=2", "--set", "rollout.prompts_per_step=2",
           "--set", "rollout.max_new_tokens=6", "--set", "rollout.max_total_tokens=48",
           "--set", 'fleet.groups=[{name="fp32", profile="fp32", replicas=1, min_replicas=1}]',
           "--set", "runtime.steps=100000", "--set", "observe.progress=false", "--set", "observe.tensorboard=false",
           "--set", f'observe.run_dir="{run_dir}"', "--no-eval"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 240
        metrics = run_dir / "metrics.jsonl"
        while time.monotonic() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 2):
            assert proc.poll() is None, proc.stdout.read().decode()[-2000:] if proc.stdout else ""
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out.decode()[-2000:]
    steps = len(metrics.read_text().splitlines())
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{steps:06d}"  # the checkpoint is the last completed step
