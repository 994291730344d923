"""``mixrl compare``: the seed's study, on your fleet, as ordinary runs.

Runs each correction arm on each fleet with each seed: the mixed fleet (the
config's groups), the homogeneous fleet (the ``b200-bf16`` profile, same total
replicas) and the stress fleet (``STRESS_PROFILES``: W4A4 / W8A8 samplers, FP4
or static-scale FP8 KV caches, quantized ``lm_head``; docs/study.md has its
measured mismatch). The reference arms (``on-policy``, ``fp16``) fix their own
numerics, so they run once per seed under the fleet name ``reference``.
Every run is a normal run directory ``OUT/<fleet>/<arm>/seed<s>`` written by
``mixrl train`` with ``runtime.seed = base seed + s``; the held-out evaluation
(same tasks and sampling seeds for every run) is identical across runs, and the
starting policy is evaluated once, in the first run. The comparison is
resumable: finished runs (``summary.json`` of an uninterrupted run) are skipped,
interrupted ones resume from their last checkpoint. Runs go as separate
processes, ``--jobs`` at a time, each with ``cores // jobs`` torch threads,
seed 0 of every cell first. At the end the report (``mixrl report OUT``) is written.

    mixrl compare                       # the default study (docs/study.md: ~60 min on 2 cores)
    mixrl compare --budget full         # every arm x 3 fleets x 3 seeds, 100 updates each
    mixrl compare --arms grpo,on-policy --fleets stress --seeds 2 --steps 4   # a smoke test
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ARMS = ("grpo", "grpo+mis", "sc", "grpo+top-p", "sc+mis", "sc+mis+top-p", "on-policy", "fp16")
FLEETS = ("mixed", "homogeneous", "stress")
REFERENCE_FLEET = "reference"  # where the arms with their own numerics run
HOMOGENEOUS_PROFILE = "b200-bf16"
STRESS_PROFILES = ("stress-b200-nvfp4", "stress-b300-mxfp4", "stress-h100-fp8")

# What each budget runs. "default" is sized to fit 60 minutes on 2 quiet cores (21 runs; the
# measured wall time is in docs/study.md); "full" is the whole study (~4-7 h projected).
# --arms/--fleets/--seeds/--steps/--eval-* override a budget.
BUDGETS: dict[str, dict[str, object]] = {
    "default": {"arms": ("grpo", "sc+mis+top-p", "on-policy"), "fleets": FLEETS,
                "seeds": 3, "steps": 24, "eval_tasks": 48, "eval_n": 16},
    "full": {"arms": ARMS, "fleets": FLEETS, "seeds": 3, "steps": 100, "eval_tasks": 128,
             "eval_n": 16},
}


def default_config_path() -> Path:
    return Path(__file__).resolve().parent.parent / "configs" / "compare.toml"


def configure(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("config", nargs="?", type=Path, default=None,
      help="base run config (default: the bundled compare.toml)")
    a("--budget", choices=tuple(BUDGETS), default="default",
      help="what to run: default (fits ~60 min on 2 cores) or full (docs/study.md)")
    a("--arms", default=None, help=f"comma-separated presets (budget's; all: {','.join(ARMS)})")
    a("--fleets", default=None, help=f"comma-separated fleets among {','.join(FLEETS)}")
    a("--seeds", type=int, default=None, help="seeds per arm and fleet (default 3)")
    a("--steps", type=int, default=None, help="trainer updates per run (budget's)")
    a("--eval-tasks", type=int, default=None, help="held-out tasks evaluated (budget's)")
    a("--eval-n", type=int, default=None, help="samples per held-out task, n > k (budget's: 16)")
    a("--out", type=Path, default=Path("runs/compare"), help="compare directory")
    a("--jobs", type=int, default=max(1, (os.cpu_count() or 2)),
      help="runs in parallel (default: one per core)")
    a("--set", dest="overrides", action="append", default=[],
      metavar="KEY=VALUE", help="override applied to every run")
    a("--dry-run", action="store_true", help="write the run configs, run nothing")
    a("--no-report", action="store_true", help="skip the report at the end")


def settings(args: argparse.Namespace) -> dict[str, object]:
    """The budget with the command line's overrides; bad values raise ConfigError."""
    from mixrl.config.run import ConfigError

    b = dict(BUDGETS[getattr(args, "budget", None) or "default"])
    for key in ("arms", "fleets"):
        if getattr(args, key, None):
            b[key] = tuple(x for x in str(getattr(args, key)).split(",") if x)
    for key in ("seeds", "steps", "eval_tasks", "eval_n"):
        if getattr(args, key, None) is not None:
            b[key] = int(getattr(args, key))
    for key in ("seeds", "steps", "eval_tasks", "eval_n"):
        if int(b[key]) < 1:  # type: ignore[call-overload]
            raise ConfigError(f"--{key.replace('_', '-')} must be >= 1, got {b[key]}")
    return b


