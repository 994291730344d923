"""FSDP2 trainer ranks: 2 ranks give the parameters of 1 rank; shards halve the memory.

Two gloo ranks (spawned processes, ``runtime.ranks.LocalRanks``) and the
ordinary in-process trainer take the same 3 batches; afterwards every gathered
parameter agrees within 1e-5 while the update itself moved them much further.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from mixrl.config import RunConfig, build_config
from mixrl.records.trajectory import Trajectory

torch.set_num_threads(1)


def fsdp_cfg(policy: str, run_dir: Path, world: int, **trainer: Any) -> RunConfig:
    return build_config({
        "model": {"path": policy},
        "optim": {"lr": 1e-3, "packing": False},
        "trainer": {"world_size": world, **trainer},
        "observe": {"run_dir": str(run_dir), "progress": False, "tensorboard": False},
    })


def batch(vocab: int, kind: str, n: int, seed: int) -> tuple[list[Trajectory], list[float]]:
    """``n`` trajectories: prompt, generated span, tool span (mask 0), generated span; candidates of q."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        spans = [(int(torch.randint(2, 6, (1,), generator=g)), 0), (int(torch.randint(2, 7, (1,), generator=g)), 1),
                 (2, 0), (int(torch.randint(1, 5, (1,), generator=g)), 1)]
        mask = sum(([m] * k for k, m in spans), [])
        tokens = torch.randint(0, vocab, (len(mask),), generator=g).tolist()
        lq = [(-0.1 - 3 * float(torch.rand(1, generator=g))) if m else 0.0 for m in mask]
        offs, ids, clq = [0], [], []
        for t, m in enumerate(mask):
            if not m or kind == "none":
                continue
            cand = torch.randperm(vocab, generator=g)[:4].tolist()
            if tokens[t] not in cand:
                cand[0] = tokens[t]
            q = torch.log_softmax(torch.randn(4, generator=g, dtype=torch.float64), 0)
            q = q if kind == "support" else q - 0.5
            ids, clq = ids + cand, clq + q.tolist()
            offs.append(len(ids))
            if kind == "support":
                lq[t] = float(q[cand.index(tokens[t])])
        out.append(Trajectory(prompt_id=f"p{seed}-{i // 4}", sample_idx=i % 4, tokens=tokens, loss_mask=mask,
                              sampler_logprobs=lq, versions=[0 if m else -1 for m in mask],
                              groups=["fp32" if m else "" for m in mask], cand_kind=kind,
                              cand_offsets=offs if kind != "none" else [0], cand_ids=ids, cand_logprobs=clq,
                              reward=float(i % 2)))
    adv = torch.randn(n, generator=g).tolist()
    return out, adv


