"""Ray token authentication for the Ray backend: every cluster mixrl starts or joins uses it.

``require_token_mode`` turns Ray's token mode on for this process and every process it
starts; ``check_cluster_token`` asks a cluster's GCS to accept this process's token with
one deadline-bound call, so a missing or wrong token is one clear ``RayAuthError`` line
instead of Ray's reconnect warnings. Part of the Ray backend (``runtime.backends.ray_backend``), the only
place that imports Ray.
"""

from __future__ import annotations

import os
import re

from mixrl.config import ConfigError


class RayAuthError(ConfigError):
    """The cluster cannot be joined with the token at hand (one line, names the variables)."""


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
