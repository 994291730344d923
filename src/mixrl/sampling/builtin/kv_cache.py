"""A preallocated per-layer KV cache for one batch, written in the profile's KV format.

Layout per layer, in the compute dtype: keys and values ``[B, Hkv, T, D]``, so
that both decode matmuls (q @ K^T and p @ V) read a prefix view
``[:, :, :end]`` that is one contiguous block per (row, kv head), without
copying; decode attention is bound by reading the cache, and contiguous blocks
read it ~20-30% faster than keys stored transposed ``[B, Hkv, D, T]`` (whose
prefix view is ``D`` strided runs per block). The engine
left-pads prompts so that every row's prompt ends at the same column; one
decode step then writes one column for the whole batch.

KV quantization is emulated on write: ``Precision.kv`` fake-quantizes what is
stored (scale per token and head, over ``head_dim``), and attention — the
current token included — reads the stored values, as an FP8-KV engine does.
"""

from __future__ import annotations

import torch

from mixrl.sampling.builtin.precision import Hook


class KVCache:
    def __init__(
        self, layers: int, batch: int, kv_heads: int, length: int, head_dim: int,
        dtype: torch.dtype, quantize: Hook | None,
    ) -> None:
        shape = (batch, kv_heads, length, head_dim)
        # empty, not zeros: attention only reads columns [0, end) and every one of them
        # has been written (prefill writes all P columns, padding included, and each
        # decode step writes its column before reading), so garbage is never read.
        self.k = [torch.empty(shape, dtype=dtype) for _ in range(layers)]
        self.v = [torch.empty(shape, dtype=dtype) for _ in range(layers)]
        self.quantize = quantize
        self.length = length

    def write(
        self, layer: int, col0: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v ``[B, Hkv, T, D]`` at columns [col0, col0 + T); return the layer's
        whole cache: keys and values ``[B, Hkv, length, D]``."""
        if self.quantize is not None:  # per token and head, over head_dim
            k, v = self.quantize(k), self.quantize(v)
        end = col0 + k.shape[2]
        if end > self.length:
            raise IndexError(f"KV cache write to column {end - 1} beyond its length {self.length}")
        self.k[layer][:, :, col0:end] = k
        self.v[layer][:, :, col0:end] = v
        return self.k[layer], self.v[layer]

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Drop finished rows (``rows`` [B'] long: the rows to keep, in order)."""
        self.k = [t.index_select(0, rows) for t in self.k]
        self.v = [t.index_select(0, rows) for t in self.v]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
