"""``train.batch.prepare`` builds exactly the records of a direct tensor reference
(boolean-mask indexing, per-record finiteness counted after the float32 cast)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from mixrl.train.batch import prepare
from tests.test_trainer import V, make_traj

torch.set_num_threads(1)


def reference(trajs, advantages, cand_kind):
    """The record fields by tensor ops on the whole trajectory, one record at a time."""
    out, nonfinite, names = [], 0, {}
    for tr, adv in zip(trajs, advantages, strict=True):
        mask = torch.tensor(tr.loss_mask, dtype=torch.bool)
        gen = mask.nonzero().squeeze(1)
        lq = torch.tensor(tr.sampler_logprobs, dtype=torch.float32)[gen]
        a = torch.as_tensor(adv, dtype=torch.float32)
        a = a.expand(gen.numel()).clone() if a.dim() == 0 else a
        clq = torch.tensor(tr.cand_logprobs, dtype=torch.float32) if cand_kind != "none" else torch.zeros(0)
        nonfinite += int((~torch.isfinite(lq)).sum()) + int((~torch.isfinite(clq)).sum())
        gid = torch.tensor([names.setdefault(tr.groups[t], len(names)) for t in gen.tolist()], dtype=torch.long)
        out.append({"tokens": torch.tensor(tr.tokens), "gen_pos": gen, "sampler_logprobs": lq, "advantages": a,
                    "versions": torch.tensor(tr.versions)[gen], "group_ids": gid, "cand_logprobs": clq})
    return out, nonfinite, list(names)


@pytest.mark.parametrize("kind", ["none", "support"])
@pytest.mark.parametrize("per_token", [False, True])
def test_prepare_matches_reference(kind: str, per_token: bool) -> None:
    g = torch.Generator().manual_seed(3)
    trajs = [make_traj(g, i, kind, group="ab"[i % 2]) for i in range(12)]
    # non-finite sampler values, and one that overflows float32 only after the cast
    gen0 = [t for t, m in enumerate(trajs[1].loss_mask) if m]
    trajs[1].sampler_logprobs[gen0[0]] = math.nan
    trajs[2].sampler_logprobs[[t for t, m in enumerate(trajs[2].loss_mask) if m][-1]] = -1e39
    trajs[3] = dataclasses.replace(trajs[3], versions=[v + 5 if v >= 0 else v for v in trajs[3].versions])
    adv = ([[0.1 * (i + j) for j in range(t.num_generated)] for i, t in enumerate(trajs)] if per_token
           else [0.25 * i - 1 for i in range(len(trajs))])
    records, stats = prepare(trajs, adv, vocab_size=V, cand_kind=kind)
    ref, nonfinite, names = reference(trajs, adv, kind)
    assert len(records) == len(ref) and stats.group_names == names
    assert stats.nonfinite_sampler == nonfinite == 2
    for r, e in zip(records, ref, strict=True):
        for f, want in e.items():
            got = getattr(r, f)
            assert got.dtype == want.dtype and torch.equal(got.nan_to_num(), want.nan_to_num()), f
            assert torch.equal(got.isnan(), want.isnan()), f


@pytest.mark.parametrize("kind", ["none", "support"])
@pytest.mark.parametrize("grid", [True, False])
def test_collate_matches_per_record_reference(kind: str, grid: bool) -> None:
    """Whole-batch index arithmetic in ``collate`` == concatenating each record's own slices."""
    from mixrl.train.batch import collate

    g = torch.Generator().manual_seed(4)
    trajs = [make_traj(g, i, kind) for i in range(9)]
    for i, t in enumerate(trajs):
        t.info["temperature"] = 0.5 + 0.1 * i
    records, _ = prepare(trajs, [0.1 * i for i in range(9)], vocab_size=V, cand_kind=kind)
    tb = collate(records[2:], pad_id=3, grid=grid)
    rs = records[2:]
    cat = torch.cat
    assert torch.equal(tb.targets, cat([r.tokens[r.gen_pos] for r in rs]))
    assert torch.equal(tb.pred_cols, cat([r.gen_pos - 1 for r in rs]))
    assert torch.equal(tb.seq_ids, cat([torch.full((len(r.gen_pos),), i) for i, r in enumerate(rs)]))
    assert torch.equal(tb.temperature, cat([torch.full((len(r.gen_pos),), r.temperature) for r in rs]))
    offs, k0 = [torch.zeros(1, dtype=torch.long)], 0
    for r in rs:
        offs.append(r.cand_offsets[1:] + k0)
        k0 += len(r.cand_ids)
    assert torch.equal(tb.cand_offsets, cat(offs)) and int(tb.cand_offsets[-1]) == len(tb.cand_ids)
    if grid:
        assert tb.input_ids.shape == (len(rs), max(len(r.tokens) for r in rs))
        for i, r in enumerate(rs):
            n = len(r.tokens)
            assert torch.equal(tb.input_ids[i, :n], r.tokens) and bool((tb.input_ids[i, n:] == 3).all())
            assert int(tb.attention_mask[i].sum()) == n
    else:
        assert tb.input_ids.shape == (len(rs), 0)
