"""``mixrl serve`` as a user runs it: a real process, a real port, the ``openai`` client."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
MIXRL = [sys.executable, "-m", "mixrl.commands.main"]


def test_exposed_without_key_is_refused(tiny: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MIXRL_API_KEY"}
    r = subprocess.run([*MIXRL, "serve", str(tiny), "--host", "0.0.0.0"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "API key" in r.stderr and "0.0.0.0" in r.stderr


def test_missing_model_is_one_line(tmp_path: Path) -> None:
    r = subprocess.run([*MIXRL, "serve", str(tmp_path / "nope")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "nope" in r.stderr


def test_serves_two_groups_on_localhost_with_a_key(tiny: Path) -> None:
    proc = subprocess.Popen([*MIXRL, "serve", str(tiny), "--profile", "fp32,b200-bf16", "--port", "0",
                             "--api-key", "k3y", "--max-tokens", "8"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        url, deadline = None, time.time() + 240
        while url is None and time.time() < deadline:
            line = proc.stderr.readline()
            if not line and proc.poll() is not None:
                pytest.fail(f"mixrl serve exited with {proc.returncode}")
            m = re.search(r"on (http://127\.0\.0\.1:\d+/v1)", line)
            url = m.group(1) if m else None
        assert url is not None
        bad = openai.OpenAI(base_url=url, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        client = openai.OpenAI(base_url=url, api_key="k3y", max_retries=0)
        groups = set()
        for i in range(12):
            r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                               user=f"session-{i}")
            assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens <= 8
            groups.add(r.model_extra["mixrl"]["group"])
        assert groups == {"fp32", "b200-bf16"}  # sessions are routed over both groups
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.mark.parametrize(("flag", "value"), [("--max-body-mib", "0"), ("--session-ttl", "0"), ("--max-sessions", "0"),
                                             ("--header-timeout", "0"), ("--max-connections", "0"),
                                             ("--session-mib", "0"), ("--client-queue", "0")])
def test_bad_limits_are_one_line(tiny: Path, flag: str, value: str) -> None:
    r = subprocess.run([*MIXRL, "serve", str(tiny), flag, value], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and flag in r.stderr
