"""GPU code paths, checked on a CPU machine.

Collectives: ``tests.fake_device`` gives a process group whose only backend is
registered for a non-CPU device type (as an NCCL-only group on CUDA), so any
CPU tensor in a collective fails here exactly as it would under NCCL.
"""

from __future__ import annotations

import multiprocessing as mp
import traceback
from typing import Any

import pytest
import torch

from tests import fake_device


def _spawn(target: Any, world: int, *args: Any) -> list[Any]:
    """Run ``target(rank, world, port, *args)`` in ``world`` spawned processes; their results."""
    from mixrl.train.distributed import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_guarded, args=(target, r, world, port, q, *args)) for r in range(world)]
    for p in procs:
        p.start()
    out = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    errors = [v for v in out.values() if isinstance(v, str)]
    assert not errors, errors[0]
    return [out[r] for r in range(world)]


def _guarded(target: Any, rank: int, world: int, port: int, q: Any, *args: Any) -> None:
    try:
        q.put((rank, target(rank, world, port, *args)))
    except BaseException:
        q.put((rank, traceback.format_exc()))


def _scalar_collectives(rank: int, world: int, port: int) -> dict[str, Any]:
    import torch.distributed as dist

    from mixrl.train.parallel import Ranks
    from mixrl.train.trainer import Trainer

    dev = fake_device.init_group(rank, world, port)
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        dist.all_reduce(torch.zeros(1))  # the harness: a CPU tensor cannot take part
    p = Ranks(root=None, device=dev)  # only the collective plumbing: no model on this device
    tr = object.__new__(Trainer)  # the trainer's denominator over the seam, with no records on this rank
    tr.parallel, tr.gen_budget = p, None
    p.pad(0)  # every rank ran as many passes as the busiest: nothing to pad (an all-reduce of the count)
    out = {"sum": p.all_sum(rank + 1.5), "max": p.all_max(rank + 1.5),
           "shard": p.shard(list(range(5))),
           "D": tr.denominator([], "seq_mean_token_sum_norm", None, None),
           "metrics": p.reduce({"loss": 1.0 + rank, "optim/grad_norm": 2.0 * rank})}
    dist.destroy_process_group()
    return out


def test_rank_collectives_run_on_the_ranks_device_not_cpu() -> None:
    """Loss denominator, micro-batch lockstep, all-reduce and metrics under a group with no CPU backend."""
    got = _spawn(_scalar_collectives, 2)
    assert [r["shard"] for r in got] == [[0, 1], [2, 3, 4]]
    for r in got:
        assert {k: r[k] for k in ("sum", "max", "D")} == {"sum": 1.5 + 2.5, "max": 2.5, "D": 0.0}
        assert r["metrics"] == {"loss": 3.0, "optim/grad_norm": 1.0, "train/world_size": 2.0}


def _tiny_policy(path: Any) -> str:
    from transformers import AutoModelForCausalLM

    from mixrl.models.policy import tiny_config
    from mixrl.models.tokenizer import save_tokenizer

    tok = save_tokenizer(path)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config(len(tok), pad_id=tok.pad_token_id)).save_pretrained(path)
    return str(path)


