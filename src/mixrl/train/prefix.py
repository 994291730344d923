"""Shared prompt prefixes in packed rows: a group's prompt goes through the model once.

GRPO-style batches hold G samples of every prompt. Packed as separate
sequences, each sample carries its own copy of the prompt, so most of the
model input is the same prompt tokens G times over (8 samples of a 16-token
prompt with ~7 generated tokens: 70% of the tokens). Under causal attention
the hidden state at position ``p`` depends only on ``tokens[:p + 1]``, so
samples that agree on their first ``S`` tokens have the same hidden states
there. A *unit* therefore lays out its lead sample whole and every other
member only from token ``S`` on::

    row: P P P P a a | b b b | c c . .      (P: the shared S = 4 tokens)
    pos: 0 1 2 3 4 5 | 4 5 6 | 4 5 0 1      (each member keeps its own positions)

and a member's tokens attend to the lead's first ``S`` tokens plus their own
(causal), never to another member's suffix. A target ``y_t`` of a member is
read from the hidden state at ``t - 1``: in the shared part when ``t - 1 < S``,
else in the member's own columns. The log-probs are those of separate rows (same
positions, same visible keys; only the summation order of the attention's
softmax may differ in the last bits), and the shared hidden states receive the
sum of every member's gradient, which is the gradient of the separate copies.

Members are grouped by their prompt (tokens before the first generated one);
``S`` is the longest prefix the whole group shares (at least the prompt). A
group longer than a row is cut into several units, each with its own copy of
the prefix. Only for 4D-mask attention (SDPA, eager): a varlen kernel reads
sequence boundaries off ``position_ids`` and cannot express a shared prefix.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mixrl.train.batch import Record


def common_prefix(tokens: list[Tensor]) -> int:
    """Length of the longest prefix every sequence of ``tokens`` starts with."""
    m = min(int(t.numel()) for t in tokens)
    stack = torch.stack([t[:m] for t in tokens])  # [k, m]
    diff = (stack != stack[:1]).any(0).nonzero()
    return int(diff[0, 0]) if diff.numel() else m


def groups(records: list[Record], lens: list[int]) -> list[tuple[list[int], int]]:
    """``(member indices, S)`` per prompt, longest member first; ``S`` = 0 for a lone sample.

    ``lens[i]``: tokens of record ``i`` the forward needs (``packing.used_len``); ``S`` is
    the longest prefix of those tokens the whole group shares."""
    by_prompt: dict[bytes, list[int]] = {}
    for i, r in enumerate(records):
        by_prompt.setdefault(r.tokens[: int(r.gen_pos[0])].numpy().tobytes(), []).append(i)
    out = []
    for members in by_prompt.values():
        s = common_prefix([records[i].tokens[: lens[i]] for i in members]) if len(members) > 1 else 0
        out.append((sorted(members, key=lambda i: -lens[i]), s))  # stable; the longest leads
    return out


def units(grouped: list[tuple[list[int], int]], lens: list[int], cap: int) -> list[tuple[list[int], int]]:
    """``(member indices, S)`` per unit, lead first: each of :func:`groups` cut into pieces of at
    most ``cap`` tokens (a unit takes ``lens[lead] + Σ (lens[j] − S)`` over its other members)."""
    out: list[tuple[list[int], int]] = []
    for members, s in grouped:
        cur, fill = [members[0]], lens[members[0]]
        for j in members[1:]:
            if fill + lens[j] - s > cap:
                out.append((cur, s if len(cur) > 1 else 0))
                cur, fill = [j], lens[j]
            else:
                cur.append(j)
                fill += lens[j] - s
        out.append((cur, s if len(cur) > 1 else 0))
    return out


def unit_len(members: list[int], s: int, lens: list[int]) -> int:
    return lens[members[0]] + sum(lens[j] - s for j in members[1:])


def allowed(seg: Tensor, unit: Tensor, pre: Tensor) -> Tensor:
    """``[R, 1, C, C]`` bool: query q may see key k (k <= q, and the same sequence or its unit's prefix).

    ``seg``/``unit``: ``[R, C]`` ids of each column's sequence and unit; ``pre``: the
    column is in its unit's shared prefix. Padding is a sequence and a unit of its own."""
    C = seg.shape[1]
    causal = torch.ones(C, C, dtype=torch.bool, device=seg.device).tril()
    same = (seg[:, :, None] == seg[:, None, :]) | ((unit[:, :, None] == unit[:, None, :]) & pre[:, None, :])
    return (same & causal)[:, None]
