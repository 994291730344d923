"""Trainer ranks: FSDP2 data parallelism over ``trainer.world_size`` processes.

Every rank holds 1/N of the parameters, gradients and AdamW state
(``torch.distributed.fsdp.fully_shard`` on each decoder layer and on the
root; gloo on CPU, NCCL on GPU) and trains on 1/N of each batch::

    driver ──(trajectories, advantages)──► every rank
    rank r: prepare(whole batch)           same records, same drop counters on every rank
            records[r·S/N : (r+1)·S/N]     its contiguous slice
            D = all_reduce(Σ local D)      the caller-provided global denominator (aggregation.py)
            forward/backward per micro-batch; reduce-scatter SUMS the gradients
            clip (global norm over the shards), AdamW on the local shard
    rank 0 ──metrics──► driver             loss summed over ranks, other metrics averaged

With the global ``D`` and summed gradients, N ranks compute exactly the update
of one rank on the whole batch (up to float summation order). FSDP2 runs a
collective in every forward and backward, so all ranks must run the same
number of passes: a rank with fewer micro-batches than the busiest one runs
empty passes (a 1-token forward whose loss is 0) until they agree.

Mixed precision: ``optim.precision = "bf16"`` (or ``"fp16"``) becomes FSDP2's
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=trainer.reduce_dtype)``;
the sharded parameters and AdamW stay float32 (the master copy).

Devices: a rank lives on one device (``rank_device``: ``cuda:<local index>``
when ``trainer.num_gpus > 0``, else ``cpu``, pinned even on a GPU host). The
model moves there before FSDP2 shards it and before the optimizer is built;
the FSDP2 mesh is built on that device type; every tensor a collective
touches lives there too (NCCL rejects CPU tensors, gloo CUDA ones).

Weights leave the ranks in two ways: ``state_dict_for_samplers`` gathers the
full state (every rank takes part, rank 0 keeps it) for publishing and HF
export; checkpoints are sharded, each rank writing its own shard through
``torch.distributed.checkpoint`` into ``<run_dir>/trainer/v<version>``.

Limits: with ``optim.minibatches > 1`` the ranks' slices must split into the
same number of minibatches (they do when the batch size is a multiple of N);
``loss.ref_kl`` is not supported on ranks.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from mixrl.train.trainer import Trainer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_SUMMED = ("loss",)  # local loss = local sum / global D: the batch loss is their sum


def init_rank(rank: int, world: int, addr: str, port: int, device: str) -> torch.device:
    """Join the process group (NCCL on CUDA, else gloo); the rank's device."""
    dev = torch.device(device)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world,
                            device_id=dev if dev.type == "cuda" else None)
    return dev


def all_reduce_scalar(x: float, op: Any, device: torch.device) -> float:
    """``x`` reduced over the ranks, through a tensor on the rank's ``device``."""
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return float(t.item())


class _Root(nn.Module):
    """The FSDP2 root: one forward that runs the trainer's whole log-prob pass.

    The trainer reads ``lm.model`` and ``lm.lm_head.weight`` itself; inside this
    forward the root's parameters (embeddings, final norm, tied head) are
    unsharded, and the backward hooks reduce-scatter their gradients.
    """

    def __init__(self, lm: Any) -> None:
        super().__init__()
        self.lm: Any = lm
        self.trainer: Any = None  # set after construction; not a submodule

    def forward(self, tb: Any, records: Any) -> Any:
        if tb is None:  # an empty pass: same collectives as a real one, zero loss and gradient
            ids = torch.zeros(1, 1, dtype=torch.long, device=self.lm.lm_head.weight.device)
            h = self.lm.model(input_ids=ids).last_hidden_state
            return h.sum() * 0.0 + self.lm.lm_head.weight.sum() * 0.0
        return Trainer._forward(self.trainer, tb, records)


class _Lockstep(list[Any]):
    """This rank's micro-batches; iterating runs empty passes up to the busiest rank's count."""

    def __init__(self, items: list[Any], pad: int, trainer: RankTrainer) -> None:
        super().__init__(items)
        self.pad, self.trainer = pad, trainer

    def __iter__(self) -> Iterator[Any]:
        yield from list.__iter__(self)
        for _ in range(self.pad):
            self.trainer.empty_pass()


