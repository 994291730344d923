"""``mixrl compare``: the seed's study, on your fleet, as ordinary runs.

Runs each correction arm on each fleet with each seed: the mixed fleet (the
config's groups), the homogeneous fleet (the ``b200-bf16`` profile, same total
replicas), the exact fleet (one ``fp32`` group, the trainer's own numerics: the
zero-mismatch fleet of the ablation) and the stress fleet (``STRESS_PROFILES``: W4A4 / W8A8 samplers, FP4
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
seed 0 of every cell first (in a 2 x 2 study, the homogeneous fleet's cells after
every seed of the others). ``kill -TERM`` (or Ctrl-C) stops a study cleanly: no
run starts, the runs in flight save a checkpoint and stop, ``--resume`` continues. At the end the report (``mixrl report OUT``) is written.

Precision and lag are separated by the scheduling mode: with ``--modes sync,async``
each fleet runs in ``runtime.mode = "sync"`` (staleness 0: the samplers' numerics
alone) and async (numerics + policy lag), under the fleet names ``<fleet>-sync``
and ``<fleet>-async``: with ``grpo`` and the corrected arm (``[study] corrected``) a 2 x 2 per fleet
(``lab/study/design.py`` judges it). The budget ``study`` is that design on the
toy; ``real`` is its sync half on a model you name (``--model DIR``, LoRA, the
``[study.real]`` block of compare.toml). The ``[study]`` table of the config
(margins, the collapse monitor's settings, FP32 scoring) is read here, never
passed to the runs.

    mixrl compare                       # the default study (docs/study.md: ~60 min on 2 cores)
    mixrl compare --budget study --plan # the 2 x 2 design: runs and projected time
    mixrl compare --resume OUT          # continue a study (finished runs are skipped)
    mixrl compare --recompute OUT       # every interval again, from OUT/data alone
    mixrl compare --ablation OUT        # the correction ablation's table (lab/study/ablation.py)
    mixrl compare --arms grpo,on-policy --fleets stress --seeds 2 --steps 4   # a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tomllib
from pathlib import Path
from typing import Any

from mixrl.lab.study.settings import default_config_path, saved_config, study_table  # noqa: F401 - compare's settings
from mixrl.lab.study.studyrun import finished, side_file  # noqa: F401  (the run layout, re-exported)

ARMS = ("grpo", "grpo+mis", "sc", "grpo+top-p", "sc+mis", "sc+mis+top-p", "on-policy", "fp16")
STUDY_FLEETS = ("mixed", "homogeneous", "stress")  # the 2 x 2 study's fleets
FLEETS = (*STUDY_FLEETS, "exact")  # "exact": the ablation's zero-mismatch fleet
MODES = ("sync", "async")
REFERENCE_FLEET = "reference"  # where the arms with their own numerics run
HOMOGENEOUS_PROFILE = "b200-bf16"
EXACT_PROFILE = "fp32"  # the "exact" fleet: samplers compute as the FP32 trainer (no mismatch)
STRESS_PROFILES = ("stress-b200-nvfp4", "stress-b300-mxfp4", "stress-h100-fp8")

# What each budget runs. "default" is sized to fit 60 minutes on 2 quiet cores (21 runs; the
# measured wall time is in docs/study.md); "full" is the whole study (~4-7 h projected).
# --arms/--fleets/--seeds/--steps/--eval-* override a budget.
BUDGETS: dict[str, dict[str, object]] = {
    "default": {"arms": ("grpo", "sc", "on-policy"), "fleets": STUDY_FLEETS,
                "seeds": 3, "steps": 24, "eval_tasks": 48, "eval_n": 16},
    "full": {"arms": ARMS, "fleets": STUDY_FLEETS, "seeds": 3, "steps": 100, "eval_tasks": 128,
             "eval_n": 16},
    # precision vs lag: every fleet sync and async, over a horizon where a collapse can show
    "study": {"arms": ("grpo", "sc", "on-policy"), "fleets": STUDY_FLEETS,
              "modes": MODES, "seeds": 7, "steps": 150, "eval_tasks": 48, "eval_n": 16},
    # the correction ablation (lab/study/ablation.py): each seed arm with and without mismatch
    "ablation": {"arms": ("grpo", "grpo+top-p", "sc", "grpo+mis", "sc+mis", "sc+mis+top-p"),
                 "fleets": ("exact", "mixed"), "modes": ("sync",), "seeds": 5, "steps": 80,
                 "eval_tasks": 48, "eval_n": 16},
    # the real model's precision-only cells; arms, steps and LoRA from [study.real]
    "real": {"arms": ("grpo", "sc", "on-policy"), "fleets": ("mixed",), "modes": ("sync",),
             "seeds": 3, "steps": 10, "eval_tasks": 48, "eval_n": 16},
}


def configure(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("config", nargs="?", type=Path, default=None,
      help="base run config (default: the bundled compare.toml)")
    a("--budget", choices=tuple(BUDGETS), default="default",
      help="what to run: default (fits ~60 min on 2 cores), full, study (sync x async, 150 updates), "
           "ablation (6 arms on the exact and mixed fleets, sync) "
           "or real (a model of yours, sync; docs/study.md)")
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
    a("--modes", default=None, help="comma-separated runtime modes among sync,async (budget's; "
      "default and full: async only)")
    a("--model", default=None, help="budget real: the model directory (sets [study.real] model_path)")
    a("--plan", action="store_true", help="print the runs and their projected time, run nothing")
    a("--calibrate", type=int, default=0, metavar="N",
      help="with --plan: first run seed 0 of each cell for N updates to measure their cost")
    a("--resume", type=Path, default=None, metavar="OUT",
      help="continue the study in OUT with the settings it was started with")
    a("--recompute", type=Path, default=None, metavar="OUT",
      help="recompute every interval from OUT/data (the committed per-run files)")
    a("--ablation", type=Path, default=None, metavar="OUT",
      help="the correction ablation's pass@1 table from OUT/data (lab/study/ablation.py)")
    a("--ablation-top-p", type=float, default=None, metavar="P",
      help="with --ablation: first score each run's final policy inside the nucleus P (OUT/topp)")
    a("--stop-after", type=float, default=None, metavar="MIN",
      help="start no run after MIN minutes (the study continues with --resume)")
    a("--dry-run", action="store_true", help="write the run configs, run nothing")
    a("--no-report", action="store_true", help="skip the report at the end")


def settings(args: argparse.Namespace) -> dict[str, object]:
    """The budget with the command line's overrides; bad values raise ConfigError."""
    from mixrl.config import ConfigError

    budget = getattr(args, "budget", None) or "default"
    b = dict(BUDGETS[budget])
    b.setdefault("modes", ("async",))
    real = study_table(getattr(args, "config", None)).get("real", {}) if budget == "real" else {}
    for key in ("arms", "steps", "seeds", "eval_tasks", "eval_n"):
        if key in real:
            b[key] = tuple(real[key]) if key == "arms" else int(real[key])
    for key in ("arms", "fleets", "modes"):
        if getattr(args, key, None):
            b[key] = tuple(x for x in str(getattr(args, key)).split(",") if x)
    for key in ("seeds", "steps", "eval_tasks", "eval_n"):
        if getattr(args, key, None) is not None:
            b[key] = int(getattr(args, key))
    for key in ("seeds", "steps", "eval_tasks", "eval_n"):
        if int(b[key]) < 1:  # type: ignore[call-overload]
            raise ConfigError(f"--{key.replace('_', '-')} must be >= 1, got {b[key]}")
    bad = [m for m in b["modes"] if m not in MODES]  # type: ignore[attr-defined]
    if bad or not b["modes"]:
        raise ConfigError(f"--modes: unknown mode(s) {bad}; valid: {list(MODES)}")
    if budget == "real":
        model = getattr(args, "model", None) or real.get("model_path") or ""
        if not model:
            raise ConfigError("study.real.model_path is empty: name the model with --model DIR")
        b["model"], b["real_set"] = str(model), [str(x) for x in real.get("set", [])]
    return b


