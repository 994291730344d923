"""The GPU check: assertions a CUDA machine must pass, one JSON object, exit 1 on any failure.

    python -m mixrl.lab.gpu.check                 # scripts/gpu_check.sh: cuda, every check
    python -m mixrl.lab.gpu.check --device cpu    # the CPU-runnable parts (tests run these)

Checks (each a row of ``checks`` with ``ok`` and its figures):

- ``trainer_step_<p>`` (p = fp32, bf16, fp16): one optimizer step of the trainer on the
  device against the same step in float64 on the CPU: relative error of the loss and of
  the gradient norm within the precision's bound (``TOLERANCE``), and the sign of every
  weight update agreeing on at least ``SIGN_AGREEMENT[p]`` of the entries;
- ``trainer_ranks`` / ``trainer_ray``: the embedded rank process and the Ray trainer actor
  hold parameters and AdamW state on the device (on CUDA: ``max_memory_allocated > 0``);
- ``vllm_reload`` (``gpu_check_vllm``): generate with fixed seeds, load perturbed weights,
  match a fresh engine built from the perturbed checkpoint, reload and get the baseline back;
- ``colocated`` (CUDA): ``mixrl train`` for 2 steps with an FP8 and a BF16 vLLM group and
  the trainer on one GPU, ``torch.cuda.mem_get_info`` before and after;
- ``probe_fp8``: ``mixrl probe`` of vLLM's FP8 profile against the built-in engine's emulated
  FP8 profile on the same prompts and seeds: how well emulation predicts real FP8 mismatch;
- ``train_resume``: ``mixrl train`` on the bundled demo with the trainer on the device
  (``trainer.num_gpus = 1`` on CUDA) and built-in CPU sampler groups, 2 steps with a
  checkpoint, then resumed from it to step 4; on CUDA the checkpoint holds the CUDA RNG state;
- ``fp8_gemm`` (``gpu_check_fp8``): tensor-core FP8 GEMMs against the built-in engine's
  emulation of them on the same sequences.

A check that cannot run on this machine (no GPU for a CUDA-only check, a package this
machine lacks) is listed in ``skipped`` with the reason; an exception is a failed check (its
message in ``error``), never a skipped one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mixrl.lab.gpu import Skip
from mixrl.records.run_dir import RunDir

# relative error bound of loss and gradient norm against float64, in units of roundoff u of
# the compute dtype: 8u for bf16 (u = 2^-8) and fp16 (2^-11); 64u for fp32 (2^-23), whose
# error is dominated by summation order over the batch (measured on CPU, load 9.9: fp32
# 5.4e-7, bf16 1.3e-3, fp16 2.0e-4)
TOLERANCE = {"fp32": 64 * 2.0**-23, "bf16": 8 * 2.0**-8, "fp16": 8 * 2.0**-11}
SIGN_AGREEMENT = {"fp32": 0.999, "bf16": 0.9, "fp16": 0.97}
CHECKS = ("trainer", "ranks", "train", "fp8_gemm", "ray", "reload", "colocated", "probe")
TRAIN_STEPS = 4  # the CUDA run's updates; it checkpoints at 2 and resumes from there to 4


def synthetic_batch(vocab: int, cand_kind: str, n: int, seed: int) -> tuple[list[Any], list[float]]:
    """``n`` trajectories of prompt / generated / tool / generated spans with sampler log-probs
    (and candidates of q for the loss kinds that need them); advantages ~ N(0, 1)."""
    from mixrl.records.trajectory import Trajectory

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        spans = [(3, 0), (int(torch.randint(3, 7, (1,), generator=g)), 1), (2, 0), (3, 1)]
        mask = [m for k, m in spans for _ in range(k)]
        tokens = torch.randint(0, vocab, (len(mask),), generator=g).tolist()
        lq = [(-0.1 - 3 * float(torch.rand(1, generator=g))) if m else 0.0 for m in mask]
        offs, ids, clq = [0], [], []
        for t, m in enumerate(mask):
            if not m or cand_kind == "none":
                continue
            cand = torch.randperm(vocab, generator=g)[:4].tolist()
            if tokens[t] not in cand:
                cand[0] = tokens[t]
            q = torch.log_softmax(torch.randn(4, generator=g, dtype=torch.float64), 0)
            q = q if cand_kind == "support" else q - 0.5
            ids, clq = ids + cand, clq + q.tolist()
            offs.append(len(ids))
            if cand_kind == "support":
                lq[t] = float(q[cand.index(tokens[t])])
        out.append(Trajectory(prompt_id=f"p{seed}-{i // 4}", sample_idx=i % 4, tokens=tokens, loss_mask=mask,
                              sampler_logprobs=lq, versions=[0 if m else -1 for m in mask],
                              groups=["check" if m else "" for m in mask], cand_kind=cand_kind,
                              cand_offsets=offs if cand_kind != "none" else [0], cand_ids=ids, cand_logprobs=clq,
                              reward=float(i % 2)))
    return out, torch.randn(n, generator=g).tolist()


def base_config(model: str, run_dir: Path, **sections: Any) -> Any:
    from mixrl.config import build_config

    tree: dict[str, Any] = {"model": {"path": model}, "optim": {"lr": 1e-3, "packing": False},
                            "observe": {"run_dir": str(run_dir), "progress": False, "tensorboard": False}}
    for k, v in sections.items():
        tree.setdefault(k, {}).update(v)
    return build_config(tree)


def _trainer(model: str, loss_cfg: Any, precision: str, device: str) -> Any:
    from mixrl.models.policy import load_policy
    from mixrl.train.trainer import Trainer

    torch.manual_seed(0)
    m, tok = load_policy(model, device=device, precision=precision)
    return Trainer(m, loss_cfg, lr=1e-3, precision=precision, device=device, seed=0, chunk_size=256,
                   pad_id=tok.pad_token_id if tok.pad_token_id is not None else 0)


def check_trainer_step(model: str, device: str, precision: str, run_dir: Path) -> dict[str, Any]:
    """One step on ``device`` in ``precision`` against the same step in float64 on the CPU."""
    from mixrl.config.presets import needs
    from mixrl.runtime.run import resolve_loss

    loss_cfg = resolve_loss(base_config(model, run_dir))[0]
    dev, ref = _trainer(model, loss_cfg, precision, device), _trainer(model, loss_cfg, "fp64", "cpu")
    w0 = {k: v.double() for k, v in ref.state_dict_for_samplers().items()}
    trajs, adv = synthetic_batch(int(ref.model.lm_head.weight.shape[0]), needs(loss_cfg).cand_kind, 8, seed=0)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    m_dev, m_ref = dev.step(trajs, adv), ref.step(trajs, adv)
    w_dev = {k: v.double() for k, v in dev.state_dict_for_samplers().items()}
    w_ref = {k: v.double() for k, v in ref.state_dict_for_samplers().items()}
    agree = total = 0
    for k, w in w0.items():
        d_ref, d_dev = w_ref[k] - w, w_dev[k] - w
        moved = d_ref.abs() > 0
        agree += int((torch.sign(d_dev[moved]) == torch.sign(d_ref[moved])).sum())
        total += int(moved.sum())
    rel = {k: abs(m_dev[k] - m_ref[k]) / max(abs(m_ref[k]), 1e-12) for k in ("loss", "optim/grad_norm")}
    out = {"loss_rel_err": rel["loss"], "grad_norm_rel_err": rel["optim/grad_norm"],
           "update_sign_agreement": agree / max(total, 1), "tolerance": TOLERANCE[precision],
           "param_devices": sorted({str(p.device) for p in dev.model.parameters()}),
           "max_memory_allocated": int(torch.cuda.max_memory_allocated()) if device.startswith("cuda") else 0}
    out["ok"] = (max(rel.values()) <= TOLERANCE[precision] and out["update_sign_agreement"] >= SIGN_AGREEMENT[precision]
                 and out["param_devices"] == [_device_name(device)]
                 and (out["max_memory_allocated"] > 0 or not device.startswith("cuda")))
    return out


def _device_name(device: str) -> str:
    return "cuda:0" if device == "cuda" else device


def _placed_ok(where: dict[str, Any], device: str) -> bool:
    kind = torch.device(device).type
    on = {torch.device(d).type for d in where["param_devices"] + where["optimizer_devices"]}
    return on == {kind} and bool(where["optimizer_devices"]) and (kind != "cuda" or where["max_memory_allocated"] > 0)


def require_packages(*modules: str) -> None:
    """Skip the check when this machine lacks one of ``modules``."""
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise Skip(f"{', '.join(missing)} not installed on this machine")


def _has_key(tree: Any, key: str) -> bool:
    if isinstance(tree, dict):
        return key in tree or any(_has_key(v, key) for v in tree.values())
    return isinstance(tree, (list, tuple)) and any(_has_key(v, key) for v in tree)


def check_train(model: str, device: str, run_dir: Path) -> dict[str, Any]:
    """``mixrl train`` with its trainer on ``device``: 2 steps with a checkpoint, then resumed to 4."""
    import subprocess

    cuda = device.startswith("cuda")
    d = run_dir / "train"
    sets = ["runtime.checkpoint_every=2", f"trainer.num_gpus={int(cuda)}", f"observe.run_dir={d}", "observe.progress=false",
            f"model.path={model}"]
    base = [sys.executable, "-m", "mixrl.commands.main", "train", "--no-eval", "--json", *[a for x in sets for a in ("--set", x)]]
    runs = [subprocess.run([*base, "--set", "runtime.steps=2"], capture_output=True, text=True, timeout=300)]
    runs.append(subprocess.run([*base, "--set", f"runtime.steps={TRAIN_STEPS}", "--resume", str(d)],
                               capture_output=True, text=True, timeout=300))
    rows = [json.loads(x) for x in RunDir(d).metrics.read_text().splitlines() if x.strip()] \
        if RunDir(d).metrics.exists() else []
    steps = [int(r["step"]) for r in rows]
    rng = [torch.load(f, weights_only=False, map_location="cpu") for f in sorted(d.glob("checkpoints/step_*/*.pt"))]
    out = {"returncodes": [r.returncode for r in runs], "steps": steps, "losses": [r.get("loss") for r in rows],
           "checkpoint_has_cuda_rng": any(_has_key(r, "cuda") for r in rng),
           "stderr_tail": [r.stderr[-1500:] for r in runs if r.returncode]}
    out["ok"] = (out["returncodes"] == [0, 0] and steps == list(range(1, TRAIN_STEPS + 1))
                 and all(isinstance(x, float) and x == x for x in out["losses"]) and out["checkpoint_has_cuda_rng"] == cuda)
    return out


def check_ranks(model: str, device: str, run_dir: Path) -> dict[str, Any]:
    """The embedded trainer process (one FSDP2 rank): parameters and AdamW state on the device."""
    import asyncio

    from mixrl.config.presets import needs
    from mixrl.runtime.ranks import LocalRanks
    from mixrl.runtime.run import resolve_loss

    gpus = 1 if device.startswith("cuda") else 0
    world = 2 if gpus and torch.cuda.device_count() >= 2 else 1  # FSDP2 over two GPUs where there are two
    cfg = base_config(model, run_dir / "ranks", trainer={"num_gpus": gpus, "world_size": world})
    loss_cfg = resolve_loss(cfg)[0]

    async def main() -> dict[str, Any]:
        ranks = await LocalRanks(cfg, model, loss_cfg).started()
        try:
            from transformers import AutoConfig

            vocab = int(AutoConfig.from_pretrained(str(_resolved(model))).vocab_size)
            m = await ranks.step(*synthetic_batch(vocab, needs(loss_cfg).cand_kind, 8, seed=1))
            return {"where": ranks.call("where"), "loss": m["loss"]}
        finally:
            await ranks.close()

    got = asyncio.run(main())
    return {"ok": all(_placed_ok(w, device) for w in got["where"]), **got}


def check_ray(model: str, device: str, run_dir: Path) -> dict[str, Any]:
    """The Ray trainer actor (``world_size = 1``): parameters and AdamW state on its device."""
    import asyncio

    require_packages("ray")
    from mixrl.config.presets import needs
    from mixrl.runtime.backends.ray_backend import RayBackend
    from mixrl.runtime.run import resolve_loss

    gpus = 1 if device.startswith("cuda") else 0
    cfg = base_config(model, run_dir / "ray", trainer={"num_gpus": gpus, "num_cpus": 1},
                      runtime={"backend": "ray"})
    loss_cfg = resolve_loss(cfg)[0]

    async def main() -> dict[str, Any]:
        backend = RayBackend(cfg, str(_resolved(model)), loss_cfg)
        await backend.start()
        try:
            trainer = await backend.make_trainer()
            from transformers import AutoConfig

            vocab = int(AutoConfig.from_pretrained(str(_resolved(model))).vocab_size)
            m = await trainer.step(*synthetic_batch(vocab, needs(loss_cfg).cand_kind, 8, seed=2))
            where = await trainer.actor.where.remote()
            await trainer.close()
            return {"where": where, "loss": m["loss"]}
        finally:
            await backend.shutdown()

    got = asyncio.run(main())
    return {"ok": _placed_ok(got["where"], device), **got}


def _resolved(model: str) -> Path:
    from mixrl.models.policy import resolve

    return resolve(model)


def run_checks(args: argparse.Namespace) -> dict[str, Any]:
    from mixrl.lab.gpu import vllm as v
    from mixrl.lab.gpu.fp8 import check_fp8_gemm

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    plan: dict[str, Callable[[], dict[str, Any]]] = {}
    if "trainer" in args.only:
        for p in args.precisions:
            plan[f"trainer_step_{p}"] = lambda p=p: check_trainer_step(args.model, args.device, p, out_dir)
    if "ranks" in args.only:
        plan["trainer_ranks"] = lambda: check_ranks(args.model, args.device, out_dir)
    if "train" in args.only:
        plan["train_resume"] = lambda: check_train(args.model, args.device, out_dir)
    if "fp8_gemm" in args.only:
        plan["fp8_gemm"] = lambda: check_fp8_gemm(args.model, args.device)
    if "ray" in args.only:
        plan["trainer_ray"] = lambda: check_ray(args.model, args.device, out_dir)
    if "reload" in args.only:
        plan["vllm_reload"] = lambda: (require_packages("vllm"), v.check_reload(args.model, args.device, out_dir))[1]
    if "colocated" in args.only:
        plan["colocated"] = lambda: (require_packages("vllm"), v.check_colocated(args.model, args.device, out_dir))[1]
    if "probe" in args.only:
        plan["probe_fp8"] = lambda: (require_packages("vllm"), v.check_probe(args.model, args.device, args.probe_prompts))[1]
    checks: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    for name, fn in plan.items():
        t0 = time.perf_counter()
        try:
            checks[name] = fn()
        except Skip as e:
            skipped[name] = str(e)
            continue
        except Exception as e:  # noqa: BLE001 - a failed check, reported with its cause
            checks[name] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                            "traceback": traceback.format_exc(limit=8)}
        checks[name]["seconds"] = round(time.perf_counter() - t0, 2)
        print(f"gpu_check: {name} {'ok' if checks[name]['ok'] else 'FAILED'}", file=sys.stderr)
    return {"device": args.device, "machine": machine(), "checks": checks, "skipped": skipped,
            "ok": bool(checks) and all(c["ok"] for c in checks.values())}


def machine() -> dict[str, Any]:
    import os

    info: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "cores": os.cpu_count(),
                            "load_avg_1m": round(os.getloadavg()[0], 2)}
    if torch.cuda.is_available():
        cap = torch.cuda.get_device_capability(0)
        info.update(gpu=torch.cuda.get_device_name(0), capability=f"{cap[0]}.{cap[1]}",
                    gpus=torch.cuda.device_count(),
                    memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1))
    return info


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mixrl.lab.gpu.check", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (the CPU-runnable parts)")
    p.add_argument("--model", default="bundled", help="HF model directory or 'bundled'")
    p.add_argument("--only", default=",".join(CHECKS), help=f"comma-separated subset of {','.join(CHECKS)}")
    p.add_argument("--precisions", default="fp32,bf16,fp16", help="trainer precisions to check")
    p.add_argument("--probe-prompts", type=int, default=64, help="prompts for the FP8 probe")
    p.add_argument("--out", default="gpu-check", help="directory for run directories and logs")
    a = p.parse_args(argv)
    a.only, a.precisions = set(a.only.split(",")), [x for x in a.precisions.split(",") if x]
    bad = (a.only - set(CHECKS)) or set(a.precisions) - set(TOLERANCE)
    if bad or a.device not in ("cuda", "cpu"):
        p.error(f"unknown: {sorted(bad) or a.device}")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.device == "cuda":
        from mixrl.runtime.gpu import cuda_problem

        problem = cuda_problem()
        if problem is not None:
            print(json.dumps({"device": "cuda", "ok": False, "error": problem}))
            return 1
    res = run_checks(args)
    print(json.dumps(res))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
