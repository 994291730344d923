"""Trainer ranks: FSDP2 data parallelism over ``trainer.world_size`` processes.

Every rank holds 1/N of the parameters, gradients and AdamW state
(``torch.distributed.fsdp.fully_shard`` on each decoder layer and on the
root; gloo on CPU, NCCL on GPU) and trains on 1/N of each batch::

    driver ──(trajectories, advantages)──► every rank
    rank r: prepare(whole batch)           same records, same drop counters on every rank
            records[r·S/N : (r+1)·S/N]     its contiguous slice             (train.parallel.Ranks)
            D = all_reduce(Σ local D)      the caller-provided global denominator (aggregation.py)
            forward/backward per micro-batch; reduce-scatter SUMS the gradients
            clip (global norm over the shards), AdamW on the local shard
    rank 0 ──metrics──► driver             loss summed over ranks, other metrics averaged

The trainer's step is the single-process one; what differs on ranks is the
``train.parallel.Ranks`` seam it is given (shard, all-reduce, the forward inside
the FSDP2 root, lockstep padding, the metrics' reduction).

With the global ``D`` and summed gradients, N ranks compute exactly the update
of one rank on the whole batch (up to float summation order). FSDP2 runs a
collective in every forward and backward, so all ranks must run the same
number of passes: a rank with fewer micro-batches than the busiest one runs
empty passes (a 1-token forward whose loss is 0) until they agree.

Mixed precision: ``optim.precision = "bf16"`` (or ``"fp16"``) becomes FSDP2's
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=trainer.reduce_dtype)``;
the sharded parameters and AdamW stay float32 (the master copy).

Devices: a rank lives on one device (``runtime.ranks.rank_device``: ``cuda:<local index>``
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from mixrl.train.lora import export_merged, publishable
from mixrl.train.parallel import Ranks
from mixrl.train.trainer import Trainer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def init_rank(rank: int, world: int, addr: str, port: int, device: str) -> torch.device:
    """Join the process group (NCCL on CUDA, else gloo); the rank's device."""
    dev = torch.device(device)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world,
                            device_id=dev if dev.type == "cuda" else None)
    return dev


class _Root(nn.Module):
    """The FSDP2 root: one forward that runs the trainer's whole log-prob pass ``fn``.

    The trainer reads ``lm.model`` and ``lm.lm_head.weight`` itself; inside this
    forward the root's parameters (embeddings, final norm, tied head) are
    unsharded, and the backward hooks reduce-scatter their gradients.
    """

    def __init__(self, lm: Any) -> None:
        super().__init__()
        self.lm: Any = lm

    def forward(self, tb: Any, records: Any, fn: Callable[[Any, Any], Any] | None) -> Any:
        if fn is None:  # an empty pass: same collectives as a real one, zero loss and gradient
            ids = torch.zeros(1, 1, dtype=torch.long, device=self.lm.lm_head.weight.device)
            h = self.lm.model(input_ids=ids).last_hidden_state
            return h.sum() * 0.0 + self.lm.lm_head.weight.sum() * 0.0
        return fn(tb, records)


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
        dev = torch.device(device)  # the collectives' device
        model.to(device=dev, dtype=torch.float32)  # the float32 shards live on the rank's device
        param_dtype = DTYPES[precision] if precision != "fp32" else None
        root = shard(model, param_dtype, DTYPES[reduce_dtype], dev)
        # the shards stay float32 (FSDP2 casts for compute): the Trainer's bf16 master copy is not needed
        super().__init__(model, loss_cfg, precision="fp32", parallel=Ranks(root, dev), **kw)
        self.compute_precision = precision

    # -- weights and checkpoints

    def state_dict_for_samplers(self) -> dict[str, Tensor]:
        """The full state, gathered (collective); rank 0 gets the tensors, other ranks ``{}``."""

        return publishable(self.model, self._full())

    def sampler_views(self) -> dict[str, Tensor]:  # gathered: new tensors already
        return self.state_dict_for_samplers()

    def _full(self) -> dict[str, Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full: dict[str, Any] = get_model_state_dict(self.model, options=opts)
        dtype = DTYPES[self.compute_precision]
        return {k: v.to(dtype) for k, v in full.items()} if self.rank == 0 else {}

    def export(self, out_dir: str, tokenizer: Any) -> None:
        """HF export of the gathered (and, with LoRA, merged) weights; rank 0 writes."""

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


def setup_threads(n: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", str(n))
    torch.set_num_threads(n)