def _arm_config(base, arm: str, fleet: str, seed: int, run_dir: Path, b: dict, first: bool):  # type: ignore[no-untyped-def]
    from mixrl.config import run as runcfg
    from mixrl.config.presets import PRESETS

    preset = PRESETS[arm]
    cfg = base.model_copy(deep=True)
    cfg.loss = runcfg.LossSection(preset=arm, overrides=dict(base.loss.overrides))
    cfg.observe.run_dir = str(run_dir)
    cfg.observe.progress = False
    cfg.runtime.seed = base.runtime.seed + seed
    cfg.runtime.steps = int(b["steps"])
    cfg.runtime.checkpoint_every = min(cfg.runtime.checkpoint_every or cfg.runtime.steps,
                                       cfg.runtime.steps)
    # n > k, same tasks and sampling seeds for every run; the base policy is evaluated once
    cfg.runtime.eval.n_tasks, cfg.runtime.eval.n = int(b["eval_tasks"]), int(b["eval_n"])
    cfg.runtime.eval.k = min(cfg.runtime.eval.k, cfg.runtime.eval.n)
    cfg.runtime.eval.base = first
    if preset.fleet_profile is not None:
        cfg.fleet = single_profile_fleet(base.fleet, preset.fleet_profile)
    elif fleet == "homogeneous":
        cfg.fleet = homogeneous_fleet(base.fleet)
    elif fleet == "stress":
        cfg.fleet = stress_fleet(base.fleet)
    if preset.mode is not None:
        cfg.runtime.mode = preset.mode
    if preset.trainer_precision is not None:
        cfg.optim.precision = preset.trainer_precision
    return cfg


def plan(args: argparse.Namespace) -> list[tuple[str, str, Path]]:
    """Write ``OUT/configs/<fleet>/<arm>/seed<s>.toml`` for each run; return (fleet, arm, run_dir)."""
    from mixrl.config import run as runcfg
    from mixrl.config.presets import PRESETS

    b = settings(args)
    arms, fleets = list(b["arms"]), list(b["fleets"])  # type: ignore[call-overload]
    bad = [a for a in arms if a not in PRESETS]
    if bad:
        raise runcfg.ConfigError(f"--arms: unknown preset(s) {bad}; valid: {sorted(PRESETS)}")
    bad = [f for f in fleets if f not in FLEETS]
    if bad:
        raise runcfg.ConfigError(f"--fleets: unknown fleet(s) {bad}; valid: {list(FLEETS)}")
    base = runcfg.load_config(args.config or default_config_path(), args.overrides)
    cells = []
    for arm in arms:
        if PRESETS[arm].fleet_profile is not None:
            cells.append((REFERENCE_FLEET, arm))
        else:
            cells += [(fleet, arm) for fleet in fleets]
    out = []
    for seed in range(int(b["seeds"])):  # type: ignore[call-overload]
        for fleet, arm in cells:
            run_dir = args.out / fleet / arm / f"seed{seed}"
            cfg = _arm_config(base, arm, fleet, seed, run_dir, b, first=not out)
            side_file(run_dir, "configs", ".toml").write_text(runcfg.to_toml(cfg) + "\n")
            out.append((fleet, arm, run_dir))
    return out


def _cpu_overrides(mixed) -> dict:  # type: ignore[no-untyped-def]
    return {k: v for g in mixed.groups for k, v in g.overrides.items() if k == "compute_dtype"}


