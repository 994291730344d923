"""Trajectories -> padded token tensors + the flat per-position tensors of ``LossInputs``.

Two stages, so that a batch can be cut into mini- and micro-batches without
converting again: :func:`prepare` turns every usable :class:`Trajectory` into a
:class:`Record` of tensors; :func:`collate` pads any subset of records. Whether a
trajectory is usable is its own verdict (:meth:`Trajectory.screen`, computed once
where it was completed, else here); ``prepare`` only reads it.

Positions: token ``t`` is predicted by the hidden state at ``t - 1``; the N
generated positions of a batch are flattened in trajectory order, then
position order (the order of ``cand_offsets`` in each record).

What is dropped and what is masked (counted either way, never a crash):

- a malformed trajectory (lengths disagree, token or candidate id outside the
  vocabulary, a generated token at position 0, ragged candidates that do not
  add up, duplicate candidates at a position, missing candidates the loss
  needs, sampling the loss cannot score) is dropped whole: nothing in it can be
  aligned safely. The reason, naming the field, is kept in ``stats.errors``;
  ``strict=True`` raises it.
- an ``infra_failed`` episode is dropped (docs/corrections.md §8: not reward 0).
- a non-finite sampler log-prob (or candidate log-prob, or advantage) is kept
  as is: ``compute_loss`` masks that position and counts it
  (``corr/nonfinite_tokens``); here it is only counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from torch import Tensor

from mixrl.records.trajectory import UNREWARDED, Trajectory


@dataclass
class Record:
    """One validated trajectory as tensors (n = its generated tokens, K its candidates)."""

    index: int  # position in the list given to prepare()
    tokens: Tensor  # [L] long
    gen_pos: Tensor  # [n] long, positions t with loss_mask 1 (t >= 1)
    sampler_logprobs: Tensor  # [n] float32, log q(y_t); may be non-finite (masked later)
    advantages: Tensor  # [n] float32
    versions: Tensor  # [n] long
    group_ids: Tensor  # [n] long into BatchStats.group_names
    temperature: float
    cand_offsets: Tensor  # [n + 1] long (all zeros when the loss needs no candidates)
    cand_ids: Tensor  # [K] long
    cand_logprobs: Tensor  # [K] float32, log q(v)
    # filled by the trainer (detached): p_old, and p_θ / entropy of the latest pass for metrics
    old_logprobs: Tensor | None = None  # [n] log p_old(y_t)
    cand_old_logprobs: Tensor | None = None  # [K]
    trainer_logprobs: Tensor | None = None  # [n]
    cand_trainer_logprobs: Tensor | None = None  # [K]
    entropy: Tensor | None = None  # [n]


@dataclass
class BatchStats:
    group_names: list[str] = field(default_factory=list)
    dropped_malformed: int = 0
    dropped_infra: int = 0
    dropped_empty: int = 0  # no generated token: nothing to learn from
    nonfinite_sampler: int = 0  # sampler / candidate log-probs that are NaN or ±inf
    errors: list[str] = field(default_factory=list)  # one line per dropped malformed record


@dataclass
class TrainBatch:
    input_ids: Tensor  # [B, L] long, right-padded
    attention_mask: Tensor  # [B, L] long
    pred_cols: Tensor  # [N] column of the hidden state that predicts it (t - 1)
    targets: Tensor  # [N] generated token ids y_t
    seq_ids: Tensor  # [N] long, 0..B-1: the batch row of each generated position
    sampler_logprobs: Tensor  # [N]
    advantages: Tensor  # [N]
    versions: Tensor  # [N]
    group_ids: Tensor  # [N]
    temperature: Tensor  # [N]
    cand_offsets: Tensor  # [N + 1]
    cand_ids: Tensor  # [K]
    cand_logprobs: Tensor  # [K]
    # detached trainer values, present when every record carries them (see Record)
    old_logprobs: Tensor | None  # [N]
    cand_old_logprobs: Tensor | None  # [K]
    trainer_logprobs: Tensor | None  # [N]
    cand_trainer_logprobs: Tensor | None  # [K]
    entropy: Tensor | None  # [N]
    # packed batches (mixrl.train.packing): several trajectories per row
    position_ids: Tensor | None = None  # [B, L] long, restarting at 0 for each trajectory
    rows: Tensor | None = None  # [N] row of the hidden state of each position; None = seq_ids
    num_trajectories: int | None = None  # None: one trajectory per row
    shared_mask: Tensor | None = None  # [B, 1, L, L] bool, rows with shared prefixes (train.prefix)

    @property
    def num_seqs(self) -> int:
        """Trajectories in the batch (``seq_ids`` run over 0..num_seqs-1)."""
        return int(self.input_ids.shape[0]) if self.num_trajectories is None else self.num_trajectories

    @property
    def hidden_rows(self) -> Tensor:
        """[N] batch row whose hidden state at ``pred_cols`` predicts each position."""
        return self.seq_ids if self.rows is None else self.rows

    def to(self, device: torch.device | str) -> TrainBatch:
        """The same batch with every tensor on ``device``."""
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return replace(self, **{k: v.to(device) for k, v in moved.items() if isinstance(v, Tensor)})


def _advantages(adv: float | Sequence[float] | Tensor, n: int) -> Tensor:
    if isinstance(adv, (int, float)):  # the usual case: one advantage per trajectory
        return torch.full((n,), float(adv), dtype=torch.float32)
    a = torch.as_tensor(adv, dtype=torch.float32)
    if a.dim() == 0:
        return a.expand(n).clone()
    if a.shape != (n,):
        raise ValueError(f"advantages has {a.numel()} values; expected 1 or num_generated={n}")
    return a


def prepare(
    trajectories: Sequence[Trajectory],
    advantages: Sequence[float | Sequence[float]] | Tensor,  # [S] per trajectory, or per token
    *,
    vocab_size: int,
    cand_kind: str = "none",  # what the loss needs: "support" | "head" | "none"
    temperature: float = 1.0,  # default; a trajectory's info["temperature"] overrides it
    strict: bool = False,
) -> tuple[list[Record], BatchStats]:
    """Convert; malformed records (their ``screen`` verdict) are dropped and counted (raised if ``strict``)."""
    if len(advantages) != len(trajectories):
        raise ValueError(f"advantages has {len(advantages)} entries for {len(trajectories)} trajectories")
    stats = BatchStats()
    records: list[Record] = []
    names: dict[str, int] = {}  # sampler group -> id, in order of appearance
    flat: dict[str, list[list[Any]]] = {k: [] for k in ("tokens", "gen_pos", "sampler_logprobs", "versions", "group_ids")}
    # shared by the records of a loss without candidates: tensors here are never written in place
    empty_ids, empty_lq = torch.zeros(0, dtype=torch.long), torch.zeros(0)
    for i, (tr, adv) in enumerate(zip(trajectories, advantages, strict=True)):
        if tr.status in UNREWARDED:  # no reward (infra, reward function or agent failure): not trained
            stats.dropped_infra += 1
            continue
        try:
            error = tr.screen(vocab_size, cand_kind)
            if error is not None:
                raise ValueError(error)
            n = tr.num_generated
            a = _advantages(adv, n)
        except ValueError as e:
            if strict:
                raise ValueError(f"trajectory {i} (prompt {tr.prompt_id!r}): {e}") from e
            stats.dropped_malformed += 1
            stats.errors.append(f"trajectory {i} (prompt {tr.prompt_id!r}): {e}")
            continue
        if n == 0:
            stats.dropped_empty += 1
            continue
        # plain lists first: one tensor per field for the whole batch, split into per-record views
        gen_l = [t for t, m in enumerate(tr.loss_mask) if m]  # [n]
        flat["tokens"].append(tr.tokens)
        flat["gen_pos"].append(gen_l)
        flat["sampler_logprobs"].append([tr.sampler_logprobs[t] for t in gen_l])
        flat["versions"].append([tr.versions[t] for t in gen_l])
        flat["group_ids"].append([names.setdefault(tr.groups[t], len(names)) for t in gen_l])
        if cand_kind == "none":
            offs, ids, clq = torch.zeros(n + 1, dtype=torch.long), empty_ids, empty_lq
        else:
            offs = torch.tensor(tr.cand_offsets, dtype=torch.long)
            ids = torch.tensor(tr.cand_ids, dtype=torch.long)
            clq = torch.tensor(tr.cand_logprobs, dtype=torch.float32)
        records.append(Record(
            index=i, tokens=empty_ids, gen_pos=empty_ids, sampler_logprobs=empty_lq, advantages=a,
            versions=empty_ids, group_ids=empty_ids, temperature=float(tr.info.get("temperature", temperature)),
            cand_offsets=offs, cand_ids=ids, cand_logprobs=clq))
    for name, dtype in (("tokens", torch.long), ("gen_pos", torch.long), ("sampler_logprobs", torch.float32),
                        ("versions", torch.long), ("group_ids", torch.long)):
        sizes = [len(x) for x in flat[name]]
        parts = torch.tensor([v for x in flat[name] for v in x], dtype=dtype).split(sizes)
        for r, part in zip(records, parts, strict=True):
            setattr(r, name, part)
    stats.group_names = list(names)
    if records:  # NaN and ±inf after the cast to float32, over the whole batch at once
        lq_all = torch.cat([x for r in records for x in (r.sampler_logprobs, r.cand_logprobs)])
        stats.nonfinite_sampler = int((~torch.isfinite(lq_all)).sum())
    return records, stats


def collate(records: Sequence[Record], pad_id: int = 0, *, grid: bool = True) -> TrainBatch:
    """Right-pad a non-empty subset of records into one batch.

    ``grid=False``: the ``[B, L]`` token and mask tensors are left empty (``[B, 0]``), for a
    caller that lays the tokens out itself (``mixrl.train.packing.pack``)."""
    if not records:
        raise ValueError("collate needs at least one record")
    b = len(records)
    n_each = torch.tensor([int(r.gen_pos.numel()) for r in records])
    k_each = [int(r.cand_ids.numel()) for r in records]
    if grid:
        lmax = max(int(r.tokens.numel()) for r in records)
        input_ids = torch.full((b, lmax), pad_id, dtype=torch.long)
        attn = torch.zeros(b, lmax, dtype=torch.long)
        for i, r in enumerate(records):
            input_ids[i, : r.tokens.numel()] = r.tokens
            attn[i, : r.tokens.numel()] = 1
    else:
        input_ids, attn = torch.zeros(b, 0, dtype=torch.long), torch.zeros(b, 0, dtype=torch.long)
    cat = torch.cat
    # whole-batch ops instead of one per record: positions of each record shifted by where its
    # tokens start in the concatenation, candidate offsets by where its candidates start
    starts = torch.tensor([0] + [int(r.tokens.numel()) for r in records[:-1]]).cumsum(0)
    gen = cat([r.gen_pos for r in records])
    tokens = cat([r.tokens for r in records])
    k0 = torch.tensor([0] + k_each[:-1]).cumsum(0)
    offs = cat([torch.zeros(1, dtype=torch.long)] + [r.cand_offsets[1:] for r in records])
    offs[1:] += torch.repeat_interleave(k0, n_each)

    def opt(name: str) -> Tensor | None:
        parts = [getattr(r, name) for r in records]
        return None if any(p is None for p in parts) else cat(parts)

    return TrainBatch(
        input_ids=input_ids, attention_mask=attn,
        pred_cols=gen - 1,
        targets=tokens[gen + torch.repeat_interleave(starts, n_each)],
        seq_ids=torch.repeat_interleave(torch.arange(b), n_each),
        sampler_logprobs=cat([r.sampler_logprobs for r in records]),
        advantages=cat([r.advantages for r in records]),
        versions=cat([r.versions for r in records]),
        group_ids=cat([r.group_ids for r in records]),
        temperature=torch.repeat_interleave(torch.tensor([float(r.temperature) for r in records]), n_each),
        cand_offsets=offs, cand_ids=cat([r.cand_ids for r in records]),
        cand_logprobs=cat([r.cand_logprobs for r in records]),
        old_logprobs=opt("old_logprobs"), cand_old_logprobs=opt("cand_old_logprobs"),
        trainer_logprobs=opt("trainer_logprobs"), cand_trainer_logprobs=opt("cand_trainer_logprobs"),
        entropy=opt("entropy"),
    )
