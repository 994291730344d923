"""Running a study in pieces: execute, record, project.

``execute`` runs the planned runs ``jobs`` at a time (seed-major), each as
``mixrl train`` in its own process; a finished run is skipped, an interrupted
one continues from its last checkpoint (``mixrl train --resume``). When a run
ends, its checkpoints are scored under the common FP32 sampler and its data file
is written (``lab/study/studydata.py``). ``--stop-after MIN`` launches no run after
MIN minutes, so a sitting ends between runs; SIGTERM (``kill PID``) or Ctrl-C ends
it now: no run starts and the runs in flight save a checkpoint and stop.

``projection`` says what the remaining runs will cost before any starts: the
seconds per update and the fixed cost of a run (start-up, evaluations, FP32
scoring) of each ``<fleet>/<arm>`` measured from runs already in OUT (data files,
or the metrics of an interrupted run), else from a calibration (``--calibrate N``:
seed 0 of each cell for N updates, at the same parallelism, under
``OUT/calibration``) scaled by the median ratio of finished runs to their own
calibration, since a calibration is short and may have met another load. A run's projected time is ``fixed + steps x seconds per
update``; the wall time is their sum over ``jobs``.
"""

from __future__ import annotations

import json
import math
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mixrl.lab.study import studydata
from mixrl.lab.study.runs import load_run
from mixrl.records.run_dir import RunDir


def finished(run_dir: Path) -> bool:
    """A run is finished when ``mixrl train`` wrote its summary and was not interrupted."""
    f = RunDir(run_dir).summary
    try:
        return f.exists() and not json.loads(f.read_text()).get("interrupted", True)
    except json.JSONDecodeError:
        return False


def side_file(run_dir: Path, kind: str, suffix: str) -> Path:
    """``OUT/<kind>/<fleet>/<arm>/seed<s><suffix>``: configs and logs live beside the run
    directories (``mixrl train`` wants its run directory to itself)."""
    seed_dir = Path(run_dir)
    out = seed_dir.parent.parent.parent
    f = out / kind / seed_dir.parent.parent.name / seed_dir.parent.name / (seed_dir.name + suffix)
    f.parent.mkdir(parents=True, exist_ok=True)
    return f


def train(run_dir: Path, threads: int, config: Path | None = None) -> int:
    """``mixrl train`` for one run: resumed from its last checkpoint when it has one."""
    from mixrl.train.checkpoint import list_checkpoints

    cmd = [sys.executable, "-m", "mixrl.commands.main", "train"]
    if list_checkpoints(run_dir):
        cmd += ["--resume", str(run_dir)]
    else:  # nothing to resume: start (again) from the written config
        cmd += [str(config or side_file(run_dir, "configs", ".toml")), "--overwrite"]
    cmd += ["--set", f"runtime.torch_threads={threads}"]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    with open(side_file(run_dir, "logs", ".log"), "a") as log:
        with _LOCK:
            if STOP.is_set():
                return INTERRUPTED
            p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            _RUNNING.add(p)
        try:
            return p.wait()
        finally:
            with _LOCK:
                _RUNNING.discard(p)


# Stopping a study cleanly: SIGTERM or SIGINT while ``execute`` runs sets STOP (no run starts);
# SIGTERM also passes SIGINT to the runs in flight (Ctrl-C reaches them from the terminal),
# which save a checkpoint and exit with INTERRUPTED.
STOP = threading.Event()
INTERRUPTED = 130
_RUNNING: set[subprocess.Popen] = set()
_LOCK = threading.Lock()


def _on_signal(signum: int, _frame: Any) -> None:
    STOP.set()
    if signum == signal.SIGTERM:
        for p in list(_RUNNING):
            p.send_signal(signal.SIGINT)


