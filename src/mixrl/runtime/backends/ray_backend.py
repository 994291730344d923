"""Ray backend: sampler replicas and the trainer as Ray actors.

This is the only module that imports Ray. The orchestrator is the same as
in-process; only the handles differ:

- a sampler replica is an async actor holding an engine behind a
  ``BatchingSampler`` (its own process, its own quantized weights);
- the trainer is an actor; ``weights()`` returns an object reference to the
  state dict *in the object store*: the trainer writes each version once and
  every replica reads it from there (the driver never copies the weights);
- a dead actor (``ray.kill``, a crashed process) raises ``RayActorError``,
  which the handle turns into ``ReplicaFailure`` so the fleet's failover path
  takes over.

Authentication: every cluster runs with Ray's token authentication
(``RAY_AUTH_MODE=token``); mixrl never opts out. ``start`` joins
``runtime.ray.address`` or ``$RAY_ADDRESS`` when set, with the token from
``$RAY_AUTH_TOKEN``, the file ``$RAY_AUTH_TOKEN_PATH`` or Ray's default
``~/.ray/auth_token``; the token is checked against the cluster's GCS first
(one gRPC call with a deadline), so a missing or wrong token is one clear
``RayAuthError`` line instead of Ray's ~20 s of reconnect warnings. Without
an address it starts a local cluster: token auth on (Ray generates the token
into ``~/.ray/auth_token`` when none exists), no dashboard, a private
temporary directory.
"""

from __future__ import annotations

import os
import re
import tempfile
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from mixrl.config.run import ConfigError, RunConfig
from mixrl.fleet.handles import SamplerHandle
from mixrl.rollout.types import Trajectory
from mixrl.runtime.handles import Backend, TrainerHandle
from mixrl.sampling.base import GenerationRequest, GenerationResult, ReplicaFailure

# Actors reserve no CPU: the machine's cores are shared by time, and a CPU
# reservation per actor would stop a small machine from placing the fleet.
_ACTOR_OPTS: dict[str, Any] = {"num_cpus": 0, "max_restarts": 0}


@ray.remote(**_ACTOR_OPTS)
class SamplerActor:
    def __init__(self, model_path: str, profile: Any, group: str, seed: int, threads: int) -> None:
        import torch

        from mixrl.sampling.batching import BatchingSampler
        from mixrl.sampling.factory import make_engine

        torch.set_num_threads(threads)
        self.sampler = BatchingSampler(make_engine(model_path, profile, group, seed=seed))

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        return await self.sampler.generate(request)

    async def load_weights(self, state_dict: Any, version: int) -> None:
        await self.sampler.load_weights(state_dict, version)

    def pid(self) -> int:
        return os.getpid()


@ray.remote(**_ACTOR_OPTS)
class TrainerActor:
    def __init__(self, cfg: dict[str, Any], model_path: str, loss_cfg: Any) -> None:
        from mixrl.runtime.trainer_state import build_trainer

        self.trainer, self.tokenizer = build_trainer(RunConfig.model_validate(cfg), model_path, loss_cfg)

    def step(self, trajectories: list[Trajectory], advantages: list[float]) -> dict[str, float]:
        return self.trainer.step(trajectories, advantages)

    def version(self) -> int:
        return int(self.trainer.version)

    def weights(self) -> dict[str, Any]:
        return self.trainer.state_dict_for_samplers()  # detached CPU copies

    def state(self) -> dict[str, Any]:
        from mixrl.runtime.trainer_state import trainer_state

        return trainer_state(self.trainer)

    def load_state(self, state: dict[str, Any]) -> None:
        from mixrl.runtime.trainer_state import load_trainer_state

        load_trainer_state(self.trainer, state)

    def save_policy(self, out_dir: str) -> None:
        from mixrl.runtime.trainer_state import save_policy

        save_policy(self.trainer, self.tokenizer, out_dir)


class RayAuthError(ConfigError):
    """The cluster cannot be joined with the token at hand (one line, names the variables)."""


_TOKEN_VARS = "RAY_AUTH_TOKEN (the token) or RAY_AUTH_TOKEN_PATH (a file holding it)"
_HOST_PORT = re.compile(r"^\[?[A-Za-z0-9.:-]+\]?:\d+$")


