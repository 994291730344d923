"""A preallocated per-layer KV cache for one batch, written in the profile's KV format.

Layout per layer, in the compute dtype: keys and values ``[B, Hkv, T, D]``, so
that both decode matmuls (q @ K^T and p @ V) read a prefix view
``[:, :, :end]`` that is one contiguous block per (row, kv head), without
copying; decode attention is bound by reading the cache, and contiguous blocks
read it ~20-30% faster than keys stored transposed ``[B, Hkv, D, T]`` (whose
prefix view is ``D`` strided runs per block). The engine
left-pads prompts so that every row's prompt ends at the same column; one
decode step then writes one column for the whole batch.

Rows can join a running batch (``absorb``): the buffers hold more rows and
columns than are in use, and *logical* column 0 sits at physical column
``origin``. A new row's prompt ends at the batch's current column; when it is
longer than the columns written so far, ``origin`` moves left (the old rows get
that many padding columns in front) instead of copying the cache, and ``trim``
moves it right once the leading columns are padding for every row. Attention
reads only logical columns, so neither margin costs compute. Columns a row does
not use are zeros (finite: a masked score of garbage could be NaN).

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
        dtype: torch.dtype, quantize: Hook | None, buffers: list[torch.Tensor] | None = None,
    ) -> None:
        shape = (batch, kv_heads, length, head_dim)
        # empty, not zeros: attention only reads columns [0, end) and every one of them
        # has been written (prefill writes all P columns, padding included, and each
        # decode step writes its column before reading), so garbage is never read.
        # ``buffers``: 2 * layers tensors of that shape to use instead (keys, then values).
        if buffers is None:
            buffers = [torch.empty(shape, dtype=dtype) for _ in range(2 * layers)]
        self.k, self.v = list(buffers[:layers]), list(buffers[layers:])
        self.quantize = quantize
        self.rows = batch  # rows in use (the buffers may hold more)
        self.origin = 0  # physical column of logical column 0
        self.used = 0  # logical columns written so far

    @property
    def length(self) -> int:
        """Logical columns available."""
        return self.k[0].shape[2] - self.origin

    def write(
        self, layer: int, col0: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v ``[B, Hkv, T, D]`` at logical columns [col0, col0 + T); return the
        layer's whole cache from logical column 0: keys and values ``[B, Hkv, length, D]``."""
        if self.quantize is not None:  # per token and head, over head_dim: k and v in one call
            k, v = self.quantize(torch.stack((k, v))).unbind(0)
        end = col0 + k.shape[2]
        if end > self.length:
            raise IndexError(f"KV cache write to column {end - 1} beyond its length {self.length}")
        K, V = self.k[layer], self.v[layer]
        if self.origin or self.rows < K.shape[0]:
            K, V = K[: self.rows, :, self.origin :], V[: self.rows, :, self.origin :]
        K[:, :, col0:end] = k
        V[:, :, col0:end] = v
        self.used = max(self.used, end)
        return K, V

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Drop finished rows (``rows`` [B'] long: the rows to keep, in order), compacting
        the columns in use into the first B' rows."""
        n, o, u = len(rows), self.origin, self.used
        for t in self.k + self.v:
            t[:n, :, o : o + u] = t[: self.rows, :, o : o + u].index_select(0, rows)
        self.rows = n

    def trim(self, cols: int) -> int:
        """Forget the first ``cols`` logical columns (padding for every row); returns how many."""
        cols = min(cols, self.used)
        self.origin += cols
        self.used -= cols
        return cols

    def absorb(self, other: KVCache, col: int, need: int, max_rows: int) -> int:
        """Append ``other``'s rows (a prefill that wrote its logical columns [0, P)) so that
        their last column is this batch's column ``col - 1``; room for ``need`` more columns
        from there. Returns the shift: how far this batch's logical columns moved right
        (``max(0, P - col)``, the old rows' new leading padding)."""
        P, n, b = other.used, other.rows, self.rows
        shift = max(0, P - col)
        c = col + shift  # the joint batch's current column
        o = self.origin - shift
        cap_rows, cap_cols = self.k[0].shape[0], self.k[0].shape[2]
        if o < 0 or b + n > cap_rows or o + c + need > cap_cols:  # grow: margins for later rows
            rows = max(b + n, min(max_rows, 2 * (b + n)))
            left = max(c, 16)
            cols = left + c + need + max(need, c) // 2
            shape = (rows, self.k[0].shape[1], cols, self.k[0].shape[3])
            for lst in (self.k, self.v):
                for i, t in enumerate(lst):
                    new = torch.zeros(shape, dtype=t.dtype, device=t.device)
                    new[:b, :, left + shift : left + c] = t[:b, :, self.origin : self.origin + col]
                    lst[i] = new
            o = left
        elif shift:  # the old rows' new leading columns: padding, made finite
            for t in self.k + self.v:
                t[:b, :, o : o + shift] = 0
        for mine, theirs in ((self.k, other.k), (self.v, other.v)):
            for t, s in zip(mine, theirs, strict=True):
                t[b : b + n, :, o : o + c - P] = 0
                t[b : b + n, :, o + c - P : o + c] = s[:n, :, other.origin : other.origin + P]
        self.origin, self.rows, self.used = o, b + n, c
        return shift

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
