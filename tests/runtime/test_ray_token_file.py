"""The token a local Ray cluster uses is readable by its owner only, and a Ray the caller started
without token authentication is refused."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")

from mixrl.runtime.backends.ray_backend.auth import RayAuthError, private_token_file  # noqa: E402


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


@pytest.fixture()
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for k in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def test_a_new_token_file_is_0600_in_a_0700_folder(home: Path) -> None:
    path = private_token_file()
    assert path == home / ".ray" / "auth_token"
    assert _mode(path) == 0o600 and _mode(path.parent) == 0o700
    token = path.read_text()
    assert len(token) == 64 and int(token, 16) >= 0
    assert private_token_file() == path and path.read_text() == token  # kept, not rewritten


def test_an_existing_token_readable_by_others_is_made_0600(home: Path) -> None:
    (home / ".ray").mkdir()
    path = home / ".ray" / "auth_token"
    path.write_text("a" * 64)
    os.chmod(path, 0o644)
    assert private_token_file() == path and _mode(path) == 0o600 and path.read_text() == "a" * 64


def test_a_named_token_file_readable_by_others_is_refused(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    named = home / "tok"
    named.write_text("b" * 64)
    os.chmod(named, 0o644)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(named))
    with pytest.raises(RayAuthError, match=r"readable by others \(mode 0644\): chmod 600"):
        private_token_file()
    assert _mode(named) == 0o644  # the user's file is not changed
    os.chmod(named, 0o600)
    assert private_token_file() == named
    monkeypatch.setenv("RAY_AUTH_TOKEN", "c" * 64)
    assert private_token_file() is None  # a token in the environment: no file


CALLER = r"""
import asyncio, sys
import ray
from mixrl.config import RunConfig
from mixrl.runtime.backends.ray_backend import RayBackend, RayAuthError
ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, _temp_dir=sys.argv[1])
try:
    asyncio.run(RayBackend(RunConfig(), "bundled", None).start())
    print("STARTED")
except RayAuthError as e:
    print("REFUSED", e)
finally:
    ray.shutdown()
"""


@pytest.mark.ray
@pytest.mark.parametrize("mode", ["disabled", None])
def test_a_ray_the_caller_started_is_checked_for_token_auth(tmp_path: Path, mode: str | None) -> None:
    """``ray.init()`` by the caller, then mixrl's backend: refused when the caller opted out of token
    authentication; Ray 2.60's own default (token mode) is accepted."""
    import tempfile

    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HOME=str(tmp_path), OMP_NUM_THREADS="1", **({"RAY_AUTH_MODE": mode} if mode else {}))
    temp = tempfile.mkdtemp(prefix="mixrl-t-", dir="/tmp")  # Ray's socket paths must stay short
    try:
        r = subprocess.run([sys.executable, "-c", CALLER, temp], env=env, capture_output=True, text=True,
                           timeout=180)
    finally:
        import shutil

        shutil.rmtree(temp, ignore_errors=True)
    out = [ln for ln in r.stdout.splitlines() if ln.startswith(("STARTED", "REFUSED"))]
    assert out, r.stderr[-2000:]
    if mode == "disabled":
        assert out[-1].startswith("REFUSED") and "without token authentication (RAY_AUTH_MODE=disabled)" in out[-1]
    else:
        assert out[-1] == "STARTED", out
