"""Import torchao's MX / NVFP4 reference implementations quietly.

On a machine without CUDA, importing torchao logs one warning per CUDA
extension it cannot load and torch logs pytree deprecation notes; none of them
concern the pure-torch reference code used here. The extension warnings are
dropped by a filter on the ``torchao`` logger (``mixrl.system.quiet``), installed here
before the import (and by every entry point, for a library that imports torchao itself);
the pytree notes are muted during the import (the logger's level is restored
afterwards).
"""

from __future__ import annotations

import functools
import logging
from types import SimpleNamespace

from mixrl.system.quiet import install_filters


@functools.cache
def torchao_mx() -> SimpleNamespace:
    install_filters()
    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32
        from torchao.prototype.mx_formats.mx_tensor import MXTensor
        from torchao.prototype.mx_formats.nvfp4_tensor import (
            NVFP4Tensor,
            per_tensor_amax_to_scale,
        )
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
    return SimpleNamespace(
        MXTensor=MXTensor,
        NVFP4Tensor=NVFP4Tensor,
        per_tensor_amax_to_scale=per_tensor_amax_to_scale,
        f4_unpacked_to_f32=f4_unpacked_to_f32,
    )