def fleet_dir(fleet: str, mode: str, modes: tuple[str, ...]) -> str:
    """The fleet's folder: ``<fleet>`` when the study has one mode (async), else ``<fleet>-<mode>``."""
    return fleet if tuple(modes) == ("async",) else f"{fleet}-{mode}"


def split_fleet(name: str) -> tuple[str, str]:
    """``"mixed-sync"`` -> ``("mixed", "sync")``; a plain fleet runs async."""
    for m in MODES:
        if name.endswith("-" + m):
            return name[: -len(m) - 1], m
    return name, "async"


def _arm_config(base, arm: str, fleet: str, seed: int, run_dir: Path, b: dict, first: bool):  # type: ignore[no-untyped-def]
    import mixrl.config as runcfg
    from mixrl.config.presets import PRESETS

    preset = PRESETS[arm]
    fleet, mode = split_fleet(fleet)
    cfg = base.model_copy(deep=True)
    cfg.runtime.mode = mode  # type: ignore[assignment]
    cfg.loss = runcfg.LossSection(preset=arm, overrides=dict(base.loss.overrides))
    cfg.observe.run_dir = str(run_dir)
    cfg.observe.progress = False
    cfg.runtime.seed = base.runtime.seed + seed
    cfg.runtime.steps = int(b["steps"])
    cfg.runtime.checkpoint_every = min(cfg.runtime.checkpoint_every or cfg.runtime.steps,
                                       cfg.runtime.steps)
    # every run is evaluated (a config may turn it off for its own runs), n > k, the same tasks
    # and sampling seeds for every run; the base policy is evaluated once
    cfg.runtime.eval.enabled = True
    n = int(b["eval_n"])
    cfg.runtime.eval.k = min(cfg.runtime.eval.k, n)  # first: each assignment is validated (k <= n)
    cfg.runtime.eval.n_tasks, cfg.runtime.eval.n = int(b["eval_tasks"]), n
    cfg.runtime.eval.base = first
    if preset.fleet_profile is not None:
        cfg.fleet = single_profile_fleet(base.fleet, preset.fleet_profile)
    elif fleet == "homogeneous":
        cfg.fleet = homogeneous_fleet(base.fleet)
    elif fleet == "stress":
        cfg.fleet = stress_fleet(base.fleet)
    elif fleet == "exact":
        cfg.fleet = single_profile_fleet(base.fleet, EXACT_PROFILE)
    if preset.mode is not None:
        cfg.runtime.mode = preset.mode
    if preset.trainer_precision is not None:
        cfg.optim.precision = preset.trainer_precision
    return cfg


