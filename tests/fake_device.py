"""A non-CPU device on a CPU machine, for testing that collectives use the rank's device.

``install()`` registers ``fakegpu`` (torch's PrivateUse1 slot, renamed): its
tensors hold CPU memory inside a wrapper subclass, so ordinary ops run on them
and results stay on ``fakegpu``; copying to ``cpu`` leaves the device, as it
would from CUDA. ``init_group(rank, world, port)`` joins a process group whose
*only* backend is registered for ``fakegpu`` (``"fakegpu:gloo"``), like an
NCCL-only group on CUDA: a collective on any CPU tensor fails with
``No backend type associated with device type cpu``. A collective on
``fakegpu`` tensors is carried by a side gloo group over their CPU memory.

``strict()``: within it, an op that mixes ``fakegpu`` tensors with CPU tensors of one
element or more fails as it would on CUDA ("Expected all tensors to be on the same
device"), except where CUDA accepts CPU operands (copies, advanced-indexing indices);
CPU scalars (0-dim) pass, as on CUDA.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

NAME = "fakegpu"
_SIDE: dict[str, Any] = {}
_STRICT = {"on": False}
_MIXED_OK = {"copy_", "index", "index_put", "index_put_", "_index_put_impl_"}  # CUDA takes CPU operands there


@contextlib.contextmanager
def strict() -> Iterator[None]:
    _STRICT["on"] = True
    try:
        yield
    finally:
        _STRICT["on"] = False


def _cpu_operand(args: Any, kwargs: Any) -> torch.Tensor | None:
    from torch.utils._pytree import tree_leaves

    return next((a for a in tree_leaves((args, kwargs)) if type(a) is torch.Tensor and a.dim() > 0
                 and a.device.type == "cpu"), None)


class FakeGpuTensor(torch.Tensor):
    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> FakeGpuTensor:
        r = torch.Tensor._make_wrapper_subclass(cls, inner.shape, strides=inner.stride(), dtype=inner.dtype,
                                                device=torch.device(NAME, 0))
        r.inner = inner
        return r

    def __repr__(self) -> str:
        return f"FakeGpuTensor({self.inner!r})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace == "c10d":  # the collective reached this device's backend: carry it on the side group
            args = tuple(_SIDE["pg"].boxed() if isinstance(a, torch.ScriptObject) and i == 1 else a
                         for i, a in enumerate(args))
            out = func(*tree_map(_inner, args), **tree_map(_inner, kwargs))
            return (args[0], *out[1:])  # in place: the caller's tensors, the side group's work
        if _STRICT["on"] and func._opname not in _MIXED_OK:
            cpu = _cpu_operand(args, kwargs)
            if cpu is not None:
                raise RuntimeError(f"Expected all tensors to be on the same device: {func} got a CPU tensor "
                                   f"{tuple(cpu.shape)} beside {NAME} tensors")
        out = func(*tree_map(_inner, args), **tree_map(_inner, kwargs))
        dev = kwargs.get("device", next((a for a in args[1:] if isinstance(a, torch.device)), None))
        if func._opname in ("_to_copy", "to") and dev is not None and torch.device(dev).type == "cpu":
            return out  # left the device (``.cpu()``; ``aten.to`` under inference mode)
        return tree_map(_wrap, out)


def _inner(x: Any) -> Any:
    return x.inner if isinstance(x, FakeGpuTensor) else x


def _wrap(x: Any) -> Any:
    return FakeGpuTensor(x) if isinstance(x, torch.Tensor) and not isinstance(x, FakeGpuTensor) else x


def _empty(size: Any, dtype: Any = None, layout: Any = None, device: Any = None, pin_memory: Any = None,
           memory_format: Any = None) -> FakeGpuTensor:
    return FakeGpuTensor(torch.empty(size, dtype=dtype))


def _empty_strided(size: Any, stride: Any, dtype: Any = None, layout: Any = None, device: Any = None,
                   pin_memory: Any = None) -> FakeGpuTensor:
    return FakeGpuTensor(torch.empty_strided(size, stride, dtype=dtype))


def _copy_from(src: Any, dst: Any, non_blocking: bool = False) -> Any:
    _inner(dst).copy_(_inner(src))
    return dst


def install() -> torch.device:
    """Register ``fakegpu`` once per process; its device 0."""
    if "lib" not in _SIDE:
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        _setup_privateuseone_for_python_backend(NAME)
        lib = torch.library.Library("aten", "IMPL")
        lib.impl("empty.memory_format", _empty, "PrivateUse1")
        lib.impl("empty_strided", _empty_strided, "PrivateUse1")
        lib.impl("_copy_from", _copy_from, "PrivateUse1")
        _SIDE["lib"] = lib
    return torch.device(NAME, 0)


def init_group(rank: int, world: int, port: int) -> torch.device:
    """Join a group whose only backend serves ``fakegpu``; the device collectives must use."""
    dev = install()
    dist.init_process_group(f"{NAME}:gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    _SIDE["pg"] = dist.new_group(backend="gloo")  # carries fakegpu tensors' bytes
    return dev
