"""``mixrl eval CHECKPOINT [--config RUN.toml] --k 4``: pass@k, on a run's own data when it has one.

Without a config this is ``mixrl.rollout.evaluate`` unchanged (a bundled task
family, ``--task``). With one, the held-out split and the environment come
from it: ``--config`` names a run config (``mixrl eval bundled --config
examples/arithmetic/config.toml`` scores the base policy on that data), and
a checkpoint inside a run directory (``RUN_DIR/policy``) uses
``RUN_DIR/config.toml`` by itself. Turn and token limits then follow the
run's ``rollout`` and ``env.options``, as the run's own final evaluation does.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from mixrl.config import ConfigError, load_config, resolve_paths
from mixrl.data import DataError
from mixrl.envs.registry import activate
from mixrl.envs.rewards import RewardError
from mixrl.records.run_dir import RunDir
from mixrl.system.jsonout import json_text
from mixrl.system.quiet import silence_libraries


def configure(parser: argparse.ArgumentParser) -> None:
    from mixrl.rollout.evaluate import configure as base_configure

    base_configure(parser)
    parser.add_argument("--config", default=None, help="a run config whose data, environment and reward to use "
                        "(default: CHECKPOINT/../config.toml when CHECKPOINT is a run's policy)")


def _run_config(args: argparse.Namespace) -> Path | None:
    if args.config is not None:
        return Path(args.config)
    guess = RunDir(Path(args.checkpoint).resolve().parent).config
    return guess if args.checkpoint != "bundled" and guess.exists() else None


def main(args: argparse.Namespace) -> int:

    silence_libraries()
    from mixrl.rollout import evaluate as ev

    path = _run_config(args)
    if path is None:
        return int(ev.main(args) or 0)

    try:
        cfg = load_config(path)
        resolve_paths(cfg, path.resolve().parent)
        active = activate(cfg)
        from mixrl.envs.registry import make_task_source

        n_avail = len(make_task_source(cfg.env.name, "heldout", args.seed, active=active))
        res = ev.evaluate(args.checkpoint, args.k, args.n, min(args.tasks or n_avail, n_avail), args.seed,
                          task=cfg.env.name, precision=args.precision, profile=args.profile,
                          temperature=cfg.rollout.temperature, top_p=args.top_p, max_new_tokens=cfg.rollout.max_new_tokens,
                          max_total_tokens=cfg.rollout.max_total_tokens, env_options=dict(cfg.env.options),
                          num_threads=args.threads, active=active)
    except (ConfigError, DataError, RewardError, ValueError, FileNotFoundError) as e:
        print(f"mixrl eval: {'; '.join(str(e).splitlines())}", file=sys.stderr)
        return 2
    res["config"] = str(path)
    if args.json:
        print(json_text(res))
        return 0
    print(_table(res))
    return 0


def _table(res: dict[str, Any]) -> str:
    k = res["k"]
    pk = (f"{f'pass@{k}':>9}", f"{res[f'pass@{k}']:>9.3f}") if k != 1 else ("", "")
    lines = [f"{res['model']}  on {res['config']} (held-out)  profile {res['profile']}  n={res['n']}  "
             f"{res['wall_s']:.1f}s",
             f"{'tasks':>7}{'pass@1':>9}{pk[0]}{'reward':>9}{'turns':>7}  status",
             f"{res['n_tasks']:>7}{res['pass@1']:>9.3f}{pk[1]}"
             f"{res['mean_reward']:>9.3f}{res['mean_turns']:>7.2f}  {res['status']}"]
    return "\n".join(lines)
