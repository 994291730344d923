"""Ray token authentication for the Ray backend: every cluster mixrl starts or joins uses it.

``require_token_mode`` turns Ray's token mode on for this process and every process it
starts; ``check_cluster_token`` asks a cluster's GCS to accept this process's token with
one deadline-bound call, so a missing or wrong token is one clear ``RayAuthError`` line
instead of Ray's reconnect warnings. ``private_token_file`` makes the token a new local
cluster uses readable by its owner only (Ray itself writes ``~/.ray/auth_token`` with the
process umask, 0644 by default); ``check_initialised`` refuses a Ray that the caller
initialised without token authentication. Part of the Ray backend (``runtime.backends.ray_backend``), the only
place that imports Ray.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import stat
from pathlib import Path

from mixrl.config import ConfigError


class RayAuthError(ConfigError):
    """The cluster cannot be joined with the token at hand (one line, names the variables)."""


log = logging.getLogger("mixrl.ray")
_TOKEN_VARS = "RAY_AUTH_TOKEN (the token) or RAY_AUTH_TOKEN_PATH (a file holding it)"
_HOST_PORT = re.compile(r"^\[?[A-Za-z0-9.:-]+\]?:\d+$")


def require_token_mode() -> None:
    """Token auth on for this process and every process it starts (raylets, workers)."""
    from ray._private.authentication.authentication_token_setup import AUTH_MODE_ENV_VAR
    from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

    mode = os.environ.get(AUTH_MODE_ENV_VAR, "token").lower()
    if mode != "token":
        raise RayAuthError(f"{AUTH_MODE_ENV_VAR}={mode!r}: mixrl runs Ray only with token "
                           f"authentication; unset it or set {AUTH_MODE_ENV_VAR}=token")
    os.environ[AUTH_MODE_ENV_VAR] = "token"
    Config.initialize("")  # Ray caches its config: re-read the mode from the environment
    AuthenticationTokenLoader.instance().reset_cache()


def check_cluster_token(address: str, timeout_s: float = 10.0) -> None:
    """Ask the GCS at ``address`` to accept this process's token; ``RayAuthError`` if it does not.

    One unary call (``GetClusterId``) with a deadline: an unreachable address or a
    refused token is reported at once. Addresses that are not ``host:port``
    (``auto``, ``ray://``) are left to Ray.
    """
    import grpc
    from ray._raylet import AuthenticationTokenLoader  # type: ignore[attr-defined]
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    loader = AuthenticationTokenLoader.instance()
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if not os.environ.get("RAY_AUTH_TOKEN") and path and not os.path.isfile(path):
        raise RayAuthError(f"joining the Ray cluster at {address}: RAY_AUTH_TOKEN_PATH={path} is not a file; "
                           f"set {_TOKEN_VARS}")
    if not loader.has_token(ignore_auth_mode=True):
        raise RayAuthError(f"joining the Ray cluster at {address} needs its auth token: set {_TOKEN_VARS}")
    if not _HOST_PORT.match(address):
        return
    metadata = list(loader.get_token_for_http_header().items())
    with grpc.insecure_channel(address) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            request = gcs_service_pb2.GetClusterIdRequest()  # type: ignore[attr-defined]
            stub.GetClusterId(request, timeout=timeout_s, metadata=metadata)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise RayAuthError(f"the Ray cluster at {address} refused the auth token: set {_TOKEN_VARS} "
                                   "to the cluster's token") from None
            raise RayAuthError(f"the Ray cluster at {address} did not answer within {timeout_s:g} s "
                               f"({e.code().name}): check runtime.ray.address / RAY_ADDRESS") from None


def default_token_path() -> Path:
    """Where Ray reads (and a new local cluster writes) its token when no variable names one."""
    return Path.home() / ".ray" / "auth_token"


def private_token_file() -> Path | None:
    """The token file this process will use, readable by its owner only (mode 0600).

    ``RAY_AUTH_TOKEN`` set: no file (None). ``RAY_AUTH_TOKEN_PATH`` set: that file must not be
    readable by others (``RayAuthError``: one line, the mode and the fix; mixrl does not change
    a file the user named). Else ``~/.ray/auth_token``: created here, 0600 in a 0700 folder,
    before Ray would create it with the umask; an existing one readable by others is made 0600
    (logged)."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return None
    named = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if named:
        path = Path(named)
        if path.is_file() and path.stat().st_mode & 0o077:
            mode = stat.S_IMODE(path.stat().st_mode)
            raise RayAuthError(f"RAY_AUTH_TOKEN_PATH={named} is readable by others (mode {mode:04o}): "
                               f"chmod 600 {named}")
        return path
    path = default_token_path()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            os.chmod(path, 0o600)
            log.warning("%s was readable by others (mode %04o): made 0600", path, mode)
        return path
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))  # as Ray's own: 64 hex characters
    return path


def check_initialised() -> None:
    """A Ray the caller initialised (``ray.init()`` before mixrl) must run with token authentication."""
    from ray._raylet import (  # type: ignore[attr-defined]
        AuthenticationMode,
        AuthenticationTokenLoader,
        get_authentication_mode,
    )

    if get_authentication_mode() != AuthenticationMode.TOKEN or not AuthenticationTokenLoader.instance().has_token():
        mode = os.environ.get("RAY_AUTH_MODE") or "unset"
        raise RayAuthError(f"Ray was initialised without token authentication (RAY_AUTH_MODE={mode}): mixrl "
                           f"runs Ray only with it; unset RAY_AUTH_MODE or set it to token (and {_TOKEN_VARS}) "
                           "before ray.init(), or let mixrl start Ray")