def shard(lm: Any, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype, device: torch.device) -> _Root:
    """``fully_shard`` every decoder layer, then the root, on a mesh of ``device``'s type
    (FSDP2's default mesh is CUDA whenever CUDA is visible, even for CPU ranks);
    gradients are summed, not averaged."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for layer in lm.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    root = _Root(lm)
    fully_shard(root, mesh=mesh, mp_policy=mp)
    for m in root.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # the loss is already divided by the global D
            m.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no pre-multiplied sum)
    return root


class RankTrainer(Trainer):
    """A ``Trainer`` on one FSDP2 rank; every method is collective (all ranks call it)."""

    def __init__(self, model: Any, loss_cfg: Any, *, device: str | torch.device = "cpu", reduce_dtype: str = "fp32",
                 ckpt_dir: str | None = None, precision: str = "fp32", **kw: Any) -> None:
        if getattr(loss_cfg, "ref_kl", None) is not None:
            raise ValueError("loss.ref_kl is not supported with trainer.world_size > 1")
        if precision not in DTYPES:
            raise ValueError(f"optim.precision {precision!r} is not one of {tuple(DTYPES)} on trainer ranks")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.ckpt_dir = Path(ckpt_dir) if ckpt_dir else None
        # the collectives' device, set before anything below runs one
        self.device = torch.device(device)
        model.to(device=self.device, dtype=torch.float32)  # the float32 shards live on the rank's device
        param_dtype = DTYPES[precision] if precision != "fp32" else None
        self.root = shard(model, param_dtype, DTYPES[reduce_dtype], self.device)
        self.root.trainer = self
        # the shards stay float32 (FSDP2 casts for compute): the Trainer's bf16 master copy is not needed
        super().__init__(model, loss_cfg, precision="fp32", **kw)
        self.compute_precision = precision
        self._batch: list[Any] = []

    # -- collectives around the single-rank step

    def _all(self, x: float, op: Any = dist.ReduceOp.SUM) -> float:
        return all_reduce_scalar(x, op, self.device)

    def _prepare(self, trajectories: Any, advantages: Any, strict: bool) -> tuple[list[Any], Any]:
        records, stats = super()._prepare(trajectories, advantages, strict)  # whole batch, same on all ranks
        self._batch = records
        n = len(records)
        if 0 < n < self.world:
            raise ValueError(f"{n} trainable trajectories cannot be split over trainer.world_size={self.world}")
        lo, hi = self.rank * n // self.world, (self.rank + 1) * n // self.world
        return records[lo:hi], stats

    def _micro(self, records: list[Any], budget: int | None = None) -> list[Any]:
        local = super()._micro(records, budget) if records else []
        busiest = int(self._all(len(local), dist.ReduceOp.MAX))
        return _Lockstep(local, busiest - len(local), self)

    def empty_pass(self) -> None:
        out = self.root(None, None)
        if torch.is_grad_enabled():
            out.backward()

    def _forward(self, tb: Any, records: Any = None) -> Any:
        return self.root(tb, records)

    def denominator(self, records: list[Any], mode: str, G: int | None, max_len: int | None) -> float:
        if mode == "seq_mean_token_sum_norm" and max_len is None and self.gen_budget is None:
            local = max((int(r.gen_pos.numel()) for r in records), default=0)
            max_len = int(self._all(local, dist.ReduceOp.MAX))  # the fallback over the whole batch
        local_d = super().denominator(records, mode, G, max_len) if records else 0.0
        return self._all(local_d)  # Σ over ranks: every rank divides by the same D

    def step(self, trajectories: Any, advantages: Any, **kw: Any) -> dict[str, float]:
        metrics = super().step(trajectories, advantages, **kw)
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, metrics)
        out: dict[str, float] = {}
        for k in metrics:
            vals = [float(m[k]) for m in gathered if k in m]
            out[k] = sum(vals) if k in _SUMMED else sum(vals) / len(vals)
        out["train/trajectories"] = float(len(self._batch))
        out["train/tokens"] = float(sum(int(r.gen_pos.numel()) for r in self._batch))
        out["train/world_size"] = float(self.world)
        return out

    # -- weights and checkpoints

    def state_dict_for_samplers(self) -> dict[str, Tensor]:
        """The full state, gathered (collective); rank 0 gets the tensors, other ranks ``{}``."""
        from mixrl.train.lora import publishable

        return publishable(self.model, self._full())

    def _full(self) -> dict[str, Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full: dict[str, Any] = get_model_state_dict(self.model, options=opts)
        dtype = DTYPES[self.compute_precision]
        return {k: v.to(dtype) for k, v in full.items()} if self.rank == 0 else {}

    def export(self, out_dir: str, tokenizer: Any) -> None:
        """HF export of the gathered (and, with LoRA, merged) weights; rank 0 writes."""
        from mixrl.train.lora import export_merged

        full = self._full()
        if self.rank == 0:
            export_merged(self.model, full, tokenizer, out_dir)
        dist.barrier()

    def state_dict(self) -> dict[str, Any]:
        """Each rank writes its shard (DCP); the returned state names the directory."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if self.ckpt_dir is None:
            raise ValueError("RankTrainer needs ckpt_dir for sharded checkpoints")
        path = self.ckpt_dir / f"v{self.version:08d}"
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=_frozen_out())
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(path))
        dist.barrier()
        if self.rank == 0:  # keep the newest three versions on disk
            for old in sorted(self.ckpt_dir.glob("v*"))[:-3]:
                shutil.rmtree(old, ignore_errors=True)
        return {"dcp": str(path), "world_size": self.world, "version": self.version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        if "dcp" not in state:
            raise ValueError("this checkpoint was written by one trainer process; set trainer.world_size=1 "
                             "to resume it")
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=_frozen_out())
        sd: dict[str, Any] = {"model": model_sd, "optimizer": optim_sd}
        dcp.load(sd, checkpoint_id=state["dcp"])  # resharded if world_size changed
        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"],
                       options=_frozen_out())
        self.version = int(state["version"])

    def local_memory_bytes(self) -> int:
        """Bytes of this rank's parameter shards plus its AdamW state (the FSDP saving)."""
        def local(t: Tensor) -> Tensor:
            return t.to_local() if hasattr(t, "to_local") else t

        n = sum(local(p).numel() * local(p).element_size() for p in self.model.parameters())
        for st in self.optimizer.state.values():
            n += sum(local(v).numel() * local(v).element_size() for v in st.values()
                     if isinstance(v, Tensor) and v.dim() > 0)
        return n


def _frozen_out() -> Any:
    """Checkpoint options: frozen weights (the base model under LoRA) are not written."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_device(rank: int, use_gpu: bool) -> str:
    """``cuda:<rank mod visible devices>`` for a GPU rank (Ray shows an actor only its own
    GPUs), else ``cpu``. A GPU rank where torch sees no usable GPU fails in one line."""
    if not use_gpu:
        return "cpu"
    from mixrl.runtime.gpu import require_cuda

    require_cuda("trainer.num_gpus > 0")
    return f"cuda:{rank % torch.cuda.device_count()}"


def setup_threads(n: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", str(n))
    torch.set_num_threads(n)