def _cpu_rank_on_gpu_host(rank: int, world: int, port: int, cfg: dict[str, Any], policy: str, loss_cfg: Any,
                          batch: Any) -> dict[str, Any]:
    from mixrl.runtime.ranks import RankWorker

    fake_device.install()  # this host now has an accelerator torch reports as available
    assert torch._C._get_accelerator().type == fake_device.NAME
    w = RankWorker(rank, world, "127.0.0.1", port, cfg, policy, loss_cfg)
    metrics = w.step(*batch)
    params = list(w.trainer.model.parameters())
    out = {"devices": sorted({str(p.device) for p in params}),
           "meshes": sorted({p.device_mesh.device_type for p in params}),
           "opt_devices": sorted({str(v.device) for st in w.trainer.optimizer.state.values()
                                  for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0}),
           "loss": metrics["loss"], "version": w.version(),
           "attn": w.trainer.model.config._attn_implementation}
    w.close()
    return out


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_cpu_ranks_stay_on_cpu_on_a_host_with_an_accelerator(tmp_path: Any, precision: str) -> None:
    """``trainer.num_gpus = 0`` pins the ranks to the CPU (FSDP2's default mesh would take the
    accelerator); ``optim.precision = "fp16"`` trains under ranks."""
    import math

    from mixrl.config import build_config
    from mixrl.config.presets import needs
    from mixrl.runtime.run import resolve_loss
    from tests.test_fsdp import batch

    policy = _tiny_policy(tmp_path / "tiny")
    cfg = build_config({"model": {"path": policy}, "optim": {"lr": 1e-3, "packing": False, "precision": precision},
                        "trainer": {"world_size": 2, "num_gpus": 0},
                        "observe": {"run_dir": str(tmp_path / "run"), "progress": False, "tensorboard": False}})
    loss_cfg = resolve_loss(cfg)[0]
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(policy))
    b = batch(vocab, needs(loss_cfg).cand_kind, 4, seed=0)
    got = _spawn(_cpu_rank_on_gpu_host, 2, cfg.model_dump(mode="json"), policy, loss_cfg, b)
    for r in got:
        assert r["devices"] == ["cpu"] and r["meshes"] == ["cpu"] and r["opt_devices"] == ["cpu"]
        assert math.isfinite(r["loss"]) and r["version"] == 1
        assert r["attn"] == "sdpa"


@pytest.mark.gpu
def test_a_gpu_torch_cannot_use_is_named_in_one_line(tmp_path: Any) -> None:
    from mixrl.config import ConfigError
    from mixrl.runtime.gpu import cuda_problem, require_cuda
    from mixrl.runtime.ranks import rank_device

    if torch.cuda.is_available():
        pytest.skip("torch can use this machine's GPU")
    (tmp_path / "nvidia0").touch()  # a device node, as the driver creates it
    msg = cuda_problem(str(tmp_path / "nvidia[0-9]*"))
    assert msg is not None and "\n" not in msg
    assert msg.startswith(f"a GPU is present ({tmp_path / 'nvidia0'}) but torch cannot use it: torch ")
    assert "README" in msg
    with pytest.raises(ConfigError, match=r"^trainer.num_gpus > 0: a GPU is present"):
        require_cuda("trainer.num_gpus > 0", str(tmp_path / "nvidia[0-9]*"))
    # a GPU rank never falls back to the CPU silently
    with pytest.raises(ConfigError, match="trainer.num_gpus > 0"):
        rank_device(0, True)
    assert rank_device(3, False) == "cpu"


def test_attention_kernel_is_chosen_per_device(tmp_path: Any) -> None:
    """Read back from the loaded model's config; flash on CUDA selects one packed row per micro-batch."""
    from mixrl.models.policy import attn_implementation_for, load_policy
    from mixrl.train.packing import is_flash

    policy = _tiny_policy(tmp_path / "tiny")
    model, _ = load_policy(policy, device="cpu", precision="fp32")
    assert model.config._attn_implementation == "sdpa"
    assert attn_implementation_for("cuda:0", "bf16", flash_available=True) == "flash_attention_2"
    assert attn_implementation_for("cuda:0", "fp16", flash_available=True) == "flash_attention_2"
    assert attn_implementation_for("cuda:0", "bf16", flash_available=False) == "sdpa"
    assert attn_implementation_for("cuda:0", "fp32", flash_available=True) == "sdpa"  # flash takes 16-bit only
    assert attn_implementation_for("cpu", "bf16", flash_available=True) == "sdpa"
    assert is_flash(attn_implementation_for("cuda", "bf16", flash_available=True))


