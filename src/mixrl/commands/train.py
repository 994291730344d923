"""``mixrl train [CONFIG.toml] [--set key.path=value ...] [--dry-run] [--resume RUN_DIR | --overwrite] [--json]``.

No config file: the bundled demo (``mixrl/configs/demo.toml``). The config is
parsed and validated before torch or Ray are imported; so are the environment
name and options, the dataset and the reward functions: any of them wrong
exits with status 2 and one line naming the field. Relative ``data.*`` paths
and reward files are taken from the config file's folder (then the current
one). ``--resume RUN_DIR`` continues the run in RUN_DIR from its newest
checkpoint with the config saved there (``--set`` may still change e.g.
``runtime.steps``), and refuses if the model or the data changed. A fresh run
refuses a non-empty run directory unless ``--overwrite``, which deletes only a directory
that ``mixrl train`` made (its ``.mixrl-run`` marker). Ctrl-C saves a
checkpoint and exits with status 130. An internal error prints one line and
the log holding its traceback (``RUN_DIR/run.log``), exit status 1.

At the end a short summary: base -> final held-out score, wall time,
samples/s, the run directory and the commands to look at it; ``--json``
prints the same as one JSON object instead.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from mixrl.config import ConfigError, load_config, resolve_paths, to_toml
from mixrl.data import DataError
from mixrl.envs.rewards import RewardError
from mixrl.records.run_dir import RunDir
from mixrl.rollout.failures import EpisodesFailed
from mixrl.runtime.inputs import InputsChanged, check_unchanged, describe_inputs
from mixrl.system.jsonout import json_text
from mixrl.system.quiet import silence_libraries
from mixrl.telemetry.sinks import SinkUnavailable


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", default=None, help="TOML config (default: the bundled demo)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one field, e.g. --set rollout.group_size=4 (repeatable)")
    parser.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--resume", metavar="RUN_DIR", default=None, help="continue the run in RUN_DIR")
    parser.add_argument("--overwrite", action="store_true", help="replace what is in the run directory")
    parser.add_argument("--backend", choices=("embedded", "ray"), default=None, help="override runtime.backend")
    parser.add_argument("--no-eval", action="store_true", help="skip the final held-out evaluation")
    parser.add_argument("--json", action="store_true", help="print the final summary as one JSON object")


def _fail(msg: str) -> int:
    print(f"mixrl train: {msg}", file=sys.stderr)
    return 2


def _check_run_dir(run_dir: Path, resume: bool, overwrite: bool) -> str | None:
    if run_dir.exists() and not run_dir.is_dir():
        return f"observe.run_dir {run_dir} is a file, not a directory"
    if resume or not run_dir.exists() or not any(run_dir.iterdir()):
        return None
    if overwrite:
        marker = RunDir(run_dir).marker
        if run_dir.is_symlink() or not run_dir.is_dir() or not marker.is_file():
            return (f"--overwrite: {run_dir} is not a run directory of mixrl train (no {marker.name} in it): "
                    "nothing was deleted; choose another observe.run_dir, or remove it yourself")
        shutil.rmtree(run_dir)
        return None
    return (f"run directory {run_dir} is not empty (an earlier run?): "
            f"continue it with --resume {run_dir}, or replace it with --overwrite")


def _print_safely(text: str) -> None:
    """Print; a closed pipe (``| head``) ends quietly instead of with a BrokenPipeError."""
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def main(args: argparse.Namespace) -> int:

    silence_libraries()
    if args.resume and args.overwrite:
        return _fail("--resume and --overwrite exclude each other")
    overrides = list(args.overrides)
    if args.backend:
        overrides.append(f'runtime.backend="{args.backend}"')
    path = args.config
    if args.resume:
        saved = RunDir(args.resume).config
        if not saved.exists():
            return _fail(f"--resume {args.resume}: no run there ({saved} not found)")
        if path is None:
            path = saved
        overrides.append(f'observe.run_dir="{Path(args.resume).as_posix()}"')
    try:
        cfg = load_config(path, overrides)
    except ConfigError as e:
        return _fail("invalid config: " + "; ".join(str(e).splitlines()))
    resolve_paths(cfg, Path(path).resolve().parent if path is not None else None)

    try:  # the preset, profiles, environment, data and rewards are config too: check them before anything heavy
        from mixrl.envs.registry import activate, try_rewards
        from mixrl.runtime.run import group_profiles, resolve_loss

        loss_cfg, derived = resolve_loss(cfg)
        group_profiles(cfg)
        active = activate(cfg)
        from mixrl.models.loading import check_model

        model_dir = check_model(cfg.model.path, cfg.model.chat_template)  # resolves, names what is missing
    except (ConfigError, DataError, RewardError, ValueError) as e:
        return _fail("invalid config: " + "; ".join(str(e).splitlines()))
    try:  # the reward functions on real rows: one that cannot score a reply fails before any work
        try_rewards(cfg, active)
    except RewardError as e:
        return _fail(str(e).splitlines()[0])
    if args.dry_run:
        _print_safely("# mixrl train: resolved config (--dry-run)\n" + to_toml(cfg) + "\n\n# derived (not settable)\n"
                      f"# {json.dumps(derived.__dict__)}\n# loss = {loss_cfg.model_dump_json()}\n# model = {model_dir}")
        return 0
    run_dir = Path(cfg.observe.run_dir)
    problem = _check_run_dir(run_dir, bool(args.resume), args.overwrite)
    if problem:
        return _fail(problem)
    done = RunDir(run_dir).complete_checkpoints() if args.resume else []
    if done and done[-1][0] >= cfg.runtime.steps:  # nothing left to train: say so, do no work
        try:  # a changed model or dataset is said first, as for a run that continues
            check_unchanged(run_dir, describe_inputs(cfg, str(model_dir)))
        except InputsChanged as e:
            return _fail(str(e))
        out = finished_summary(run_dir, done[-1][0], cfg.runtime.steps)
        _print_safely(json_text(out, indent=2) if args.json else "\n".join(
            [f"the run in {run_dir} is finished: {out['steps']} of {cfg.runtime.steps} updates; nothing to do",
             "next: " + "   ".join(out["next"])]))
        return 0
    return _train(cfg, args, run_dir)


def finished_summary(run_dir: Path, step: int, steps: int) -> dict[str, Any]:
    """What ``--resume`` of a run that has trained all its updates prints (no work is done)."""
    return {"steps": step, "finished": True, "run_dir": str(run_dir),
            "next": [f"mixrl train --resume {run_dir} --set runtime.steps={max(2 * step, steps + 1)}",
                     *hints(run_dir, interrupted=False)]}


def hints(run_dir: Path, interrupted: bool) -> list[str]:
    """The commands that apply to ``run_dir`` now: an interrupted run has no final policy yet."""
    if interrupted:
        return [f"mixrl train --resume {run_dir}", f"mixrl report {run_dir}"]
    out = [f"mixrl report {run_dir}"]
    if (run_dir / "policy").is_dir():
        out.append(f"mixrl eval {run_dir / 'policy'} --k 4")
    return out


def _train(cfg: Any, args: argparse.Namespace, run_dir: Path) -> int:
    import logging
    import traceback

    from mixrl.runtime.run import train

    try:
        summary = train(cfg, resume=bool(args.resume), evaluate=False if args.no_eval else None)
    except KeyboardInterrupt:
        return 130
    except (ConfigError, DataError, RewardError, InputsChanged, SinkUnavailable, FileNotFoundError) as e:
        return _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    except EpisodesFailed as e:  # nothing to learn from: the run's own code (2) or the host (1) failed
        print(f"mixrl train: {str(e).splitlines()[0]} — details in {RunDir(run_dir).log}", file=sys.stderr)
        return 2 if e.user else 1
    except Exception as e:
        from mixrl.runtime.run import start_log

        run_dir.mkdir(parents=True, exist_ok=True)
        log = start_log(run_dir)  # appends to the run's log
        logging.getLogger("mixrl").error("internal error:\n%s", traceback.format_exc())
        first = str(e).splitlines()[0] if str(e) else ""
        print(f"mixrl train: internal error: {type(e).__name__}: {first} (traceback in {log})", file=sys.stderr)
        return 1
    out = run_summary(summary, cfg)
    _print_safely(json_text(out, indent=2) if args.json else format_summary(out))
    return 130 if summary.get("interrupted") else 0


def run_summary(summary: dict[str, Any], cfg: Any) -> dict[str, Any]:
    """The end-of-run facts a person (or ``--json``) reads."""
    out: dict[str, Any] = {k: summary[k] for k in ("steps", "wall_s", "samples", "samples_per_s",
                                                   "trainer_idle_frac", "interrupted") if k in summary}
    run_dir = Path(cfg.observe.run_dir)
    out["run_dir"] = str(run_dir)
    if "eval" in summary:
        ev, k = summary["eval"], summary["eval"].get("k", 1)
        key = f"pass@{k}"
        out["eval"] = {"metric": key, "n_tasks": ev.get("n_tasks"), "n": ev.get("n"),
                       "base": (ev.get("base") or {}).get(key), "final": (ev.get("final") or {}).get(key),
                       "gain": ev.get("gain")}
    elif "eval_skipped" in summary:
        out["eval"] = {"skipped": summary["eval_skipped"]}
    out["next"] = hints(run_dir, bool(summary.get("interrupted")))
    return out


def format_summary(out: dict[str, Any]) -> str:
    lines = [f"done: {out.get('steps', 0)} updates in {_dur(out.get('wall_s', 0.0))}, "
             f"{out.get('samples_per_s', 0.0):.1f} samples/s"
             + ("  (interrupted: checkpoint saved; continue with --resume)" if out.get("interrupted") else "")]
    ev = out.get("eval")
    if ev and "skipped" in ev:
        lines.append(f"held-out: skipped ({ev['skipped']})")
    elif ev:
        base, final = ev.get("base"), ev.get("final")
        b = f"{base:.3f} -> " if isinstance(base, float) else ""
        gain = f"  ({ev['gain']:+.3f})" if isinstance(ev.get("gain"), float) else ""
        f = f"{final:.3f}" if isinstance(final, float) else "-"
        lines.append(f"held-out {ev['metric']}: {b}{f}{gain}  on {ev.get('n_tasks')} tasks x {ev.get('n')} samples")
    lines.append(f"run directory: {out['run_dir']}")
    lines.append("next: " + "   ".join(out["next"]))
    return "\n".join(lines)


def _dur(s: float) -> str:
    return f"{int(s // 60)} min {s % 60:.0f} s" if s >= 60 else f"{s:.1f} s"
