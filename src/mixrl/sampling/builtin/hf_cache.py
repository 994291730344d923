"""A transformers ``DynamicCache`` that stores keys and values in the profile's KV format,
in buffers with room to grow.

The generic path runs the HF model's own attention; KV quantization is emulated
on write, as in the fast path's ``KVCache``: ``update`` fake-quantizes the new
keys/values ``[B, Hkv, T, D]`` (scale per token and head, over ``head_dim``,
``numerics.quantize_kv``) before they are stored, and attention — the current
token included — reads the stored values, as an FP8-KV engine does.

Storage: HF's ``DynamicLayer`` concatenates the whole cache with each new token
(a copy of every column written so far, per layer and step: quadratic in the
output length, and on a 4-layer 3M-parameter model at batch 64 the largest cost
of a decode step). Full-attention layers here are ``GrowingLayer``: ``keys`` and
``values`` are prefix views ``[:rows, :, :n]`` of buffers with spare columns, a
step writes its columns in place, and the buffers double when full (amortized
O(1) copying per column). Anything that replaces ``keys``/``values`` (row
selection, the generic path's absorb and trim) is picked up on the next write,
which copies them into a fresh buffer. Attention reads the same values either
way. Sliding-window layers (Mistral, Qwen2 with ``use_sliding_window``) keep
their own layer classes: only what is written changes.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from mixrl.sampling.builtin.precision import Hook

MIN_COLUMNS = 64  # spare columns of a fresh buffer at least (prefill + the first decode steps)


def _in(t: torch.Tensor, buf: torch.Tensor | None) -> bool:
    """``t`` is the prefix view ``buf[:rows, :, :n]``."""
    return (
        buf is not None and t.dim() == 4 and t.data_ptr() == buf.data_ptr() and t.stride() == buf.stride()
        and t.shape[0] <= buf.shape[0] and t.shape[1] == buf.shape[1] and t.shape[3] == buf.shape[3]
    )  # fmt: skip


class GrowingLayer(DynamicLayer):
    """``DynamicLayer`` whose keys/values are prefix views of buffers written in place."""

    def __init__(self, capacity: int = 0) -> None:
        super().__init__()
        self.capacity = capacity  # columns of the first buffer (the batch's expected length)
        self._bk: torch.Tensor | None = None
        self._bv: torch.Tensor | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, T, rows = self.get_seq_length(), key_states.shape[-2], key_states.shape[0]
        bk, bv = self._bk, self._bv
        fits = n == 0 or (_in(self.keys, bk) and _in(self.values, bv) and self.keys.shape[0] == rows)
        if not fits or bk is None or bv is None or bk.shape[0] < rows or n + T > bk.shape[2]:
            if bk is None and self.capacity:  # first write: the batch's expected length
                cap = max(n + T, self.capacity)
            else:  # doubling: amortized O(1) copies per column
                cap = max(2 * (n + T), n + T + MIN_COLUMNS)
            shape = (rows, key_states.shape[1], cap, key_states.shape[3])
            bk = torch.empty(shape, dtype=key_states.dtype, device=key_states.device)
            bv = torch.empty(shape, dtype=value_states.dtype, device=value_states.device)
            if n:
                bk[:, :, :n] = self.keys
                bv[:, :, :n] = self.values
            self._bk, self._bv = bk, bv
        bk[:rows, :, n : n + T] = key_states
        bv[:rows, :, n : n + T] = value_states
        self.keys, self.values = bk[:rows, :, : n + T], bv[:rows, :, : n + T]
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows ``indices``, compacted in place into the first rows of the buffers."""
        n = self.get_seq_length()
        if n == 0 or not (_in(self.keys, self._bk) and _in(self.values, self._bv)):
            return super().batch_select_indices(indices)
        assert self._bk is not None and self._bv is not None
        m = len(indices)
        for buf, cur in ((self._bk, self.keys), (self._bv, self.values)):
            buf[:m, :, :n] = cur.index_select(0, indices)
        self.keys, self.values = self._bk[:m, :, :n], self._bv[:m, :, :n]

    def reset(self) -> None:
        self._bk = self._bv = None
        super().reset()


class QuantizedKVCache(DynamicCache):
    def __init__(self, quantize: Hook | None, config: Any = None, capacity: int = 0) -> None:
        """``capacity``: columns to allocate at the first write (0: as many as written + MIN_COLUMNS)."""
        super().__init__(config=config)
        self.quantize = quantize
        # full-attention layers grow in place; other layer kinds (sliding windows) stay HF's
        self.layers = [GrowingLayer(capacity) if type(layer) is DynamicLayer else layer for layer in self.layers]
        if self.layer_class_to_replicate is DynamicLayer:
            self.layer_class_to_replicate = lambda: GrowingLayer(capacity)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.quantize is not None:  # per token and head, over head_dim
            key_states, value_states = self.quantize(key_states), self.quantize(value_states)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Drop finished rows (``rows`` [B'] long: the rows to keep, in order)."""
        self.batch_select_indices(rows)
