"""``mixrl bench {loss,sampler,e2e}``: dispatch to one benchmark module.

Each benchmark is a module exposing ``configure(parser)`` and ``main(args) -> int``
(the same convention as the top-level commands). Only the chosen module is
imported, so ``mixrl bench --help`` stays light and a benchmark that is not part
of this build is reported by name instead of failing on import of the others.

``--save FILE`` (before the benchmark's name) also writes the benchmark's JSON
with the command line and the machine's facts (CPU model and flags, cores,
load, versions: ``mixrl.lab.bench.machine``), the artifact the README's tables are
made from (``scripts/readme_tables.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import sys
from pathlib import Path

from mixrl.system.files import atomic_write_json

# benchmark -> (module, one-line help)
BENCHES: dict[str, tuple[str, str]] = {
    "loss": ("mixrl.lab.bench.loss", "chunked vs full-logits log-probs; GRPO vs SC+MIS+top-p loss step"),
    "sampler": ("mixrl.lab.bench.sampler", "sampler throughput per precision profile and engine"),
    "e2e": ("mixrl.lab.bench.e2e", "end-to-end training throughput of a short run"),
    "serve": ("mixrl.lab.bench.serve", "OpenAI-compatible endpoint vs the sampler called directly, same load"),
    "sandbox": ("mixrl.lab.bench.sandbox", "sandbox start-up latency and concurrent episodes"),
    "trainer": ("mixrl.lab.bench.trainer", "trainer peak memory vs batch size at a token budget; packed vs padded tokens/s"),
    "moe": ("mixrl.lab.bench.moe", "MoE routing mismatch and the KL with and without routing replay"),
}


def configure(parser: argparse.ArgumentParser) -> None:
    lines = [f"  {name:8s} {help_}" for name, (_, help_) in BENCHES.items()]
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = "benchmarks:\n" + "\n".join(lines) + "\n\n'mixrl bench NAME --help' lists its options."
    parser.add_argument("--save", metavar="FILE", default=None,
                        help="also write the JSON result with the machine's facts to FILE")
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
    bench_args = parser.parse_args(args.rest)
    if not args.save:
        return int(module.main(bench_args) or 0)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = int(module.main(bench_args) or 0)
    text = out.getvalue()
    sys.stdout.write(text)
    _save(Path(args.save), args.bench, args.rest, text)
    return rc


def _save(path: Path, bench: str, rest: list[str], text: str) -> None:
    """Write the last JSON object the benchmark printed, with its command and machine."""
    from mixrl.lab.bench.machine import facts

    start = text.rfind("\n{") + 1 if not text.lstrip().startswith("{") else text.find("{")
    try:
        result = json.loads(text[start:])
    except json.JSONDecodeError:
        print("mixrl bench: --save needs the benchmark's --json output (got no JSON object)",
              file=sys.stderr)
        return
    record = {"command": " ".join(["mixrl", "bench", bench, *rest]), "machine": facts(),
              "result": result}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, record, indent=2, default=float)
