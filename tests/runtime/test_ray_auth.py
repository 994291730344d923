"""Ray clusters run with token authentication: unauthenticated callers are refused.

The local cluster the Ray backend starts is probed with a raw gRPC call to its
GCS (no Ray client, no token: refused; Ray's own token: accepted). Joining an
existing cluster with a missing or wrong token fails within seconds with one
line naming ``RAY_AUTH_TOKEN`` / ``RAY_AUTH_TOKEN_PATH`` (``mixrl train``: exit 2).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from mixrl.config import to_toml

from .test_run import tiny_cfg

pytestmark = pytest.mark.ray

_CLIENT = r"""
import sys
from mixrl.runtime.backends.ray_backend import RayAuthError, require_token_mode, check_cluster_token
require_token_mode()
try:
    check_cluster_token(sys.argv[1], timeout_s=5)
    print("ACCEPTED")
except RayAuthError as e:
    print("REFUSED", e)
"""


def _gcs_call(address: str, metadata: list[tuple[str, str]]) -> Any:
    """One raw GetClusterId call on the GCS; returns the reply or the gRPC error code."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(ch)
        try:
            return stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=10, metadata=metadata)
        except grpc.RpcError as e:
            return e.code()


def _client_env(home: Path, **token: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HOME=str(home), OMP_NUM_THREADS="1", **token)
    return env


@pytest.fixture(scope="module")
def local_cluster(tiny_policy: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One local cluster started by the backend, in a fresh HOME (where Ray writes its token)."""
    pytest.importorskip("ray")
    import ray

    from mixrl.runtime.backends.ray_backend import RayBackend

    home = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as mp:
        for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS"):
            mp.delenv(k, raising=False)
        mp.setenv("HOME", str(home))
        cfg = tiny_cfg(tiny_policy, home / "run", runtime={"backend": "ray"})
        backend = RayBackend(cfg, str(tiny_policy), None)
        asyncio.run(backend.start())
        try:
            yield ray.get_runtime_context().gcs_address, home
        finally:
            asyncio.run(backend.shutdown())


def test_local_cluster_refuses_unauthenticated_calls(local_cluster: Any) -> None:
    import grpc

    address, home = local_cluster
    assert os.environ["RAY_AUTH_MODE"] == "token"
    token_file = home / ".ray" / "auth_token"
    token = token_file.read_text().strip()  # generated before Ray would write one with the umask
    assert oct(token_file.stat().st_mode & 0o777) == oct(0o600)
    assert len(token) >= 32
    refused = _gcs_call(address, [])
    print(f"unauthenticated GetClusterId on {address}: {refused}")
    assert refused == grpc.StatusCode.UNAUTHENTICATED
    assert _gcs_call(address, [("authorization", "Bearer " + "0" * len(token))]) == grpc.StatusCode.UNAUTHENTICATED
    ok = _gcs_call(address, [("authorization", f"Bearer {token}")])
    assert not isinstance(ok, grpc.StatusCode) and ok.cluster_id


def test_join_with_missing_or_wrong_token_is_one_line(local_cluster: Any, tmp_path: Path) -> None:
    address, home = local_cluster
    token = (home / ".ray" / "auth_token").read_text().strip()
    empty = tmp_path / "nobody"
    empty.mkdir()
    (tmp_path / "tok").write_text(token)
    cases = {
        "missing": (_client_env(empty), "needs its auth token"),
        "wrong": (_client_env(empty, RAY_AUTH_TOKEN="f" * len(token)), "refused the auth token"),
        "bad path": (_client_env(empty, RAY_AUTH_TOKEN_PATH=str(tmp_path / "nope")), "is not a file"),
        "right (path)": (_client_env(empty, RAY_AUTH_TOKEN_PATH=str(tmp_path / "tok")), None),
    }
    for name, (env, expect) in cases.items():
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-c", _CLIENT, address], env=env, capture_output=True,
                           text=True, timeout=60)
        out = r.stdout.strip().splitlines()[-1]
        print(f"{name}: {out} ({time.perf_counter() - t0:.1f} s)")
        if expect is None:
            assert out == "ACCEPTED", r.stderr[-2000:]
        else:
            assert out.startswith("REFUSED") and expect in out, r.stderr[-2000:]
            assert "RAY_AUTH_TOKEN" in out and "RAY_AUTH_TOKEN_PATH" in out


def test_train_cli_with_wrong_token_exits_2(local_cluster: Any, tiny_policy: Path, tmp_path: Path) -> None:
    address, _ = local_cluster
    cfg = tiny_cfg(tiny_policy, tmp_path / "run2", env={"name": "upper"}, runtime={"backend": "ray", "steps": 1})
    path = tmp_path / "run.toml"
    path.write_text(to_toml(cfg))
    env = _client_env(tmp_path, RAY_AUTH_TOKEN="0" * 32, RAY_ADDRESS=address)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "mixrl.commands.main", "train", str(path), "--no-eval"],
                       env=env, capture_output=True, text=True, timeout=120)
    took = time.perf_counter() - t0
    last = r.stderr.strip().splitlines()[-1]
    print(f"exit {r.returncode} after {took:.1f} s: {last}")
    assert r.returncode == 2, r.stderr[-3000:]
    assert last.startswith("mixrl train: the Ray cluster at") and "RAY_AUTH_TOKEN_PATH" in last
    assert "Traceback" not in r.stderr
