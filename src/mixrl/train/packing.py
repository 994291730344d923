"""Token-budget micro-batches and sequence packing for the trainer.

    plan = micro_batches(records, budget, packed=True)   # [MicroBatch], each within budget
    tb   = collate_micro(mb, pad_id)                     # TrainBatch, packed or padded
    kw   = model_inputs(tb, attn_impl)                   # model.model(**kw)

**Budget.** What goes through the model is one ``[R, C]`` tensor per micro-batch
(R rows of C tokens, padding included); micro-batches are cut so that
``R * C <= budget``, so the trainer's activation memory is set by configuration,
not by how many trajectories an update holds. A trajectory is never split (its
tokens attend to each other): one longer than the budget is a micro-batch alone.
Gradients of the micro-batches add up to the batch gradient because the loss
takes its denominator from the caller (``Trainer.denominator``, computed once
over the whole minibatch; STYLE.md item 3).

**Trim.** Token ``t`` is predicted by the hidden state at ``t - 1``, so only
``tokens[:last]`` of a trajectory enter, ``last`` its last generated position:
later tokens (the final generated one, tool output after it) influence no
prediction that is trained (causal attention).

**Packing.** Trajectories are placed by best-fit decreasing into rows of ``C``
tokens, each with its own position ids (0, 1, ... from its start) and an
attention mask that is causal *within* a trajectory and blocks attention across
trajectories::

    row 0: a a a a a b b b . .     position_ids 0 1 2 3 4 0 1 2 0 1
    row 1: c c c c d d d d d .     position_ids 0 1 2 3 0 1 2 3 4 0

The padding at a row's end is a sequence of its own (it attends to itself):
a query with every key masked gives NaN in SDPA, and NaN times a zero attention
weight is still NaN, so it would leak into real tokens of the next layer.

- CPU / SDPA / eager: ``C`` is chosen per batch to minimise modelled compute,
  padding against attention (``R * C^2`` with a dense mask; :func:`pack_rows`),
  and the block-diagonal mask is passed as a 4D ``[R, 1, C, C]`` tensor (bool for
  SDPA, additive for eager), which transformers uses as given.
- flash attention (``config._attn_implementation`` names a flash kernel): one row
  per micro-batch, ``C`` = the budget, and no mask: transformers reads the
  sequence boundaries off ``position_ids`` (a position that does not continue the
  previous one starts a sequence) and calls the varlen kernel with ``cu_seqlens``,
  so no compute at all is spent across sequences or on padding. The same
  ``position_ids``-only form also works for SDPA (transformers then builds the
  block-diagonal mask itself); ``mode="position_ids"`` selects it.

Log-probs stay aligned per token: positions are flattened in record order (the
order of ``MicroBatch.records``), then position order, exactly as ``collate``
does, so candidates (``cand_offsets``), support replay and ``Trainer._store``
see the same layout packed or not; only the hidden state a position reads
(``rows``, ``pred_cols``) moves.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from mixrl.train import prefix
from mixrl.train.batch import Record, TrainBatch, collate

MASK_MODES = ("auto", "4d", "position_ids")


@dataclass
class MicroBatch:
    records: list[Record]  # in the order of the flat per-position tensors
    rows: list[int] | None  # packed: trajectories per row, in order; None: one per row, right-padded
    row_len: int  # C: tokens per row (the longest trimmed trajectory when padded)
    # packed with shared prefixes (mixrl.train.prefix): per record, the leading tokens it reads
    # from its unit's lead (the latest record before it with 0); None: nothing shared
    shared: list[int] | None = None

    @property
    def tokens(self) -> int:
        """Size of the model input ``R * C``, padding included (what the budget bounds)."""
        n_rows = len(self.records) if self.rows is None else len(self.rows)
        return n_rows * self.row_len

    @property
    def real_tokens(self) -> int:
        """Tokens laid out in the input (a shared prefix once); ``tokens`` minus the padding."""
        return sum(used_len(r) for r in self.records) - sum(self.shared or ())


def used_len(r: Record) -> int:
    """Tokens of ``r`` the forward needs: up to (excluding) its last generated position."""
    return int(r.gen_pos.max())


def is_flash(attn_impl: str | None) -> bool:
    return attn_impl is not None and "flash" in attn_impl


def micro_batches(records: list[Record], budget: int | None, *, packed: bool, one_row: bool = False,
                  max_seqs: int | None = None, attn_cost: float | None = None,
                  share_prefix: bool = False) -> list[MicroBatch]:
    """Cut ``records`` into micro-batches of at most ``budget`` model-input tokens.

    ``budget=None``: one micro-batch (cut only by ``max_seqs`` trajectories when padded).
    ``packed``: rows of the cheapest length by :func:`plan_cost` (see :func:`pack_rows`);
    ``one_row``: each micro-batch is one packed row of ``budget`` tokens (flash-attention
    varlen). Padded: records keep their order and each micro-batch is padded to its
    longest trajectory. ``attn_cost``: :func:`attn_pair_cost` of the model (default
    ``ATTN_COST``, the bundled policy's). ``share_prefix`` (packed, not ``one_row``):
    samples of one prompt share its tokens in a row (:mod:`mixrl.train.prefix`).
    """
    if budget is not None and budget < 1:
        raise ValueError(f"micro-batch token budget must be >= 1, got {budget}")
    if not records:
        return []
    if not packed:
        return _padded(records, budget, max_seqs)
    lens = [used_len(r) for r in records]
    if one_row:  # flash varlen: cost is per sequence, so a row can be as long as the budget
        cap = sum(lens) if budget is None else budget
        out = [MicroBatch([r], [1], n) for r, n in zip(records, lens, strict=True) if n > cap]
        fit = [i for i, n in enumerate(lens) if n <= cap]
        rows = [[fit[j] for j in row] for row in _best_fit([lens[i] for i in fit], cap)]
        return out + [MicroBatch([records[i] for i in row], [len(row)], sum(lens[i] for i in row))
                      for row in rows]  # no padding
    cost = ATTN_COST if attn_cost is None else attn_cost
    grouped = prefix.groups(records, lens) if share_prefix else None
    best: list[MicroBatch] = []
    best_cost, best_cap = float("inf"), 0
    for cap in row_caps(lens, budget):
        if best and cap > 2 * best_cap:
            # rows twice the best length already let any two of its rows share one; longer
            # rows can remove only that plan's (small) padding while attention keeps growing
            break
        plan = pack_rows(records, lens, cap, budget, share=grouped)
        c = plan_cost(plan, cost)
        if c < best_cost:  # ties: the shorter cap (tried first)
            best, best_cost, best_cap = plan, c, cap
    return best


# Relative cost of one (query, key) pair of a dense-mask attention against one token's
# pass through the rest of a layer (forward and backward alike). FLOPs give 4*H*hd per
# pair (QK^T and PV over all C^2 pairs: a dense mask skips none) against
# 2*(d*(2*H + 2*K)*hd + 3*d*ff) per token: 1/768 for the bundled policy. Measured on this
# project's 2-core CPU (SDPA, bool mask, fwd+bwd of the bundled policy, 3,072 tokens in rows
# of 48..768, variants interleaved, one thread, twice) the time per token grows as
# 1 + C/665 .. 1 + C/730: the FLOP ratio times ~1.1 (mask and softmax traffic).
CPU_MASK_FACTOR = 1.1
ATTN_COST = CPU_MASK_FACTOR / 768  # the bundled policy's; attn_pair_cost(config) for others


def attn_pair_cost(config: Any) -> float:
    """``attn_cost`` of a transformers config (falls back to ``ATTN_COST`` when a size is missing)."""
    d = getattr(config, "hidden_size", None)
    heads = getattr(config, "num_attention_heads", None)
    if not d or not heads:
        return ATTN_COST
    hd = getattr(config, "head_dim", None) or d // heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    ff = getattr(config, "moe_intermediate_size", None) or getattr(config, "intermediate_size", None) or 4 * d
    ff *= getattr(config, "num_experts_per_tok", None) or 1  # MoE: the experts a token runs through
    return CPU_MASK_FACTOR * 4 * heads * hd / (2 * (d * (2 * heads + 2 * kv) * hd + 3 * d * ff))


def row_caps(lens: list[int], budget: int | None) -> list[int]:
    """Row lengths worth trying: the longest trajectory, then up to the budget by ~1.1x steps."""
    hi = sum(lens) if budget is None else min(budget, sum(lens))
    cap = min(max(lens), hi)
    caps = [cap]
    while cap < hi:
        cap = min(hi, max(cap + 1, int(cap * 1.1)))
        caps.append(cap)
    return caps


def plan_cost(plan: list[MicroBatch], attn_cost: float) -> float:
    """Modelled compute of a plan: ``R * C`` tokens, each ``1 + attn_cost * C`` (dense mask)."""
    return sum(mb.tokens * (1 + attn_cost * mb.row_len) for mb in plan)


def pack_rows(records: list[Record], lens: list[int], cap: int, budget: int | None,
              share: bool | list[tuple[list[int], int]] | None = False) -> list[MicroBatch]:
    """Rows of at most ``cap`` tokens by best-fit decreasing, grouped into micro-batches.

    Why the row length is a choice: padding falls as rows get longer (more ways to fill
    them; short alike episodes that do not pair at the longest length do at twice it), but
    with a dense block-diagonal mask every row pays attention over all ``C^2`` pairs,
    masked ones included, so a longer row costs more per token. ``micro_batches`` builds
    one plan per cap of :func:`row_caps` and keeps the cheapest by :func:`plan_cost`.

    Rows are sorted by how full they are and cut into micro-batches of ``budget // C``
    rows, each micro-batch as long as its fullest row (``C``), so rows that best-fit left
    short (the tail of the packing) share a short micro-batch instead of being padded to
    the cap. The order of micro-batches does not matter: gradients add up.

    ``share``: the items placed are units of samples sharing a prompt
    (:func:`mixrl.train.prefix.units`) instead of single trajectories; a list is
    :func:`mixrl.train.prefix.groups` of ``records`` already computed.
    """
    if share is True:
        share = prefix.groups(records, lens)
    us = prefix.units(share, lens, cap) if share else [([i], 0) for i in range(len(records))]
    ulen = [prefix.unit_len(m, s, lens) for m, s in us]
    out = [MicroBatch([records[i] for i in m], [len(m)], n, [0] * len(m) if share else None)
           for (m, _), n in zip(us, ulen, strict=True) if n > cap]  # a lone trajectory, never split
    fit = [k for k, n in enumerate(ulen) if n <= cap]
    rows = [[fit[j] for j in row] for row in _best_fit([ulen[k] for k in fit], cap)]
    fill = [sum(ulen[k] for k in row) for row in rows]
    order = sorted(range(len(rows)), key=lambda k: -fill[k])  # stable
    i = 0
    while i < len(order):
        width = fill[order[i]]
        per = len(order) if budget is None else max(1, budget // width)
        group = [rows[k] for k in order[i:i + per]]
        members = [[(j, 0 if n == 0 else us[k][1]) for k in row for n, j in enumerate(us[k][0])] for row in group]
        out.append(MicroBatch([records[j] for row in members for j, _ in row], [len(row) for row in members],
                              width, [s for row in members for _, s in row] if share else None))
        i += per
    return out


def _padded(records: list[Record], budget: int | None, max_seqs: int | None) -> list[MicroBatch]:
    out: list[MicroBatch] = []
    cur: list[Record] = []
    width = 0
    for r in records:
        w = max(width, used_len(r))
        full = max_seqs is not None and len(cur) >= max_seqs
        if cur and (full or (budget is not None and (len(cur) + 1) * w > budget)):
            out.append(MicroBatch(cur, None, width))
            cur, w = [], used_len(r)
        cur.append(r)
        width = w
    out.append(MicroBatch(cur, None, width))
    return out


def _best_fit(lens: list[int], cap: int) -> list[list[int]]:
    """Best-fit decreasing bin packing of ``lens`` (all <= cap): each goes to the fullest row it fits in.

    Rows are lists of indices into ``lens``."""
    order = sorted(range(len(lens)), key=lambda i: -lens[i])  # stable: ties keep input order
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free tokens, row index), ascending
    for i in order:
        k = bisect.bisect_left(free, (lens[i], -1))
        if k == len(free):
            rows.append([i])
            bisect.insort(free, (cap - lens[i], len(rows) - 1))
            continue
        space, row = free.pop(k)
        rows[row].append(i)
        bisect.insort(free, (space - lens[i], row))
    return rows


def pack(mb: MicroBatch, pad_id: int = 0) -> TrainBatch:
    """The packed ``TrainBatch`` of ``mb`` (``mb.rows`` trajectories per row)."""
    assert mb.rows is not None and sum(mb.rows) == len(mb.records)
    R, C = len(mb.rows), mb.row_len
    shared = mb.shared if mb.shared is not None and any(mb.shared) else None
    # plain lists, one tensor per field at the end: a row holds tens of trajectories
    ids: list[int] = []
    pos: list[int] = []
    real: list[int] = []  # 1 on real tokens
    seg: list[int] = []  # shared prefixes: each column's sequence and unit, and
    unit: list[int] = []  # whether it is its unit's shared prefix
    pre: list[bool] = []
    rows: list[int] = []  # [N] row and column of the hidden state predicting each y_t
    cols: list[int] = []
    i = n_seg = 0
    for row, n in enumerate(mb.rows):
        base = row * C
        lead = lead_seg = 0  # the unit's lead: its first column (flat) and its sequence id
        for k in range(i, i + n):
            r = mb.records[k]
            m, s = used_len(r), (0 if shared is None else shared[k])
            tok = r.tokens[:m].tolist()
            col = len(ids) - base
            if s == 0:
                lead, lead_seg = len(ids), n_seg
            elif ids[lead:lead + s] != tok[:s]:
                raise ValueError(f"packed row {row}: record {r.index} does not share its unit's {s} tokens")
            else:
                pre[lead:lead + s] = [True] * s
            ids += tok[s:]
            pos += range(s, m)
            real += [1] * (m - s)
            seg += [n_seg] * (m - s)
            unit += [lead_seg] * (m - s)
            pre += [False] * (m - s)
            n_seg += 1
            lead_col = lead - base
            # y_t is predicted at t - 1: in the unit's shared part, else in the record's own columns
            cols += [lead_col + p if p < s else col + p - s for p in (r.gen_pos - 1).tolist()]
            rows += [row] * int(r.gen_pos.numel())
        used = len(ids) - base
        if used > C:
            raise ValueError(f"packed row {row} holds {used} tokens, more than its length {C}")
        ids += [pad_id] * (C - used)
        pos += range(C - used)  # padding: a sequence of its own
        real += [0] * (C - used)
        seg += [n_seg] * (C - used)
        unit += [n_seg] * (C - used)
        pre += [False] * (C - used)
        n_seg += 1
        i += n
    tb = collate(mb.records, pad_id, grid=False)  # flat per-position tensors, in record order
    def grid(vals: list[int]) -> Tensor:
        return torch.tensor(vals, dtype=torch.long).view(R, C)

    mask = None
    if shared is not None:
        mask = prefix.allowed(grid(seg), grid(unit), torch.tensor(pre, dtype=torch.bool).view(R, C))
    return replace(tb, input_ids=grid(ids), attention_mask=grid(real), position_ids=grid(pos),
                   rows=torch.tensor(rows, dtype=torch.long), pred_cols=torch.tensor(cols, dtype=torch.long),
                   num_trajectories=len(mb.records), shared_mask=mask)


def collate_micro(mb: MicroBatch, pad_id: int = 0) -> TrainBatch:
    return collate(mb.records, pad_id) if mb.rows is None else pack(mb, pad_id)


def block_mask(position_ids: Tensor) -> Tensor:
    """``[R, 1, C, C]`` bool: query q may attend to key k (same sequence, k <= q)."""
    seg = (position_ids == 0).cumsum(1)  # [R, C] a sequence starts where its position is 0
    C = position_ids.shape[1]
    causal = torch.ones(C, C, dtype=torch.bool, device=position_ids.device).tril()
    return ((seg[:, :, None] == seg[:, None, :]) & causal)[:, None]


def model_inputs(tb: TrainBatch, attn_impl: str | None, mode: str = "auto",
                 dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Keyword arguments of ``model.model(...)`` for a padded or packed batch."""
    if mode not in MASK_MODES:
        raise ValueError(f"mask mode {mode!r} is not one of {MASK_MODES}")
    cut = int(tb.pred_cols.max()) + 1  # later columns cannot influence earlier predictions
    # no KV cache: transformers reads packed sequences off position_ids only without one
    if tb.position_ids is None:
        return {"input_ids": tb.input_ids[:, :cut], "attention_mask": tb.attention_mask[:, :cut],
                "use_cache": False}
    kw: dict[str, Any] = {"input_ids": tb.input_ids[:, :cut], "position_ids": tb.position_ids[:, :cut], "use_cache": False}
    ids_only = mode == "position_ids" or (mode == "auto" and (is_flash(attn_impl) or attn_impl == "flex_attention"))
    if ids_only and tb.shared_mask is not None:
        raise ValueError(f"rows with shared prefixes need a 4D attention mask; mode {mode!r} with "
                         f"attention {attn_impl!r} passes position_ids only")
    if ids_only:
        return kw
    allowed = block_mask(kw["position_ids"]) if tb.shared_mask is None else tb.shared_mask[:, :, :cut, :cut]
    if attn_impl == "sdpa":
        return {**kw, "attention_mask": allowed}
    # eager and other kernels that add the mask to the scores
    add = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return {**kw, "attention_mask": add.masked_fill_(~allowed, torch.finfo(dtype).min)}