@pytest.mark.gpu
def test_trainer_state_carries_every_rng_of_its_process() -> None:
    """CPU, python, numpy, and every CUDA device's state where CUDA is available (the rank's device)."""
    import random

    import numpy as np

    from mixrl.train.surface import load_trainer_state, trainer_state

    class Bare:  # the trainer's own state is beside the point here
        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            pass

    state = trainer_state(Bare())
    want = {"torch", "python", "numpy"} | ({"cuda"} if torch.cuda.is_available() else set())
    assert set(state["rng"]) == want
    draws = (torch.rand(3), random.random(), np.random.rand(3))
    load_trainer_state(Bare(), state)
    again = (torch.rand(3), random.random(), np.random.rand(3))
    assert torch.equal(draws[0], again[0]) and draws[1] == again[1] and np.array_equal(draws[2], again[2])


@pytest.mark.skipif(__import__("importlib").util.find_spec("vllm") is None, reason="vllm is not installed")
def test_probe_closes_every_engine_it_builds(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A vLLM engine keeps its device memory until closed: the probe closes each one,
    also when the profile fails."""
    import argparse

    from transformers import Qwen3Config, Qwen3ForCausalLM

    from mixrl.rollout import probe
    from mixrl.sampling import factory

    cfg = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=128,
                      tie_word_embeddings=True, eos_token_id=1)
    Qwen3ForCausalLM(cfg).save_pretrained(tmp_path / "m")
    built: list[Any] = []
    real = factory.make_engine

    def recording(*a: Any, **kw: Any) -> Any:
        built.append(real(*a, **kw))
        return built[-1]

    monkeypatch.setattr(factory, "make_engine", recording)
    parser = argparse.ArgumentParser()
    probe.configure(parser)
    args = parser.parse_args(["--model", str(tmp_path / "m"), "--profiles", "cpu-vllm-fp32,cpu-vllm-bf16",
                              "--prompts", "random", "--num-prompts", "2", "--max-new-tokens", "3"])
    rows = probe.probe(args)
    assert set(rows) == {"cpu-vllm-fp32", "cpu-vllm-bf16"} and len(built) == 2
    assert all(e.llm is None for e in built)  # closed

    def boom(*a: Any) -> Any:
        raise RuntimeError("scoring failed")

    monkeypatch.setattr(probe, "score_support", boom)  # a profile that fails after its engine started
    built.clear()
    with pytest.raises(RuntimeError, match="scoring failed"):
        probe.probe(args)
    assert len(built) == 1 and built[0].llm is None


def test_flash_attention_selects_one_packed_row_per_micro_batch() -> None:
    """The kernel a CUDA bf16 trainer gets with flash_attn installed makes the trainer plan
    one packed row per micro-batch (sequences cut by position ids, no mask); SDPA does not."""
    from mixrl.config import build_config
    from mixrl.config.presets import needs
    from mixrl.models.policy import attn_implementation_for, load_policy
    from mixrl.runtime.run import resolve_loss
    from mixrl.train.trainer import Trainer
    from tests.test_fsdp import batch

    loss_cfg = resolve_loss(build_config({"model": {"path": "bundled"}}))[0]
    rows = {}
    for impl in (attn_implementation_for("cuda", "bf16", flash_available=True), "sdpa"):
        model, _ = load_policy("bundled", device="cpu")
        model.config._attn_implementation = impl  # what from_pretrained sets on that device
        tr = Trainer(model, loss_cfg, lr=1e-3, packing=True, micro_batch_tokens=64)
        trajs, adv = batch(int(model.lm_head.weight.shape[0]), needs(loss_cfg).cand_kind, 12, seed=3)
        records, _ = tr._prepare(trajs, adv, True)
        rows[impl] = [len(mb.rows) for mb in tr._micro(records)]
    assert set(rows["flash_attention_2"]) == {1}  # one row each
    assert max(rows["sdpa"]) > 1  # several rows (block-diagonal masks) under the same budget