def _handlers(install: bool, old: dict[int, Any]) -> dict[int, Any]:
    if threading.current_thread() is not threading.main_thread():
        return {}
    if install:
        return {sig: signal.signal(sig, _on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig, h in old.items():
        signal.signal(sig, h)
    return {}


def run_one(out: Path, run_dir: Path, threads: int, fp32: dict[str, Any], base: bool) -> tuple[int, float]:
    """Train (unless finished), score under FP32 and write the data file; (exit code, seconds),
    seconds -1 for a run already done."""
    t0, rc = time.time(), 0
    data = studydata.data_file(out, run_dir)
    if data.exists() and finished(run_dir):
        return 0, -1.0  # already done
    if not finished(run_dir):
        rc = train(run_dir, threads)
    if rc == 0:
        scores = (studydata.score_checkpoints(run_dir, int(fp32["n_tasks"]), int(fp32["n"]), int(fp32["seed"]),
                                              base, threads) if fp32.get("enabled", True) else {})
        studydata.export(out, run_dir, scores, wall_s=time.time() - t0)
    return rc, time.time() - t0


def execute(out: Path, runs: list[Path], jobs: int, fp32: dict[str, Any],
            stop_after_min: float | None = None) -> list[Path]:
    """Run ``runs`` (seed-major order kept); returns those that failed."""
    jobs = max(1, min(jobs, len(runs) or 1))
    threads = max(1, (os.cpu_count() or 1) // jobs)
    t0, failed = time.time(), []

    def one(i: int) -> tuple[Path, int, float, bool]:
        r = runs[i]
        if STOP.is_set() or (stop_after_min is not None and time.time() - t0 > 60 * stop_after_min):
            return r, 0, 0.0, False
        rc, dt = run_one(out, r, threads, fp32, base=(i == 0))
        return r, rc, dt, True

    STOP.clear()
    old = _handlers(True, {})
    try:
        with ThreadPoolExecutor(jobs) as pool:
            for r, rc, dt, started in pool.map(one, range(len(runs))):
                if not started:
                    why = "stopped" if STOP.is_set() else "--stop-after"
                    print(f"  {r}: not started ({why}); continue with --resume", flush=True)
                    continue
                if dt < 0:
                    print(f"  {r}: already done", flush=True)
                    continue
                if rc == INTERRUPTED and STOP.is_set():
                    print(f"  {r}: interrupted after {dt:.0f} s, checkpoint saved; continue with --resume",
                          flush=True)
                    continue
                status = "ok" if rc == 0 else f"FAILED (exit {rc}, see {side_file(r, 'logs', '.log')})"
                print(f"  {r}: {status} in {dt:.0f} s", flush=True)
                if rc != 0:
                    failed.append(r)
    finally:
        _handlers(False, old)
    print(f"compare wall time: {time.time() - t0:.0f} s (load average {os.getloadavg()[0]:.1f})")
    return failed


def kind(out: Path, run_dir: Path) -> str:
    """``<fleet>/<arm>``: runs of one kind cost the same per update."""
    rel = Path(run_dir).relative_to(out)
    return "/".join(rel.parts[:2])


def measured(out: Path) -> dict[str, dict[str, float]]:
    """Per kind: median seconds per update and fixed seconds per run, from OUT's data files,
    else interrupted runs' metrics, else ``OUT/calibration`` runs scaled by the median ratio of
    the study's finished runs to their calibration (1 before any finishes)."""
    found: dict[str, dict[str, list[float]]] = {}
    calib: dict[str, dict[str, list[float]]] = {}
    for root, src, into in ((out, "runs", found), (out / "calibration", "calibration", calib)):
        data_root = root / "data"
        for f in sorted(data_root.glob("**/seed*.json")) if data_root.is_dir() else []:
            d = json.loads(f.read_text())["run"]
            k = "/".join(Path(d["name"]).parts[:2])
            e = into.setdefault(k, {"update_s": [], "fixed_s": [], "src": []})  # type: ignore[dict-item]
            if d.get("update_s") is not None and math.isfinite(d["update_s"]):
                e["update_s"].append(d["update_s"])
                if d.get("wall_s") is not None:
                    e["fixed_s"].append(max(0.0, d["wall_s"] - d["steps"] * d["update_s"]))
                e["src"].append(src)  # type: ignore[arg-type]
    for m in sorted(out.glob("*/*/seed*/metrics.jsonl")):
        k = kind(out, m.parent)
        if k in found:
            continue
        s = studydata.update_seconds(load_run(m.parent).rows)
        if math.isfinite(s):
            found[k] = {"update_s": [s], "fixed_s": [], "src": ["partial run"]}  # type: ignore[dict-item]

    def med(v: dict[str, list[float]]) -> dict[str, Any]:
        return {"update_s": statistics.median(v["update_s"]),
                "fixed_s": statistics.median(v["fixed_s"]) if v["fixed_s"] else math.nan, "source": v["src"][0]}

    res = {k: med(v) for k, v in found.items() if v["update_s"]}
    cal = {k: med(v) for k, v in calib.items() if v["update_s"]}
    # a calibration is short and may have met another load: scale it by what the study's own runs
    # took against their calibration (median ratio over the kinds measured both ways)
    both = [k for k in cal if k in res and res[k]["source"] == "runs"]
    f_u = statistics.median(res[k]["update_s"] / cal[k]["update_s"] for k in both) if both else 1.0
    fx = [res[k]["fixed_s"] / cal[k]["fixed_s"] for k in both
          if math.isfinite(res[k]["fixed_s"]) and cal[k]["fixed_s"] > 0]
    f_x = statistics.median(fx) if fx else f_u
    for k, m in cal.items():
        if k not in res:
            res[k] = {"update_s": m["update_s"] * f_u, "fixed_s": m["fixed_s"] * f_x,
                      "source": "calibration" if not both else
                      f"calibration x {f_u:.2f} (s/update) and x {f_x:.2f} (fixed): runs / calibration, "
                      f"{len(both)} kind(s)"}
    return res


def projection(out: Path, runs: list[Path], steps: int, jobs: int) -> dict[str, Any]:
    """Projected seconds of each remaining run and the study's wall time (module docstring)."""
    from mixrl.train.checkpoint import list_checkpoints

    meas = measured(out)
    fixed_all = [v["fixed_s"] for v in meas.values() if math.isfinite(v["fixed_s"])]
    fixed_default = statistics.median(fixed_all) if fixed_all else math.nan
    slowest = max((v["update_s"] for v in meas.values()), default=math.nan)
    rows, total = [], 0.0
    for r in runs:
        k = kind(out, r)
        if finished(r) and studydata.data_file(out, r).exists():
            rows.append({"run": str(r.relative_to(out)), "status": "done", "projected_s": 0.0})
            continue
        ck = list_checkpoints(r)
        left = steps - (int(ck[-1].name.split("_")[-1]) if ck else 0)
        m = meas.get(k)
        per = m["update_s"] if m else slowest
        fixed = m["fixed_s"] if m and math.isfinite(m["fixed_s"]) else fixed_default
        sec = left * per + (fixed if math.isfinite(fixed) else 0.0)
        total += sec if math.isfinite(sec) else 0.0
        rows.append({"run": str(r.relative_to(out)), "status": "resume" if ck else "todo", "updates": left,
                     "update_s": per, "fixed_s": fixed, "projected_s": sec,
                     "measured": (m or {}).get("source", "assumed: slowest measured kind")})
    return {"runs": rows, "measured": meas, "jobs": jobs, "total_run_s": total,
            "wall_s": total / max(1, jobs), "unmeasured": not meas}