def base_config(args: argparse.Namespace, b: dict[str, object]):  # type: ignore[no-untyped-def]
    """The run config shared by every run: the file less its ``[study]`` table, the real
    model's settings (budget real), then ``--set``."""
    import mixrl.config as runcfg

    path = Path(args.config or default_config_path())
    try:
        tree = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise runcfg.ConfigError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise runcfg.ConfigError(f"{path}: invalid TOML: {e}") from None
    tree.pop("study", None)
    sets = list(b.get("real_set", []))  # type: ignore[call-overload]
    if "model" in b:
        sets.insert(0, f"model.path={json.dumps(b['model'])}")
    cfg = runcfg.build_config(tree, sets + list(args.overrides))
    runcfg.resolve_paths(cfg, path.resolve().parent)  # data and reward files next to the config
    return cfg


def plan(args: argparse.Namespace) -> list[tuple[str, str, Path]]:
    """Write ``OUT/configs/<fleet>/<arm>/seed<s>.toml`` for each run; return (fleet, arm, run_dir)."""
    import mixrl.config as runcfg
    from mixrl.config.presets import PRESETS

    b = settings(args)
    arms, fleets = list(b["arms"]), list(b["fleets"])  # type: ignore[call-overload]
    bad = [a for a in arms if a not in PRESETS]
    if bad:
        raise runcfg.ConfigError(f"--arms: unknown preset(s) {bad}; valid: {sorted(PRESETS)}")
    bad = [f for f in fleets if f not in FLEETS]
    if bad:
        raise runcfg.ConfigError(f"--fleets: unknown fleet(s) {bad}; valid: {list(FLEETS)}")
    base = base_config(args, b)
    modes = tuple(b["modes"])  # type: ignore[call-overload]
    cells = []
    for arm in arms:
        if PRESETS[arm].fleet_profile is not None:
            cells.append((REFERENCE_FLEET, arm))
        else:
            cells += [(fleet_dir(f, m, modes), arm) for f in fleets for m in modes]
    # with both modes, the homogeneous fleet (which only F3 reads) runs after every seed of the
    # others, so a study cut short has the stress and mixed effects first
    late = [c for c in cells if "sync" in modes and split_fleet(c[0])[0] == "homogeneous"]
    out = []
    for tier in ([c for c in cells if c not in late], late):
        for seed in range(int(b["seeds"])):  # type: ignore[call-overload]
            for fleet, arm in tier:
                run_dir = args.out / fleet / arm / f"seed{seed}"
                cfg = _arm_config(base, arm, fleet, seed, run_dir, b, first=not out)
                side_file(run_dir, "configs", ".toml").write_text(runcfg.to_toml(cfg) + "\n")
                out.append((fleet, arm, run_dir))
    return out


