"""``mixrl bench {loss,sampler,e2e}``: dispatch to one benchmark module.

Each benchmark is a module exposing ``configure(parser)`` and ``main(args) -> int``
(the same convention as the top-level commands). Only the chosen module is
imported, so ``mixrl bench --help`` stays light and a benchmark that is not part
of this build is reported by name instead of failing on import of the others.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# benchmark -> (module, one-line help)
BENCHES: dict[str, tuple[str, str]] = {
    "loss": ("mixrl.bench.loss", "chunked vs full-logits log-probs; GRPO vs SC+MIS+top-p loss step"),
    "sampler": ("mixrl.bench.sampler", "sampler throughput per precision profile and engine"),
    "e2e": ("mixrl.bench.e2e", "end-to-end training throughput of a short run"),
    "sandbox": ("mixrl.bench.sandbox", "sandbox start-up latency and concurrent episodes"),
}


def configure(parser: argparse.ArgumentParser) -> None:
    lines = [f"  {name:8s} {help_}" for name, (_, help_) in BENCHES.items()]
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = "benchmarks:\n" + "\n".join(lines) + "\n\n'mixrl bench NAME --help' lists its options."
    parser.add_argument("bench", nargs="?", choices=list(BENCHES), metavar="BENCH", help="which benchmark")
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="options of that benchmark")


def main(args: argparse.Namespace) -> int:
    if args.bench is None:
        names = ", ".join(BENCHES)
        print(f"mixrl bench: choose a benchmark ({names}); 'mixrl bench --help' describes them",
              file=sys.stderr)
        return 2
    module_name, help_ = BENCHES[args.bench]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:  # a dependency of the benchmark is missing: say which
            raise
        print(f"mixrl bench {args.bench}: the benchmark module {module_name} is not part of this "
              "installation", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog=f"mixrl bench {args.bench}", description=help_)
    module.configure(parser)
    return int(module.main(parser.parse_args(args.rest)) or 0)
