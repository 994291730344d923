"""``mixrl train [CONFIG.toml] [--set key.path=value ...] [--dry-run] [--resume RUN_DIR] [--backend ray]``.

No config file: the bundled demo (``mixrl/configs/demo.toml``). The config is
parsed and validated before torch or Ray are imported; an invalid config exits
with status 2 and names the field. ``--resume RUN_DIR`` continues the run in
RUN_DIR from its newest checkpoint with the config saved there (``--set`` may
still change e.g. ``runtime.steps``). Ctrl-C saves a checkpoint and exits with
status 130.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", default=None, help="TOML config (default: the bundled demo)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one field, e.g. --set rollout.group_size=4 (repeatable)")
    parser.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--resume", metavar="RUN_DIR", default=None, help="continue the run in RUN_DIR")
    parser.add_argument("--backend", choices=("inprocess", "ray"), default=None, help="override runtime.backend")
    parser.add_argument("--no-eval", action="store_true", help="skip the final held-out evaluation")


def main(args: argparse.Namespace) -> int:
    from mixrl.config.run import ConfigError, load_config, to_toml

    overrides = list(args.overrides)
    if args.backend:
        overrides.append(f'runtime.backend="{args.backend}"')
    path = args.config
    if args.resume:
        saved = Path(args.resume) / "config.toml"
        if path is None:
            path = saved
        overrides.append(f'observe.run_dir="{Path(args.resume).as_posix()}"')
    try:
        cfg = load_config(path, overrides)
    except ConfigError as e:
        print(f"invalid config:\n{e}", file=sys.stderr)
        return 2
    try:  # the preset and profiles are pure config too: check them before anything heavy
        from mixrl.runtime.run import group_profiles, resolve_loss

        loss_cfg, derived = resolve_loss(cfg)
        group_profiles(cfg)
    except ConfigError as e:
        print(f"invalid config:\n{e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(to_toml(cfg))
        print("\n# derived (not settable)")
        print(f"# {json.dumps(derived.__dict__)}")
        print(f"# loss = {loss_cfg.model_dump_json()}")
        return 0
    from mixrl.runtime.run import train

    try:
        summary = train(cfg, resume=bool(args.resume), evaluate=False if args.no_eval else None)
    except KeyboardInterrupt:
        return 130
    out: dict[str, Any] = {k: summary[k] for k in ("steps", "wall_s", "samples_per_s", "trainer_idle_frac") if k in summary}
    if "eval" in summary:
        out["eval"] = summary["eval"]
    print(json.dumps(out, indent=2, default=float))
    print(f"run directory: {cfg.observe.run_dir}")
    return 130 if summary.get("interrupted") else 0
