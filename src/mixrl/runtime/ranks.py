"""The trainer as ``trainer.world_size`` rank processes on this machine (FSDP2).

``LocalRanks`` is the ``TrainerHandle`` the embedded backend hands the
orchestrator when ``trainer.world_size > 1``. It spawns one process per rank
(``torch.multiprocessing``, spawn start method); each runs a ``RankWorker``
(``mixrl.train.distributed.RankTrainer`` plus its tokenizer) and executes the
same command stream::

    driver ──("step", trajectories, advantages)──► rank 0 … rank N-1   (one pipe each)
    rank 0 ──result──► driver;  ranks 1..N-1 ──None──► driver          (every rank answers)

Every command is collective on the ranks (FSDP2 all-gathers, reduce-scatters,
gathers the full state for ``weights``), so all ranks get it in the same
order. A rank that raises sends its traceback; a rank process that dies is
noticed within a second (the driver polls its pipes and the processes), and
the handle raises ``RankFailure`` instead of waiting on the survivors, which
would block in their next collective forever.

The Ray backend wraps the same ``RankWorker`` in actors placed in one
placement group (``runtime.backends.ray_backend``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import traceback
from typing import Any

from mixrl.config import RunConfig
from mixrl.records.trajectory import Trajectory
from mixrl.runtime.gpu import placement_of, require_cuda
from mixrl.runtime.handles import TrainerHandle
from mixrl.runtime.trainer_state import build_trainer
from mixrl.train.distributed import RankTrainer, free_port, init_rank, setup_threads
from mixrl.train.surface import TrainerSurface
from mixrl.weights.refs import WeightsRef


def rank_device(rank: int, use_gpu: bool) -> str:
    """``cuda:<rank mod visible devices>`` for a GPU rank (Ray shows an actor only its own
    GPUs), else ``cpu``. A GPU rank where torch sees no usable GPU fails in one line."""
    if not use_gpu:
        return "cpu"
    import torch


    require_cuda("trainer.num_gpus > 0")
    return f"cuda:{rank % torch.cuda.device_count()}"


class RankFailure(RuntimeError):
    """A trainer rank died or raised; the run cannot continue with the others."""


class RankWorker:
    """One rank: joins the group, builds the sharded trainer, runs commands (all collective)."""

    def __init__(self, rank: int, world: int, addr: str, port: int, cfg: dict[str, Any],
                 model_path: str, loss_cfg: Any) -> None:

        run = RunConfig.model_validate(cfg)
        setup_threads(run.runtime.torch_threads)
        self.rank = rank
        self.device = init_rank(rank, world, addr, port, rank_device(rank, run.trainer.num_gpus > 0))
        ckpt = f"{run.observe.run_dir}/trainer"
        self.trainer, self.tokenizer = build_trainer(
            run, model_path, loss_cfg, factory=RankTrainer, reduce_dtype=run.trainer.reduce_dtype, ckpt_dir=ckpt,
            device=self.device)
        self.surface = TrainerSurface(self.trainer, self.tokenizer)
        # the commands LocalRanks sends, each one the surface's (weights: rank 0 the full state, others {})
        self.step, self.version, self.weights = self.surface.step, self.surface.version, self.surface.weights
        self.state, self.load_state, self.save_policy = (self.surface.state_dict, self.surface.load_state_dict,
                                                         self.surface.save_policy)

    def memory_bytes(self) -> int:
        return int(self.trainer.local_memory_bytes())

    def where(self) -> dict[str, Any]:
        """This rank's device as its parameters and CUDA's allocator show it."""

        return placement_of(self.trainer)

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _rank_main(rank: int, world: int, addr: str, port: int, cfg: dict[str, Any], model_path: str,
               loss_cfg: Any, conn: Any) -> None:
    try:
        worker = RankWorker(rank, world, addr, port, cfg, model_path, loss_cfg)
        conn.send(("ok", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        cmd, args = conn.recv()
        try:
            out = getattr(worker, cmd)(*args)
            conn.send(("ok", out if rank == 0 or cmd in ("memory_bytes", "where") else None))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
            return
        if cmd == "close":
            return


class LocalRanks(TrainerHandle):
    """``trainer.world_size`` rank processes behind one handle; results come from rank 0."""

    def __init__(self, cfg: RunConfig, model_path: str, loss_cfg: Any, publish: Any = None) -> None:
        """``publish`` turns rank 0's gathered state dict into what the weight store holds."""
        import torch.multiprocessing as mp


        self.world = cfg.trainer.world_size
        ctx = mp.get_context("spawn")
        port, data = free_port(), cfg.model_dump(mode="json")
        self.conns, self.procs = [], []
        for r in range(self.world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_rank_main, args=(r, self.world, "127.0.0.1", port, data, model_path, loss_cfg, child),
                            daemon=True, name=f"mixrl-trainer-rank{r}")
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        self._lock = asyncio.Lock()
        self.publish = publish

    def _collect(self) -> list[Any]:
        """Every rank's answer; ``RankFailure`` as soon as one raised or died."""
        out: list[Any] = [None] * self.world
        pending = set(range(self.world))
        while pending:
            for r in list(pending):
                if self.conns[r].poll(0.2):
                    try:
                        status, value = self.conns[r].recv()
                    except (EOFError, OSError):
                        status, value = "error", f"the rank process ended (code {self.procs[r].exitcode})"
                    if status == "error":
                        # a rank whose peer died fails in its next collective: name the dead one
                        # (the cause) first, this rank's error after it
                        time.sleep(0.2)
                        dead = [(q, p.exitcode) for q, p in enumerate(self.procs) if q != r and not p.is_alive()]
                        self._kill()
                        if dead:
                            q, code = dead[0]
                            raise RankFailure(f"trainer rank {q} exited (code {code}); rank {r} failed after it:\n{value}")
                        raise RankFailure(f"trainer rank {r} failed:\n{value}")
                    out[r] = value
                    pending.discard(r)
                elif not self.procs[r].is_alive():
                    self._kill()
                    raise RankFailure(f"trainer rank {r} exited (code {self.procs[r].exitcode})")
        return out

    def _kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()

    def call(self, cmd: str, *args: Any) -> list[Any]:
        """Run ``cmd`` on every rank (blocking); every rank's answer."""
        for r, c in enumerate(self.conns):
            try:
                c.send((cmd, args))
            except OSError:
                self._kill()
                raise RankFailure(f"trainer rank {r} is gone (code {self.procs[r].exitcode})") from None
        return self._collect()

    async def _call0(self, cmd: str, *args: Any) -> Any:
        async with self._lock:  # commands are collective: one at a time, same order on every rank
            return (await asyncio.to_thread(self.call, cmd, *args))[0]

    async def started(self) -> LocalRanks:
        await asyncio.to_thread(self._collect)  # every rank built its trainer (or the error is raised)
        return self

    async def step(self, trajectories: list[Trajectory], advantages: list[float]) -> dict[str, float]:
        return await self._call0("step", trajectories, advantages)

    async def version(self) -> int:
        return await self._call0("version")

    async def weights(self) -> WeightsRef:
        sd = await self._call0("weights")
        return await asyncio.to_thread(self.publish, sd) if self.publish is not None else sd

    async def state(self) -> dict[str, Any]:
        return await self._call0("state")

    async def load_state(self, state: dict[str, Any]) -> None:
        await self._call0("load_state", state)

    async def save_policy(self, out_dir: str) -> None:
        await self._call0("save_policy", out_dir)

    async def close(self) -> None:
        if all(p.is_alive() for p in self.procs):
            with contextlib.suppress(RankFailure):
                await self._call0("close")
        for p in self.procs:
            p.join(timeout=5)
        self._kill()
