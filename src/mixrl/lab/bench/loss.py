"""``mixrl bench loss``: the log-prob path and the loss step, chunked vs full logits.

What is measured (forward + backward, gradients wrt the hidden states ``h [T, d]``
and the LM-head weight ``W [V, d]``, all on the same inputs in one process):

- ``naive``: full ``[T, V]`` logits, ``log_softmax``, gather, entropy (no grad);
- ``chunked``: :func:`mixrl.models.chunked.chunked_logprobs` (log-probs + entropy);
- ``grpo_loss``: chunked log-probs + ``compute_loss`` of preset ``grpo``;
- ``sc_mis_topp_loss``: chunked log-probs with the replayed top-p support +
  ``compute_loss`` of preset ``sc+mis+top-p`` (exact score centering over MIS weights).

Times are medians of ``--repeats`` rounds after one warm-up round; the variants
are interleaved within each round so that load from other processes on a shared
machine hits them alike. Wall seconds (``*_s``) and this process's CPU seconds
(``*_cpu_s``) are both reported, with the load average.

Peak memory: ``tracemalloc`` does not see torch's allocations, so each variant
runs in a fresh subprocess with glibc's mmap threshold fixed at 128 KiB
(``MALLOC_MMAP_THRESHOLD_``): every large tensor is then its own mapping and is
returned to the kernel when freed, so the resident set follows the live tensors.
The subprocess runs one warm-up step, resets the kernel's resident high-water
mark (``/proc/self/clear_refs`` = 5), runs one step and reports ``VmHWM`` minus
the resident size before the step: the extra memory of one step, gradients
included, inputs excluded.

Inputs: ``W ~ N(0, 1/d)``, ``h`` Gaussian with a log-normal scale per position,
globally calibrated so the sampler's p = 0.9 nucleus holds ``--support`` tokens
on average (low-entropy and high-entropy positions mixed, as in LM outputs).
The sampler's logits are the trainer's plus N(0, 0.05²) noise (mixed-precision
mismatch); GRPO tokens are drawn from the full sampler distribution, top-p
tokens from its nucleus. Trajectories of 256 tokens, groups of 8, 0/1 rewards.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from mixrl.system.jsonout import json_text

SEQ_LEN, GROUP, NOISE = 256, 8, 0.05


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--T", type=int, default=4096, help="generated positions in the batch")
    parser.add_argument("--V", type=int, default=32768, help="vocabulary size")
    parser.add_argument("--d", type=int, default=512, help="hidden size")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (median reported)")
    parser.add_argument("--chunk-size", type=int, default=1024, help="positions per chunk")
    parser.add_argument("--top-p", type=float, default=0.9, help="sampler nucleus mass")
    parser.add_argument("--support", type=float, default=32.0, help="target mean nucleus size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--memory-child", choices=["naive", "chunked"], help=argparse.SUPPRESS)


def nucleus(z, top_p: float, cap: int):
    """Top-p sets of logits rows ``z [C, V]``: (ids [C, cap], sizes [C]); sizes capped at ``cap``."""
    import torch

    top, idx = torch.topk(z, min(cap, z.shape[1]), dim=1)  # [C, cap] descending
    p = (top - torch.logsumexp(z, 1, keepdim=True)).exp()  # [C, cap]
    sizes = ((p.cumsum(1) - p) < top_p).sum(1)  # tokens whose preceding mass is < top_p
    return idx, sizes.clamp(1, idx.shape[1])


def make_inputs(T: int, V: int, d: int, seed: int, top_p: float, support: float, chunk: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, d, generator=g) / d**0.5  # [V, d]
    h0 = torch.randn(T, d, generator=g) * torch.exp(0.5 * torch.randn(T, 1, generator=g))  # [T, d]
    probe = h0[: min(T, 128)] @ w.T
    lo, hi = 0.05, 50.0  # bisection on the global logit scale: mean nucleus size ≈ support
    for _ in range(30):
        mid = (lo * hi) ** 0.5
        lo, hi = (lo, mid) if nucleus(probe * mid, top_p, 1024)[1].float().mean() < support else (mid, hi)
    h = h0 * (lo * hi) ** 0.5
    y_full, lq_full, y_top = torch.empty(T, dtype=torch.long), torch.empty(T), torch.empty(T, dtype=torch.long)
    offsets, ids, lq_cand = [0], [], []
    with torch.no_grad():
        for s0 in range(0, T, chunk):
            zq = h[s0:s0 + chunk] @ w.T + NOISE * torch.randn(min(chunk, T - s0), V, generator=g)
            logq = torch.log_softmax(zq, 1)  # [C, V]
            y = torch.multinomial(logq.exp(), 1, generator=g).squeeze(1)
            y_full[s0:s0 + chunk], lq_full[s0:s0 + chunk] = y, logq.gather(1, y[:, None]).squeeze(1)
            idx, sizes = nucleus(zq, top_p, 1024)
            for r in range(idx.shape[0]):
                sup = idx[r, : int(sizes[r])]
                lq = torch.log_softmax(zq[r, sup], 0)  # q renormalised on its nucleus
                y_top[s0 + r] = sup[torch.multinomial(lq.exp(), 1, generator=g)]
                ids.append(sup)
                lq_cand.append(lq)
                offsets.append(offsets[-1] + sup.numel())
    seq_ids = torch.arange(T) * max(1, T // SEQ_LEN) // T  # [T] trajectory of each position
    n_seq = int(seq_ids.max()) + 1
    rewards = torch.randint(0, 2, (n_seq,), generator=g).double()
    from mixrl.corrections import grpo_advantages

    adv = grpo_advantages(rewards, torch.arange(n_seq) // GROUP, ["ok"] * n_seq).advantages
    return dict(h=h, w=w, y_full=y_full, lq_full=lq_full, y_top=y_top, seq_ids=seq_ids,
                n_seq=n_seq, adv=adv.float()[seq_ids], offsets=torch.tensor(offsets),
                ids=torch.cat(ids), lq_cand=torch.cat(lq_cand))


def make_variants(x: dict, chunk: int) -> dict[str, Any]:
    import torch

    from mixrl.config.presets import get_preset
    from mixrl.corrections import LossInputs, compute_loss
    from mixrl.models.chunked import chunked_logprobs, naive_logprobs

    h = x["h"].clone().requires_grad_(True)
    w = x["w"].clone().requires_grad_(True)
    mask = torch.ones(h.shape[0], dtype=torch.bool)
    grpo, sc = get_preset("grpo").loss, get_preset("sc+mis+top-p").loss

    def naive() -> None:
        naive_logprobs(h, w, x["y_full"]).logprobs.mean().backward()

    def chunked() -> None:
        chunked_logprobs(h, w, x["y_full"], chunk_size=chunk).logprobs.mean().backward()

    def grpo_loss() -> None:
        out = chunked_logprobs(h, w, x["y_full"], chunk_size=chunk)
        inp = LossInputs(out.logprobs, out.logprobs.detach(), x["lq_full"], x["adv"], mask,
                         x["seq_ids"], x["n_seq"], entropy=out.entropy)
        compute_loss(inp, grpo, float(mask.sum()))[0].backward()

    def sc_mis_topp_loss() -> None:
        out = chunked_logprobs(h, w, x["y_top"], chunk_size=chunk, cand_kind="support",
                               cand_offsets=x["offsets"], cand_ids=x["ids"], replay=True)
        inp = LossInputs(out.logprobs, out.logprobs.detach(), _lq_top(x), x["adv"], mask,
                         x["seq_ids"], x["n_seq"], cand_kind="support", cand_offsets=x["offsets"],
                         cand_trainer_logprobs=out.cand_logprobs,
                         cand_old_logprobs=out.cand_logprobs.detach(),
                         cand_sampler_logprobs=x["lq_cand"], entropy=out.entropy)
        compute_loss(inp, sc, float(mask.sum()))[0].backward()

    def wrap(f):
        def step() -> None:
            h.grad = w.grad = None
            f()
        return step

    return {f.__name__: wrap(f) for f in (naive, chunked, grpo_loss, sc_mis_topp_loss)}


def _lq_top(x: dict):
    """log q(y_t) of the top-p tokens, read off the recorded support."""
    import torch

    rows = torch.repeat_interleave(torch.arange(x["h"].shape[0]), x["offsets"].diff())
    hit = x["ids"] == x["y_top"][rows]
    return torch.zeros(x["h"].shape[0]).index_add_(0, rows[hit], x["lq_cand"][hit])


def _status_kb() -> dict[str, int]:
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) for k, v in (ln.split(":", 1) for ln in f) if k in ("VmRSS", "VmHWM")}


def _memory_child(args: argparse.Namespace) -> dict[str, float]:
    import gc

    x = make_inputs(args.T, args.V, args.d, args.seed, args.top_p, args.support, args.chunk_size)
    step = make_variants(x, args.chunk_size)[args.memory_child]
    step()  # warm-up: thread pools, kernels' scratch buffers
    step()
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident size
    base = _status_kb()["VmRSS"]
    step()
    return {"peak_mb": (_status_kb()["VmHWM"] - base) / 1024}


def measure_peak(args: argparse.Namespace, variant: str) -> float:
    cmd = [sys.executable, "-m", "mixrl.lab.bench.loss", "--memory-child", variant]
    for flag in ("T", "V", "d", "seed", "top_p", "support", "chunk_size"):
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"memory subprocess for {variant} failed:\n{out.stderr[-2000:]}")
    return float(json.loads(out.stdout.strip().splitlines()[-1])["peak_mb"])


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    for name in ("T", "V", "d", "repeats", "chunk_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    load0 = os.getloadavg()[0]
    x = make_inputs(args.T, args.V, args.d, args.seed, args.top_p, args.support, args.chunk_size)
    variants = make_variants(x, args.chunk_size)
    wall: dict[str, list[float]] = {k: [] for k in variants}
    cpu: dict[str, list[float]] = {k: [] for k in variants}
    for rnd in range(args.repeats + 1):
        for name, step in variants.items():
            t0, c0 = time.perf_counter(), time.process_time()
            step()
            if rnd:  # round 0 is the warm-up
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
    sizes = x["offsets"].diff().float()
    res: dict[str, Any] = {"T": args.T, "V": args.V, "d": args.d, "chunk_size": args.chunk_size,
                           "repeats": args.repeats, "threads": torch.get_num_threads()}
    if not args.no_memory:
        res["naive_peak_mb"] = measure_peak(args, "naive")
        res["chunked_peak_mb"] = measure_peak(args, "chunked")
        res["peak_ratio"] = res["chunked_peak_mb"] / max(res["naive_peak_mb"], 1e-9)
        res["memory_method"] = "fresh subprocess, MALLOC_MMAP_THRESHOLD_=131072, VmHWM - VmRSS"
    for name in variants:
        res[f"{name}_s"] = statistics.median(wall[name])
        res[f"{name}_cpu_s"] = statistics.median(cpu[name])
    res["time_ratio"] = res["chunked_s"] / res["naive_s"]
    res["loss_ratio"] = res["sc_mis_topp_loss_s"] / res["grpo_loss_s"]
    res["support_mean"], res["support_max"] = float(sizes.mean()), int(sizes.max())
    res["loadavg_1m"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
    return res


def main(args: argparse.Namespace) -> int:
    import torch

    torch.manual_seed(args.seed)
    if args.memory_child:
        print(json.dumps(_memory_child(args)))
        return 0
    res = run(args)
    if args.json:
        print(json_text(res))
        return 0
    for k, v in res.items():
        print(f"{k:22s} {v:.4g}" if isinstance(v, float) else f"{k:22s} {v}")
    return 0


if __name__ == "__main__":
    _p = argparse.ArgumentParser(prog="mixrl bench loss")
    configure(_p)
    raise SystemExit(main(_p.parse_args()))
