"""The ``mixrl`` command line.

Each sub-command lives in its own module exposing ``configure(parser)`` and
``main(args) -> int``. The module is imported only when its command runs, so
``mixrl --help`` and config validation never import torch or Ray.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys

from mixrl.config import ConfigError
from mixrl.system.quiet import install_filters

# command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("mixrl.commands.train", "run RL training (no arguments: the bundled demo)"),
    "eval": ("mixrl.commands.eval", "pass@k of a checkpoint on the held-out split (a run's own data with --config)"),
    "pretrain": ("mixrl.lab.pretrain", "build and warm-start the bundled small policy"),
    "export": ("mixrl.train.export", "a run's checkpoint as a Hugging Face model directory"),
    "probe": ("mixrl.rollout.probe", "measure sampler-trainer mismatch of precision profiles"),
    "bench": ("mixrl.lab.bench.cli", "benchmarks: loss, sampler, e2e (JSON with --json)"),
    "compare": ("mixrl.lab.study.compare", "run the correction arms on mixed and homogeneous fleets"),
    "serve": ("mixrl.commands.serve", "an OpenAI-compatible server on a sampler fleet (localhost; API key when exposed)"),
    "report": ("mixrl.lab.study.report", "HTML + Markdown report of a run or compare directory"),
}


def version() -> str:
    """The installed distribution's version (a source tree that is not installed: "unknown")."""
    try:
        return importlib.metadata.version("mixrl")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    install_filters()
    argv = list(sys.argv[1:] if argv is None else argv)
    top = argparse.ArgumentParser(prog="mixrl", description=__doc__.splitlines()[0])
    top.add_argument("-V", "--version", action="store_true", help="print mixrl's version and exit")
    sub = top.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_) in COMMANDS.items():
        sub.add_parser(name, help=help_, add_help=False)
    if argv[:1] in (["--version"], ["-V"]):
        print(f"mixrl {version()}")
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        top.parse_args(argv)  # prints help or a clean "invalid choice" error
        top.print_help()
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    name, rest = argv[0], argv[1:]
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"mixrl {name}", description=COMMANDS[name][1])
    module.configure(parser)
    args = parser.parse_args(rest)

    try:
        return int(module.main(args) or 0)
    except ConfigError as e:  # bad user input found late (e.g. a Ray token): one line, status 2
        print(f"mixrl {name}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
