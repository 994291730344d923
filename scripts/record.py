#!/usr/bin/env python
"""Run one mixrl command that prints JSON and keep its result as a README artifact.

    .venv/bin/python scripts/record.py docs/artifacts/eval_base.json -- mixrl eval bundled --k 4 --json

The artifact holds the command line, the machine's facts (CPU model and flags,
cores, load average, library versions) and the command's JSON result, so every
figure the README quotes can be traced to how and where it was measured.
``scripts/readme_tables.py`` renders the README's tables from these files.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    out, cmd = Path(argv[0]), argv[2:]
    if cmd[0] == "mixrl":  # the project's own entry point, from this interpreter's environment
        exe = Path(sys.executable).with_name("mixrl")
        cmd = [str(exe) if exe.exists() else shutil.which("mixrl") or "mixrl", *cmd[1:]]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    sys.stdout.write(proc.stdout)
    if proc.returncode != 0:
        print(f"record: the command exited with {proc.returncode}; nothing written", file=sys.stderr)
        return proc.returncode
    text = proc.stdout
    start = text.find("{") if text.lstrip().startswith("{") else text.rfind("\n{") + 1
    result = json.loads(text[start:])

    from mixrl.lab.bench.machine import facts

    record = {"command": " ".join(argv[2:]), "machine": facts(), "result": result}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2, default=float) + "\n")
    tmp.replace(out)
    print(f"record: wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