def single_profile_fleet(mixed, profile: str):  # type: ignore[no-untyped-def]
    """One group of ``profile`` with the mixed fleet's total replicas (and its CPU overrides,
    except for a profile that sets its own compute dtype on purpose: ``fp32``, ``fp16``)."""
    from mixrl.config.run import FleetConfig, GroupConfig

    n = sum(g.replicas for g in mixed.groups)
    overrides = {} if profile in ("fp32", "fp16") else _cpu_overrides(mixed)
    group = GroupConfig(name=profile, profile=profile, replicas=n,
                        min_replicas=min(1, n), max_replicas=max(n, 1), overrides=overrides)
    return FleetConfig(groups=[group], autoscaler=mixed.autoscaler)


def homogeneous_fleet(mixed):  # type: ignore[no-untyped-def]
    """One ``b200-bf16`` group with the mixed fleet's total replicas and CPU overrides."""
    return single_profile_fleet(mixed, HOMOGENEOUS_PROFILE)


def cpu_has_bf16() -> bool:
    """Native BF16 matmuls on this CPU (AVX512-BF16 or AMX); without them BF16 is emulated
    and several times slower than FP32, so the study computes in FP32 there."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def stress_fleet(mixed):  # type: ignore[no-untyped-def]
    """One replica of each ``STRESS_PROFILES`` group: BF16 compute where the CPU has it."""
    from mixrl.config.run import FleetConfig, GroupConfig

    overrides = {} if cpu_has_bf16() else {"compute_dtype": "float32"}
    groups = [GroupConfig(name=p, profile=p, replicas=1, min_replicas=1, max_replicas=2,
                          overrides=dict(overrides)) for p in STRESS_PROFILES]
    return FleetConfig(groups=groups, autoscaler=mixed.autoscaler)


def finished(run_dir: Path) -> bool:
    """A run is finished when ``mixrl train`` wrote its summary and was not interrupted."""
    import json

    f = run_dir / "summary.json"
    try:
        return f.exists() and not json.loads(f.read_text()).get("interrupted", True)
    except json.JSONDecodeError:
        return False


def side_file(run_dir: Path, kind: str, suffix: str) -> Path:
    """``OUT/<kind>/<fleet>/<arm>/seed<s><suffix>``: configs and logs live beside the run
    directories (``mixrl train`` wants its run directory to itself)."""
    seed_dir = Path(run_dir)
    out = seed_dir.parent.parent.parent
    f = out / kind / seed_dir.parent.parent.name / seed_dir.parent.name / (seed_dir.name + suffix)
    f.parent.mkdir(parents=True, exist_ok=True)
    return f


def _run_one(run_dir: Path, threads: int) -> tuple[Path, int, float]:
    if finished(run_dir):
        return run_dir, 0, 0.0
    cmd = [sys.executable, "-m", "mixrl.cli", "train"]
    if (run_dir / "checkpoints").exists() and any((run_dir / "checkpoints").iterdir()):
        cmd += ["--resume", str(run_dir)]
    else:  # nothing to resume: start (again) from the written config
        cmd += [str(side_file(run_dir, "configs", ".toml")), "--overwrite"]
    cmd += ["--set", f"runtime.torch_threads={threads}"]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    t0 = time.time()
    with open(side_file(run_dir, "logs", ".log"), "a") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    return run_dir, rc, time.time() - t0


def main(args: argparse.Namespace) -> int:
    from mixrl.config.run import ConfigError

    try:
        runs = plan(args)
    except ConfigError as e:
        print(f"mixrl compare: invalid config:\n{e}", file=sys.stderr)
        return 2
    print(f"{len(runs)} runs under {args.out}: " + ", ".join(sorted({f"{f}/{a}" for f, a, _ in runs}))
          + f" x {settings(args)['seeds']} seed(s)")
    if args.dry_run:
        return 0
    jobs = max(1, min(args.jobs, len(runs)))
    threads = max(1, (os.cpu_count() or 1) // jobs)
    t0 = time.time()
    failed = []
    with ThreadPoolExecutor(jobs) as pool:
        for run_dir, rc, dt in pool.map(lambda r: _run_one(r[2], threads), runs):  # seed-major
            status = "ok" if rc == 0 else f"FAILED (exit {rc}, see {side_file(run_dir, 'logs', '.log')})"
            print(f"  {run_dir}: {status} in {dt:.0f} s", flush=True)
            if rc != 0:
                failed.append(run_dir)
    print(f"compare wall time: {time.time() - t0:.0f} s")
    if not args.no_report:
        from mixrl.observe import report

        report.main(argparse.Namespace(dir=args.out, k=4))
    return 1 if failed else 0
