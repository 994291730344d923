"""The built-in engine's generic path: any ``AutoModelForCausalLM``, formats emulated in place.

The model is the HF model itself, run incrementally through its own modules,
with the profile applied the way an engine that quantizes on load would:

- weights: every ``nn.Linear`` weight (``lm_head`` only with
  ``quantize_lm_head``) is fake-quantized once per load through
  ``numerics.quantize_weight`` in float32 and then cast to the compute dtype;
  MoE expert banks stored as 3-D tensors ``[E, out, in]`` are quantized expert by
  expert, so per-tensor scales are per expert as in a real engine;
- KV cache: ``hf_cache.QuantizedKVCache`` quantizes keys/values on write;
- activations: a forward pre-hook quantizes the input of every quantized
  Linear (and of each expert bank's first GEMM) with ``quantize_activation``.

Left padding is an HF ``attention_mask`` with explicit ``position_ids``, so each
row sees only its own tokens. MoE routers (a module with ``top_k``,
``num_experts`` and a ``weight``, returning ``(logits, weights, indices)``, as
Qwen3-MoE's ``Qwen3MoeTopKRouter``) get a forward hook that records the
selected experts; ``routing()`` returns them for the last column.

Interface: see ``fast`` (both paths are driven by ``BuiltinEngine`` alike).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import DynamicLayer

from mixrl.models.moe import is_router
from mixrl.sampling.builtin.decoder_forward import strip_wrapper_prefixes
from mixrl.sampling.builtin.hf_cache import GrowingLayer, QuantizedKVCache
from mixrl.sampling.builtin.precision import Precision


def is_expert_bank(mod: nn.Module) -> bool:
    return type(mod).__name__.endswith("Experts") and any(p.dim() == 3 for p in mod.parameters(recurse=False))


class GenericPath:
    name = "generic"

    def __init__(self, model: nn.Module, prec: Precision) -> None:
        """``model``: the HF causal LM in float32 (its structure and buffers are kept, not its weights)."""
        self.prec, self.cfg = prec, model.config
        self.vocab = int(model.get_output_embeddings().weight.shape[0])
        self.max_positions = int(getattr(self.cfg, "max_position_embeddings", 1 << 20))
        self.tied = bool(getattr(self.cfg.get_text_config(decoder=True), "tie_word_embeddings", False))
        self._buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
        self._skeleton = copy.deepcopy(model).to("meta")  # structure only: weights come from build()
        head = model.get_output_embeddings()
        names = {m: n for n, m in model.named_modules()}
        self._linear = {f"{names[m]}.weight" for m in model.modules()
                        if isinstance(m, nn.Linear) and (m is not head or prec.quantize_lm_head)}  # fmt: skip
        self._banks = {f"{names[m]}.{p}" for m in model.modules() if is_expert_bank(m)
                       for p, t in m.named_parameters(recurse=False) if t.dim() == 3}  # fmt: skip
        self.head_name = f"{names[head]}.weight"
        self.has_moe = any(is_router(m) for m in model.modules())
        # KV reuse (prefix sharing, session caches) copies plain full-attention layers only
        self.reuses_kv = all(type(x) is GrowingLayer for x in QuantizedKVCache(None, self.cfg).layers)
        self._routes: list[torch.Tensor] = []

    # ------------------------------------------------------------------ weights
    def build(self, state_dict: Mapping[str, Any]) -> nn.Module:
        sd, dt, prec = strip_wrapper_prefixes(state_dict), self.prec.dtype, self.prec
        need = self._skeleton.state_dict().keys()
        out: dict[str, torch.Tensor] = {}
        for name in need:
            if name not in sd:
                if name == self.head_name and self.tied:
                    continue
                raise KeyError(f"state_dict has no {name!r} (expected the HF parameter names of {type(self._skeleton).__name__})")
            w = sd[name].detach().to(torch.float32, copy=True)  # a copy: the trainer updates in place
            if name in self._linear:
                w = prec.weight(w)
            elif name in self._banks:
                w = torch.stack([prec.weight(w[e]) for e in range(w.shape[0])])
            out[name] = w.to(dt)
        m = copy.deepcopy(self._skeleton).to_empty(device="cpu")
        m.load_state_dict(out, strict=False, assign=True)
        for n, b in self._buffers.items():  # RoPE tables etc.: not in the state dict
            mod, _, attr = n.rpartition(".")
            m.get_submodule(mod).register_buffer(attr, b.clone(), persistent=False)
        head = m.get_output_embeddings()
        if self.tied:
            emb = m.get_input_embeddings().weight
            head.weight = nn.Parameter(prec.weight(emb.float()).to(dt)) if prec.quantize_lm_head else emb
        m.eval().requires_grad_(False)
        self._hook(m)
        return m

    def _hook(self, m: nn.Module) -> None:
        act = self.prec.act
        names = {mod: n for n, mod in m.named_modules()}
        for mod in m.modules():
            if act is not None and (f"{names[mod]}.weight" in self._linear or is_expert_bank(mod)):
                mod.register_forward_pre_hook(lambda _m, a: (act(a[0]), *a[1:]))
            if is_router(mod):
                mod.register_forward_hook(lambda _m, _a, o: self._routes.append(o[2].detach()))

    # --------------------------------------------------------------- generation
    def begin(
        self, m: nn.Module, ids: torch.Tensor, start: torch.Tensor, length: int,
        prefix: tuple[int, list[torch.Tensor | None]] | None = None, rows: torch.Tensor | None = None,
    ) -> tuple[Any, torch.Tensor]:
        """See ``fast``; ``prefix`` and ``rows`` need ``reuses_kv`` (full-attention layers only)."""
        B, P = ids.shape
        col = torch.arange(P)
        am = (col[None, :] >= start[:, None]).long()  # [B, P] 1 on real tokens
        pos = (col[None, :] - start[:, None]).clamp(min=0)
        cache = QuantizedKVCache(self.prec.kv, self.cfg, length)
        batch = _GenericBatch(self, m, cache, am)
        col0 = 0
        if prefix is not None:  # reused columns [start, col0) of each row, stored as they were written
            col0, kvs = prefix
            some = next(kv for kv in kvs if kv is not None)  # [2 layers, Hkv, r, D]
            past = some.new_zeros((some.shape[0], B, some.shape[1], col0, some.shape[3]))
            for u, kv in enumerate(kvs):
                if kv is not None:
                    past[:, u, :, col0 - kv.shape[2] :] = kv
            n = len(cache.layers)
            for li, layer in enumerate(cache.layers):  # the layer's own write: no second quantization
                layer.update(past[li], past[n + li])
        hidden = batch.forward(ids[:, col0:], pos[:, col0:])
        if rows is not None:  # prefix sharing: each request's row copies its prompt's
            for layer in cache.layers:
                layer.keys, layer.values = layer.keys.index_select(0, rows), layer.values.index_select(0, rows)
            batch.am = am.index_select(0, rows)
            if batch._route is not None:
                batch._route = batch._route.index_select(0, rows)
            hidden = hidden.index_select(0, rows)
        return batch, hidden

    def logits(self, m: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return m.get_output_embeddings()(hidden).float()


class _GenericBatch:
    def __init__(self, path: GenericPath, m: nn.Module, cache: QuantizedKVCache, am: torch.Tensor) -> None:
        self.path, self.m, self.cache, self.am = path, m, cache, am
        self._route: torch.Tensor | None = None

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        routes = self.path._routes
        routes.clear()
        out = self.m.base_model(input_ids=ids, attention_mask=self.am, position_ids=pos,
                                past_key_values=self.cache, use_cache=True)  # fmt: skip
        if routes:  # per MoE layer [B * T, k] -> the last column's [B, layers, k]
            B, T = ids.shape
            self._route = torch.stack([r.view(B, T, -1)[:, -1] for r in routes], dim=1)
            routes.clear()
        return out.last_hidden_state[:, -1]  # [B, H]

    def step(self, tok: torch.Tensor, pos: torch.Tensor, col: int, start: torch.Tensor, padded: bool) -> torch.Tensor:
        self.am = torch.cat([self.am, torch.ones(self.am.shape[0], 1, dtype=self.am.dtype)], dim=1)
        return self.forward(tok[:, None], pos[:, None])

    def keep_rows(self, idx: torch.Tensor) -> None:
        self.cache.keep_rows(idx)
        self.am = self.am.index_select(0, idx)
        if self._route is not None:
            self._route = self._route.index_select(0, idx)

    @property
    def can_absorb(self) -> bool:
        # plain layers only: a sliding-window layer keeps its own count of columns seen
        return all(type(layer) in (DynamicLayer, GrowingLayer) for layer in self.cache.layers)

    def absorb(self, other: _GenericBatch, col: int, need: int, max_rows: int) -> int:
        """Rows of ``other`` join (see ``fast``): both sides are left-padded with zeros
        (attention mask 0) to a common length, then concatenated."""
        P = other.am.shape[1]
        shift = max(0, P - col)

        def pad(t: torch.Tensor, n: int, dim: int) -> torch.Tensor:
            if not n:
                return t
            shape = list(t.shape)
            shape[dim] = n
            return torch.cat([t.new_zeros(shape), t], dim=dim)

        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            mine.keys = torch.cat([pad(mine.keys, shift, -2), pad(theirs.keys, col + shift - P, -2)])
            mine.values = torch.cat([pad(mine.values, shift, -2), pad(theirs.values, col + shift - P, -2)])
        self.am = torch.cat([pad(self.am, shift, 1), pad(other.am, col + shift - P, 1)])
        if self._route is not None and other._route is not None:
            self._route = torch.cat([self._route, other._route])
        return shift

    def trim(self, cols: int) -> int:
        if not self.can_absorb:  # a sliding-window layer counts its columns: leave them
            return 0
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[:, :, cols:], layer.values[:, :, cols:]
        self.am = self.am[:, cols:]
        return cols

    def routing(self) -> torch.Tensor | None:
        return self._route

    def row_kv(self, j: int, c0: int, c1: int) -> torch.Tensor:
        """Row ``j``'s keys and values at columns [c0, c1): [2 layers, Hkv, c1 - c0, D], a copy."""
        layers = self.cache.layers
        return torch.stack([x.keys[j, :, c0:c1] for x in layers] + [x.values[j, :, c0:c1] for x in layers])