def run_both(policy: str, tmp: Path, steps: int = 3, n: int = 8, **trainer: Any) -> dict[str, Any]:
    """The same ``steps`` batches through 1 in-process rank and 2 FSDP2 ranks."""
    from mixrl.config.presets import needs
    from mixrl.runtime.ranks import LocalRanks
    from mixrl.runtime.run import resolve_loss
    from mixrl.runtime.trainer_state import build_trainer

    cfg1, cfg2 = fsdp_cfg(policy, tmp / "one", 1, **trainer), fsdp_cfg(policy, tmp / "two", 2, **trainer)
    loss_cfg = resolve_loss(cfg1)[0]
    single, _ = build_trainer(cfg1, policy, loss_cfg)
    start = single.state_dict_for_samplers()
    vocab = int(single.model.lm_head.weight.shape[0])
    kind = needs(loss_cfg).cand_kind

    async def main() -> dict[str, Any]:
        ranks = await LocalRanks(cfg2, policy, loss_cfg).started()
        try:
            m1, m2 = [], []
            for s in range(steps):
                trajs, adv = batch(vocab, kind, n, seed=s)
                m1.append(single.step(trajs, adv))
                m2.append(await ranks.step(trajs, adv))
            mem = ranks.call("memory_bytes")
            return {"w1": single.state_dict_for_samplers(), "w2": await ranks.weights(), "m1": m1, "m2": m2,
                    "mem2": mem, "state": await ranks.state(), "version": await ranks.version()}
        finally:
            await ranks.close()

    out = asyncio.run(main())
    out.update(start=start, single=single)
    return out


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def single_memory_bytes(trainer: Any) -> int:
    n = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    for st in trainer.optimizer.state.values():
        n += sum(v.numel() * v.element_size() for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return n


@pytest.fixture(scope="module")
def bundled(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The bundled policy when it is built; else its architecture and tokenizer, freshly initialised.

    (Pretraining it takes far longer than this test; the equivalence of 1 and 2
    ranks does not depend on what the weights learned.)
    """
    from transformers import AutoModelForCausalLM

    from mixrl.lab import pretrain
    from mixrl.models.policy import qwen3_config
    from mixrl.models.shipped import mixrl_home
    from mixrl.models.tokenizer import save_tokenizer

    recipe = pretrain.Recipe()
    built = mixrl_home() / f"policy-{recipe.digest()}"
    if (built / "recipe.json").exists():
        return str(built)
    path = tmp_path_factory.mktemp("bundled-arch")
    tok = save_tokenizer(path)
    torch.manual_seed(0)
    cfg = qwen3_config(len(tok), layers=recipe.layers, hidden=recipe.hidden, heads=recipe.heads,
                       kv_heads=recipe.kv_heads, intermediate=recipe.intermediate,
                       pad_id=tok.pad_token_id, eos_id=tok.eos_token_id)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return str(path)


def test_two_ranks_match_one_rank_after_three_steps(bundled: str, tmp_path: Path) -> None:
    r = run_both(bundled, tmp_path)
    moved = max_abs_diff(r["w1"], r["start"])
    diff = max_abs_diff(r["w1"], r["w2"])
    print(f"max |2 ranks - 1 rank| = {diff:.3g}; max |update| = {moved:.3g}")
    assert moved > 1e-3  # the three updates changed the weights far beyond the tolerance
    assert diff <= 1e-5
    for a, b in zip(r["m1"], r["m2"], strict=True):
        assert b["train/trajectories"] == a["train/trajectories"] and b["train/tokens"] == a["train/tokens"]
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
        assert b["optim/grad_norm"] == pytest.approx(a["optim/grad_norm"], rel=1e-4)
    assert r["version"] == 3
    ratio = max(r["mem2"]) / single_memory_bytes(r["single"])
    print(f"per-rank parameter + AdamW bytes, 2 ranks / 1 rank = {ratio:.3f}")
    assert ratio <= 0.6
    shards = sorted(p.name for p in Path(r["state"]["dcp"]).iterdir() if p.suffix == ".distcp")
    assert len(shards) == 2  # one shard file per rank (torch.distributed.checkpoint)


def test_a_killed_rank_raises_rank_failure_not_a_hang(tmp_path: Path) -> None:
    import time

    from transformers import AutoModelForCausalLM

    from mixrl.config.presets import needs
    from mixrl.models.policy import tiny_config
    from mixrl.models.tokenizer import save_tokenizer
    from mixrl.runtime.ranks import LocalRanks, RankFailure
    from mixrl.runtime.run import resolve_loss

    path = tmp_path / "tiny"
    tok = save_tokenizer(path)
    AutoModelForCausalLM.from_config(tiny_config(len(tok), pad_id=tok.pad_token_id)).save_pretrained(path)
    cfg = fsdp_cfg(str(path), tmp_path / "run", 2)
    loss_cfg = resolve_loss(cfg)[0]
    trajs, adv = batch(len(tok), needs(loss_cfg).cand_kind, 8, seed=0)

    async def main() -> tuple[float, list[Any]]:
        ranks = await LocalRanks(cfg, str(path), loss_cfg).started()
        try:
            await ranks.step(trajs, adv)
            ranks.procs[1].kill()  # a rank process dies between two updates
            t0 = time.perf_counter()
            with pytest.raises(RankFailure, match="rank 1"):
                await ranks.step(trajs, adv)  # rank 0 would block in its first collective forever
            return time.perf_counter() - t0, ranks.procs
        finally:
            await ranks.close()

    took, procs = asyncio.run(main())
    print(f"RankFailure {took:.1f} s after the kill")
    assert took < 30 and not any(p.is_alive() for p in procs)  # the survivor is stopped too
