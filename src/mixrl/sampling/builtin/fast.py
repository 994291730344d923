"""The built-in engine's fast path for dense decoders: the hand-fused forward of ``decoder_forward``.

A *path* is what ``BuiltinEngine`` decodes with. Both paths (this one and
``generic.GenericPath``) have the same small interface:

- ``build(state_dict)`` -> weights: quantized once, served until the next load;
- ``begin(w, ids, start, length)`` -> (batch, hidden): prefill of left-padded
  prompts ``ids`` [B, P] whose first real column is ``start`` [B], with room for
  ``length`` columns; ``hidden`` [B, H] is the last column's final hidden state;
- ``batch.step(tok, pos, col, start, padded)`` -> hidden: one token per row
  (``tok`` [b], RoPE position ``pos`` [b]) written at cache column ``col``;
- ``batch.keep_rows(idx)``: drop finished rows; ``batch.routing()``: the top-k
  experts of the last forward's last column ``[b, layers, k]`` (None: no MoE);
- ``batch.absorb(other, col, need, max_rows)`` -> shift: rows joining a running
  batch (``other``: a ``begin`` of their prompts) so that their prompts end at its
  column ``col - 1``; the old rows' columns move right by ``shift`` (when the new
  prompts are longer than ``col``); ``batch.trim(cols)`` -> columns forgotten: leading
  columns that are padding for every row; ``batch.can_absorb`` says whether rows can join;
- ``logits(w, hidden)`` -> float32 [b, V];
- ``begin(..., prefix, rows)`` reuses KV (``prefix_cache``): ``prefix`` = (col0, per row the
  keys and values [2 layers, Hkv, col0 - start, D] of its columns [start, col0), or None), so
  only columns [col0, P) are computed; ``rows`` [R]: the batch has R rows, row i a copy of
  prefilled row ``rows[i]``; ``batch.row_kv(j, c0, c1)``: row j's stored keys and values.

This path applies to the dense decoders of ``decoder_forward.ARCHITECTURES`` (Qwen3,
Llama, Mistral, Qwen2; ``applies`` says why not otherwise); every other causal LM runs
on the generic path. Its name is ``"<model_type>-fast"``.

On an accelerator (``device``) the weights, the KV cache and every forward live there;
the batch's bookkeeping stays on the CPU: ``begin`` and ``step`` take CPU ids and
positions, ``logits`` returns CPU logits (sampling, ``sample``, runs on the CPU).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from mixrl.sampling.builtin import decoder_forward as qf
from mixrl.sampling.builtin.kv_cache import KVCache
from mixrl.sampling.builtin.precision import Precision


def applies(cfg: Any) -> str | None:
    """None when the fast path can run ``cfg``, else the reason it cannot."""
    try:
        qf.Shape.from_config(cfg)
    except (ValueError, AttributeError) as e:
        return str(e)
    return None


class FastPath:
    def __init__(self, cfg: Any, prec: Precision, max_context: int | None, max_batch: int,
                 device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.shape = qf.Shape.from_config(cfg)
        self.name = f"{cfg.model_type}-fast"
        self.prec, self.max_batch = prec, max_batch
        self.max_positions = self.shape.max_positions
        self.vocab = self.shape.vocab
        self.rope_len = max_context or self.max_positions
        self._pool = _Pool()
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None  # the same for every weights load

    def build(self, state_dict: Any) -> qf.Weights:
        if self._rope is None:
            cos, sin = qf.rope_tables(self.shape, self.rope_len, self.prec.dtype)
            self._rope = (cos.to(self.device), sin.to(self.device))
        return qf.build_weights(state_dict, self.shape, self.prec, self.rope_len, self.max_batch, self._rope,
                                self.device)

    def begin(
        self, w: qf.Weights, ids: torch.Tensor, start: torch.Tensor, length: int,
        prefix: tuple[int, list[torch.Tensor | None]] | None = None, rows: torch.Tensor | None = None,
    ) -> tuple[Any, torch.Tensor]:
        B, P = ids.shape
        R = B if rows is None else len(rows)  # rows of the batch (``rows``: copies of the prefilled ones)
        shape, prec, dev = self.shape, self.prec, self.device
        ids, start = ids.to(dev), start.to(dev)
        rows = None if rows is None else rows.to(dev)
        col = torch.arange(P, device=dev)
        pos = (col[None, :] - start[:, None]).clamp(min=0)  # [B, P]
        # may attend: real key columns up to the query; padded queries attend to themselves only
        mask = (col[None, None, :] >= start[:, None, None]) & (col[None, None, :] <= col[None, :, None])
        mask |= torch.eye(P, dtype=torch.bool, device=dev)[None]
        n = R * shape.kv_heads * length * shape.head_dim
        base, flat = self._pool.take(2 * shape.layers * n, prec.dtype, dev)
        every = flat.view(2 * shape.layers, R, shape.kv_heads, length, shape.head_dim)  # keys, then values
        cache = KVCache(shape.layers, R, shape.kv_heads, length, shape.head_dim, prec.dtype, prec.kv, list(every))
        cache.rows = B
        weakref.finalize(cache, self._pool.give, base)  # back to the pool when the batch is dropped
        col0 = 0
        if prefix is not None:  # reused columns [start, col0) of each row, as stored (see prefix_cache)
            col0, kvs = prefix
            every[:, :B, :, :col0] = 0  # the padding before them: finite
            for u, kv in enumerate(kvs):
                if kv is not None:
                    every[:, u, :, col0 - kv.shape[2] : col0] = kv
            mask = mask[:, col0:]  # [B, T, P]: the new tokens' queries
            if P - col0 == 1:  # one query: the decode kernel's additive bias
                mask = torch.zeros(mask.shape, dtype=prec.dtype, device=dev).masked_fill_(~mask, float("-inf"))
        hidden = qf.forward(w, shape, prec, cache, ids[:, col0:], pos[:, col0:], col0, mask.unsqueeze(1))  # [B, H]
        if rows is not None:  # prefix sharing: each request's row copies its prompt's
            every[:, :R, :, :P] = every[:, :B, :, :P].index_select(1, rows)
            cache.rows = R
            hidden = hidden.index_select(0, rows)
        return _FastBatch(w, shape, prec, cache), hidden

    def idle_bytes(self) -> int:
        """Bytes of the KV storage the pool keeps for the next batch."""
        t = self._pool.idle
        return 0 if t is None else t.numel() * t.element_size()

    def logits(self, w: qf.Weights, hidden: torch.Tensor) -> torch.Tensor:
        return qf.lm_head(w, self.prec, hidden).cpu()  # a no-op on the CPU


class _Pool:
    """The storage of the last dropped KV cache, kept for the next batch, as an inference
    engine allocates its KV memory once rather than per batch.

    A fresh cache of the reference bench (4 layers, batch 64, 144 columns) is 38 MB whose
    pages the kernel maps and zeroes on first touch, ~9k page faults per batch (the bench's
    faults per generate call went from ~14.7k to ~4-6k, those left are the prefill's
    activations); side by side at load ~1.3 on 2 vCPUs, 4369 vs 4249 CPU tokens/s. Reused storage is zeroed first
    (what a fresh mapping holds), so a reused cache starts as a fresh one. At most one
    storage is idle (the largest returned); a batch that finds none, or one too small,
    allocates its own. Memory held when idle: one cache.
    """

    def __init__(self) -> None:
        self.idle: torch.Tensor | None = None
        self.lock = threading.Lock()

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(storage, its first ``numel`` elements zeroed or fresh)."""
        with self.lock:
            t = self.idle
            if t is not None and t.dtype == dtype and t.numel() >= numel and t.device == device:
                self.idle = None
                return t, t[:numel].zero_()
        t = torch.empty(numel, dtype=dtype, device=device)
        return t, t

    def give(self, t: torch.Tensor) -> None:
        with self.lock:
            if self.idle is None or self.idle.dtype != t.dtype or t.numel() > self.idle.numel():
                self.idle = t


