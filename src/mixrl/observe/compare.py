"""``mixrl compare``: the seed's study, on your fleet, as ordinary runs.

Runs each correction arm on the mixed fleet (the config's groups) and on the
homogeneous fleet (the ``b200-bf16`` profile, same total replicas), with the
same seeds and budget. Every arm is a normal run directory
``OUT/<fleet>/<arm>`` written by ``mixrl train``; the comparison is resumable:
finished arms (``summary.json`` of an uninterrupted run) are skipped, interrupted ones resume
from their last checkpoint. Arms run as separate processes, ``--jobs`` at a
time, each with ``cores // jobs`` torch threads. At the end the report
(``mixrl report OUT``) is written.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ARMS = ("grpo", "grpo+mis", "sc", "grpo+top-p", "sc+mis", "sc+mis+top-p")
FLEETS = ("mixed", "homogeneous")
HOMOGENEOUS_PROFILE = "b200-bf16"


def default_config_path() -> Path:
    return Path(__file__).resolve().parent.parent / "configs" / "compare.toml"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", type=Path, default=None,
                        help="base run config (default: the bundled compare.toml)")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated presets")
    parser.add_argument("--fleets", default=",".join(FLEETS), help="mixed,homogeneous")
    parser.add_argument("--out", type=Path, default=Path("runs/compare"), help="compare directory")
    parser.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2)),
                        help="runs in parallel (default: one per core)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override applied to every arm")
    parser.add_argument("--dry-run", action="store_true", help="write the arm configs, run nothing")
    parser.add_argument("--no-report", action="store_true", help="skip the report at the end")


def plan(args: argparse.Namespace) -> list[tuple[str, str, Path]]:
    """Write ``OUT/<fleet>/<arm>/input.toml`` for each arm; return (fleet, arm, run_dir)."""
    from mixrl.config import run as runcfg
    from mixrl.config.presets import PRESETS

    arms = [a for a in args.arms.split(",") if a]
    fleets = [f for f in args.fleets.split(",") if f]
    bad = [a for a in arms if a not in PRESETS]
    if bad:
        raise runcfg.ConfigError(f"--arms: unknown preset(s) {bad}; valid: {sorted(PRESETS)}")
    bad = [f for f in fleets if f not in FLEETS]
    if bad:
        raise runcfg.ConfigError(f"--fleets: unknown fleet(s) {bad}; valid: {list(FLEETS)}")
    base = runcfg.load_config(args.config or default_config_path(), args.overrides)
    out = []
    for fleet in fleets:
        for arm in arms:
            run_dir = args.out / fleet / arm
            cfg = base.model_copy(deep=True)
            cfg.loss = runcfg.LossSection(preset=arm, overrides=dict(base.loss.overrides))
            cfg.observe.run_dir = str(run_dir)
            cfg.observe.progress = False
            if fleet == "homogeneous":
                cfg.fleet = homogeneous_fleet(base.fleet)
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "input.toml").write_text(runcfg.to_toml(cfg) + "\n")
            out.append((fleet, arm, run_dir))
    return out


def homogeneous_fleet(mixed):  # type: ignore[no-untyped-def]
    """One ``b200-bf16`` group with the mixed fleet's total replicas and CPU overrides."""
    from mixrl.config.run import FleetConfig, GroupConfig

    n = sum(g.replicas for g in mixed.groups)
    overrides = {k: v for g in mixed.groups for k, v in g.overrides.items() if k == "compute_dtype"}
    group = GroupConfig(name=HOMOGENEOUS_PROFILE, profile=HOMOGENEOUS_PROFILE, replicas=n,
                        min_replicas=min(1, n), max_replicas=max(n, 1), overrides=overrides)
    return FleetConfig(groups=[group], autoscaler=mixed.autoscaler)


def finished(run_dir: Path) -> bool:
    """A run is finished when ``mixrl train`` wrote its summary and was not interrupted."""
    import json

    f = run_dir / "summary.json"
    try:
        return f.exists() and not json.loads(f.read_text()).get("interrupted", True)
    except json.JSONDecodeError:
        return False


def _run_one(run_dir: Path, threads: int) -> tuple[Path, int, float]:
    if finished(run_dir):
        return run_dir, 0, 0.0
    cmd = [sys.executable, "-m", "mixrl.cli", "train"]
    if (run_dir / "checkpoints").exists() and any((run_dir / "checkpoints").iterdir()):
        cmd += ["--resume", str(run_dir)]
    else:
        cmd += [str(run_dir / "input.toml")]
    cmd += ["--set", f"runtime.torch_threads={threads}"]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    t0 = time.time()
    with open(run_dir / "train.log", "a") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    return run_dir, rc, time.time() - t0


def main(args: argparse.Namespace) -> int:
    from mixrl.config.run import ConfigError

    try:
        runs = plan(args)
    except ConfigError as e:
        print(f"mixrl compare: invalid config:\n{e}", file=sys.stderr)
        return 2
    print(f"{len(runs)} runs under {args.out}: " + ", ".join(f"{f}/{a}" for f, a, _ in runs))
    if args.dry_run:
        return 0
    jobs = max(1, min(args.jobs, len(runs)))
    threads = max(1, (os.cpu_count() or 1) // jobs)
    t0 = time.time()
    failed = []
    with ThreadPoolExecutor(jobs) as pool:
        for run_dir, rc, dt in pool.map(lambda r: _run_one(r[2], threads), runs):
            status = "ok" if rc == 0 else f"FAILED (exit {rc}, see {run_dir / 'train.log'})"
            print(f"  {run_dir}: {status} in {dt:.0f} s", flush=True)
            if rc != 0:
                failed.append(run_dir)
    print(f"compare wall time: {time.time() - t0:.0f} s")
    if not args.no_report:
        from mixrl.observe import report

        report.main(argparse.Namespace(dir=args.out, k=4))
    return 1 if failed else 0
