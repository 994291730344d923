#!/usr/bin/env python
"""Time the README's first command, `make run`, on a fresh clone and keep the split as an artifact.

    python3 scripts/time_make_run.py docs/artifacts/make_run.json

Clones this repository's HEAD into a temporary directory, then runs and times the
two steps `make run` is made of: creating the environment (`scripts/bootstrap.sh`)
and `mixrl train` on the bundled demo. The artifact holds both times, the total,
the lines the run printed and the machine's facts at the start (load included),
so the figure can be judged: pip's download cache is whatever this machine holds,
and the artifact says so rather than pretending to a cold download.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _timed(cmd: list[str], cwd: Path) -> tuple[float, str]:
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    took = time.monotonic() - start
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:])
        raise SystemExit(f"time_make_run: {' '.join(cmd)} exited with {proc.returncode}")
    return took, proc.stdout


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    out = Path(argv[0]).resolve()
    sys.path.insert(0, str(ROOT / "src"))
    from mixrl.lab.bench.machine import facts  # stdlib only: no environment needed yet

    machine = facts()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="mixrl-make-run-") as tmp:
        clone = Path(tmp) / "mixrl"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        env_s, _ = _timed(["scripts/bootstrap.sh"], clone)
        train_s, printed = _timed([".venv/bin/mixrl", "train"], clone)
    lines = [ln.rstrip() for ln in printed.replace("\r", "\n").splitlines() if ln.strip()]
    record = {
        "command": "make run (fresh clone: scripts/bootstrap.sh, then .venv/bin/mixrl train)",
        "machine": machine,
        "result": {
            "commit": head,
            "environment_s": round(env_s, 1),
            "train_s": round(train_s, 1),
            "total_s": round(env_s + train_s, 1),
            "total_min": round((env_s + train_s) / 60, 2),
            "load_avg_1m_end": round(os.getloadavg()[0], 2),
            "pip_cache": "this machine's pip cache as found (not cleared)",
            "printed": [ln for ln in lines if not ln.startswith("train ")][-6:],
        },
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record["result"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