class _FastBatch:
    __slots__ = ("w", "shape", "prec", "cache")
    can_absorb = True

    def __init__(self, w: qf.Weights, shape: qf.Shape, prec: Precision, cache: KVCache) -> None:
        self.w, self.shape, self.prec, self.cache = w, shape, prec, cache

    def step(self, tok: torch.Tensor, pos: torch.Tensor, col: int, start: torch.Tensor, padded: bool) -> torch.Tensor:
        dev = self.w.embed.device
        tok, pos, start = tok.to(dev), pos.to(dev), start.to(dev)
        bias = None  # additive attention bias hiding left padding, only if a row is padded
        if padded:
            pad = torch.arange(col + 1, device=dev)[None, :] < start[:, None]  # [b, col + 1]
            bias = torch.zeros(pad.shape, dtype=self.prec.dtype, device=dev).masked_fill_(pad, float("-inf"))[:, None, None]
        return qf.forward(self.w, self.shape, self.prec, self.cache, tok[:, None], pos[:, None], col, bias)

    def keep_rows(self, idx: torch.Tensor) -> None:
        self.cache.keep_rows(idx.to(self.w.embed.device))

    def absorb(self, other: _FastBatch, col: int, need: int, max_rows: int) -> int:
        return self.cache.absorb(other.cache, col, need, max_rows)

    def trim(self, cols: int) -> int:
        return self.cache.trim(cols)

    def routing(self) -> None:
        return None

    def row_kv(self, j: int, c0: int, c1: int) -> torch.Tensor:
        """Row ``j``'s keys and values at logical columns [c0, c1): [2 layers, Hkv, c1 - c0, D], a copy."""
        o = self.cache.origin
        return torch.stack([t[j, :, o + c0 : o + c1] for t in self.cache.k + self.cache.v])