def _require_token_mode() -> None:
    """Token auth on for this process and every process it starts (raylets, workers)."""
    from ray._private.authentication.authentication_token_setup import AUTH_MODE_ENV_VAR
    from ray._raylet import AuthenticationTokenLoader, Config

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
    from ray._raylet import AuthenticationTokenLoader
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
            stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s, metadata=metadata)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise RayAuthError(f"the Ray cluster at {address} refused the auth token: set {_TOKEN_VARS} "
                                   "to the cluster's token") from None
            raise RayAuthError(f"the Ray cluster at {address} did not answer within {timeout_s:g} s "
                               f"({e.code().name}): check runtime.ray.address / RAY_ADDRESS") from None


def _replica_error(e: BaseException, name: str) -> BaseException:
    """Map Ray's errors onto the fleet's: a dead actor or a failed engine is a replica failure."""
    if isinstance(e, RayActorError):
        return ReplicaFailure(f"replica {name}: actor died ({type(e).__name__})")
    if isinstance(e, RayTaskError) and isinstance(getattr(e, "cause", None), ReplicaFailure):
        return ReplicaFailure(f"replica {name}: {e.cause}")
    return e


class RaySampler(SamplerHandle):
    def __init__(self, name: str, group: str, actor: Any):
        self.name, self.group, self.actor = name, group, actor

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        try:
            return await self.actor.generate.remote(request)
        except (RayActorError, RayTaskError) as e:
            raise _replica_error(e, self.name) from e

    async def load_weights(self, ref: Any, version: int) -> None:
        try:
            await self.actor.load_weights.remote(ref, version)  # Ray resolves ref in the actor
        except (RayActorError, RayTaskError) as e:
            raise _replica_error(e, self.name) from e

    async def close(self) -> None:
        ray.kill(self.actor, no_restart=True)


class RayTrainer(TrainerHandle):
    def __init__(self, actor: Any):
        self.actor = actor

    async def step(self, trajectories: list[Trajectory], advantages: list[float]) -> dict[str, float]:
        return await self.actor.step.remote(trajectories, advantages)

    async def version(self) -> int:
        return await self.actor.version.remote()

    async def weights(self) -> Any:
        # The reference itself is what the weight store holds: the data stays in the object
        # store (actor calls run in order, so this is the state after the last step).
        return self.actor.weights.remote()

    async def state(self) -> dict[str, Any]:
        return await self.actor.state.remote()

    async def load_state(self, state: dict[str, Any]) -> None:
        await self.actor.load_state.remote(state)

    async def save_policy(self, out_dir: str) -> None:
        await self.actor.save_policy.remote(out_dir)

    async def close(self) -> None:
        ray.kill(self.actor, no_restart=True)


class RayBackend(Backend):
    name = "ray"

    def __init__(self, cfg: RunConfig, model_path: str, loss_cfg: Any):
        self.cfg, self.model_path, self.loss_cfg = cfg, model_path, loss_cfg
        self.samplers: dict[str, RaySampler] = {}
        self._started_here = False

    async def start(self) -> None:
        if ray.is_initialized():
            return
        address = self.cfg.runtime.ray.address or os.environ.get("RAY_ADDRESS")
        _require_token_mode()
        if address:
            check_cluster_token(address)
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
        else:
            tmp = tempfile.mkdtemp(prefix="mixrl-ray-")
            ray.init(
                num_cpus=self.cfg.runtime.ray.num_cpus or os.cpu_count(), include_dashboard=False,
                _temp_dir=tmp, log_to_driver=False, configure_logging=False,
            )
        self._started_here = True

    async def make_trainer(self) -> TrainerHandle:
        actor = TrainerActor.remote(  # type: ignore[attr-defined]
            self.cfg.model_dump(mode="json"), self.model_path, self.loss_cfg
        )
        await actor.version.remote()  # raises here if the trainer cannot be built
        return RayTrainer(actor)

    async def make_sampler(self, group: str, name: str) -> SamplerHandle:
        from mixrl.runtime.backends.inprocess import group_profile, replica_seed

        prof = group_profile(self.cfg, group)
        actor = SamplerActor.remote(  # type: ignore[attr-defined]
            self.model_path, prof, group, replica_seed(self.cfg.runtime.seed, name), self.cfg.runtime.torch_threads
        )
        try:
            await actor.pid.remote()
        except RayActorError as e:
            raise ReplicaFailure(f"replica {name} could not start: {e}") from e
        h = RaySampler(name, group, actor)
        self.samplers[name] = h
        return h

    def kill(self, name: str) -> None:
        """Kill a replica's actor process (fault injection)."""
        ray.kill(self.samplers[name].actor, no_restart=True)

    async def shutdown(self) -> None:
        if self._started_here:
            ray.shutdown()