def _cpu_overrides(mixed) -> dict:  # type: ignore[no-untyped-def]
    return {k: v for g in mixed.groups for k, v in g.overrides.items() if k == "compute_dtype"}


PLACEMENT = ("accelerator_type", "num_gpus", "num_cpus", "memory_gb", "cuda_devices")


def placement(mixed) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """Where the mixed fleet's first group runs (a GPU, a node type): the other fleets run there too."""
    return {k: getattr(mixed.groups[0], k) for k in PLACEMENT} if mixed.groups else {}


def single_profile_fleet(mixed, profile: str):  # type: ignore[no-untyped-def]
    """One group of ``profile`` with the mixed fleet's total replicas (and its CPU overrides,
    except for a profile that sets its own compute dtype on purpose: ``fp32``, ``fp16``)."""
    from mixrl.config import FleetConfig, GroupConfig

    n = sum(g.replicas for g in mixed.groups)
    overrides = {} if profile in ("fp32", "fp16") else _cpu_overrides(mixed)
    group = GroupConfig(name=profile, profile=profile, replicas=n,
                        min_replicas=min(1, n), max_replicas=max(n, 1), overrides=overrides,
                        **placement(mixed))
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
    from mixrl.config import FleetConfig, GroupConfig

    overrides = {} if cpu_has_bf16() else {"compute_dtype": "float32"}
    groups = [GroupConfig(name=p, profile=p, replicas=1, min_replicas=1, max_replicas=2,
                          overrides=dict(overrides), **placement(mixed)) for p in STRESS_PROFILES]
    return FleetConfig(groups=groups, autoscaler=mixed.autoscaler)


SAVED = ("budget", "arms", "fleets", "modes", "seeds", "steps", "eval_tasks", "eval_n", "config", "overrides",
         "model")


def _restore(args: argparse.Namespace) -> None:
    """``--resume OUT``: the settings the study in OUT was started with (``OUT/study.json``)."""
    from mixrl.config import ConfigError

    f = Path(args.resume) / "study.json"
    if not f.exists():
        raise ConfigError(f"--resume: {f} not found (start the study without --resume first)")
    saved = json.loads(f.read_text())["args"]
    for k in SAVED:
        setattr(args, k, Path(saved[k]) if k == "config" and saved[k] else saved[k])
    args.out = Path(args.resume)


def _save(args: argparse.Namespace, b: dict[str, object]) -> None:
    state = {k: (str(v) if isinstance(v := getattr(args, k, None), Path) else v) for k in SAVED}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "study.json").write_text(json.dumps({"args": state, "settings": b}, indent=1, default=list))


