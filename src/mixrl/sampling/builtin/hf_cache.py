"""A transformers ``DynamicCache`` that stores keys and values in the profile's KV format.

The generic path runs the HF model's own attention; KV quantization is emulated
on write, as in the fast path's ``KVCache``: ``update`` fake-quantizes the new
keys/values ``[B, Hkv, T, D]`` (scale per token and head, over ``head_dim``,
``numerics.quantize_kv``) before they are stored, and attention — the current
token included — reads the stored values, as an FP8-KV engine does. Sliding
window layers (Mistral, Qwen2 with ``use_sliding_window``) keep their own
layer classes: only what is written changes.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from mixrl.sampling.builtin.precision import Hook


class QuantizedKVCache(DynamicCache):
    def __init__(self, quantize: Hook | None, config: Any = None) -> None:
        super().__init__(config=config)
        self.quantize = quantize

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.quantize is not None:  # per token and head, over head_dim
            key_states, value_states = self.quantize(key_states), self.quantize(value_states)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Drop finished rows (``rows`` [B'] long: the rows to keep, in order)."""
        self.batch_select_indices(rows)