def fp32_settings(args: argparse.Namespace, b: dict[str, object]) -> dict[str, Any]:
    t = dict(study_table(args.config).get("fp32", {}))
    return {"enabled": bool(t.get("enabled", True)), "n_tasks": int(t.get("n_tasks", 16)),
            "n": int(t.get("n", 8)), "seed": int(t.get("seed", 4321))}


def print_plan(args: argparse.Namespace, runs: list[Path], steps: int) -> dict[str, Any]:
    from mixrl.lab.study.studyrun import projection

    p = projection(args.out, runs, steps, args.jobs)
    for k, m in sorted(p["measured"].items()):
        print(f"  measured {k}: {m['update_s']:.2f} s/update, fixed {m['fixed_s']:.0f} s/run ({m['source']})")
    for r in p["runs"]:
        extra = (f"{r['updates']} updates x {r['update_s']:.2f} s + {r['fixed_s']:.0f} s = "
                 f"{r['projected_s'] / 60:.1f} min ({r['measured']})" if r["status"] != "done" else "")
        print(f"  {r['run']}: {r['status']} {extra}")
    if p["unmeasured"]:
        print("  nothing measured yet: add --calibrate N (runs seed 0 of each cell for N updates)")
    else:
        print(f"projected: {p['total_run_s'] / 3600:.2f} h of runs, {p['wall_s'] / 3600:.2f} h wall "
              f"with {p['jobs']} job(s) (load average now {os.getloadavg()[0]:.1f})")
    (args.out / "plan.json").write_text(json.dumps(p, indent=1, default=float))
    return p


def _calibrate(args: argparse.Namespace, steps: int) -> None:
    from mixrl.lab.study.studyrun import execute

    cal = argparse.Namespace(**{**vars(args), "out": args.out / "calibration", "seeds": 1, "steps": steps})
    runs = [r for _, _, r in plan(cal)]
    print(f"calibration: {len(runs)} runs of {steps} updates under {cal.out}")
    execute(cal.out, runs, args.jobs, fp32_settings(args, {}))


def main(args: argparse.Namespace) -> int:
    from mixrl.config import ConfigError

    if args.recompute is not None:
        return tables(Path(args.recompute), args.config)
    if args.ablation is not None:
        from mixrl.lab.study import ablation

        return ablation.main(Path(args.ablation), args.ablation_top_p, args.jobs)
    try:
        if args.resume is not None:
            _restore(args)
        b = settings(args)
        runs = plan(args)
    except ConfigError as e:
        print(f"mixrl compare: invalid config:\n{e}", file=sys.stderr)
        return 2
    print(f"{len(runs)} runs under {args.out}: " + ", ".join(sorted({f"{f}/{a}" for f, a, _ in runs}))
          + f" x {b['seeds']} seed(s), {b['steps']} updates")
    if args.dry_run:
        return 0
    _save(args, b)
    dirs = [r for _, _, r in runs]
    if args.plan:
        if args.calibrate > 0:
            _calibrate(args, args.calibrate)
        print_plan(args, dirs, int(b["steps"]))  # type: ignore[call-overload]
        return 0
    from mixrl.lab.study.studyrun import execute

    failed = execute(args.out, dirs, args.jobs, fp32_settings(args, b), args.stop_after)
    if not args.no_report:
        tables(args.out, args.config)
    return 1 if failed else 0


def tables(out: Path, config: Path | None) -> int:
    """The study's judgement (``design.md``, with both modes) and the report, from ``OUT/data``
    when the runs wrote data files (``--recompute``), else from the run directories."""
    from mixrl.lab.study import design, report, studydata

    study = study_table(config if config is not None else saved_config(out))
    runs = studydata.load(out)
    if runs and any(split_fleet(r.fleet)[1] == "sync" and r.fleet != REFERENCE_FLEET for r in runs):
        design.main(out, study)
    elif not runs and not list(out.glob("*/*/seed*/metrics.jsonl")):
        print(f"mixrl compare: no data files under {out / 'data'} and no runs under {out}", file=sys.stderr, flush=True)
        return 2
    return report.main(argparse.Namespace(dir=out, k=None), study)
