"""The study's committed data: one small JSON file per run, enough to recompute every interval.

``OUT/data/<fleet>/<arm>/seed<s>.json`` (written by ``mixrl compare`` when a run
finishes; ~20-60 KB for 150 updates) holds:

- ``eval``: ``k`` and the per-task ``(n, c)`` of the final policy (``final``) and,
  in the study's first run, of the starting policy (``base``): pass@k of every
  task, every seed, so any paired interval can be recomputed;
- ``steps``: per-step metrics, columnar (``{"step": [...], key: [...]}``, None
  where a step has no value), 4 significant digits: the keys of ``STEP_KEYS`` and
  every per-group ``precision/*``, ``lag/*`` and ``share/*`` metric;
- ``fp32``: the policy at each surviving checkpoint (and the base policy, in the
  first run) scored by one common FP32 sampler (``mixrl eval --profile fp32``) on
  fixed held-out tasks and sampling seeds: ``{step: {"mean_reward", "per_task"}}``,
  so arms whose samplers differ are compared on equal footing;
- ``run``: mode, preset, seed, model, steps, wall time, median seconds per update.

``load`` turns the files back into ``Run`` objects, so the study's judgement runs
on the committed data alone (``mixrl compare --recompute OUT``).
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from mixrl.lab.study.runs import Run, load_run
from mixrl.records import keys as K
from mixrl.records.run_dir import RunDir
from mixrl.system.files import atomic_write_json

STEP_KEYS = (K.REWARD, K.LENGTH, K.FORMAT_END, K.EMPTY_END, K.STALENESS, K.STALENESS_MAX, K.GRAD_NORM,
             K.ENTROPY, K.split(K.MISMATCH, K.KL_K3), K.split(K.MISMATCH, K.KL_EXACT),
             K.split(K.MISMATCH, K.RATIO_OOB), K.COST, K.TIME, K.CLIPPED)
GROUP_PREFIXES = (K.PRECISION + "/", K.LAG + "/", K.SHARE + "/")


def _round(v: Any) -> Any:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    if not math.isfinite(v):
        return None
    return float(f"{v:.4g}")


def step_columns(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    keys = [k for k in STEP_KEYS if any(k in r for r in rows)]
    keys += sorted({k for r in rows for k in r if k.startswith(GROUP_PREFIXES)})
    cols: dict[str, list[Any]] = {"step": [int(r.get("step", i + 1)) for i, r in enumerate(rows)]}
    for k in keys:
        cols[k] = [_round(r.get(k)) for r in rows]
    if K.TIME in cols:  # seconds since the run's start, 0.1 s is enough
        t0 = next((t for t in cols[K.TIME] if t is not None), 0.0)
        cols[K.TIME] = [None if t is None else round(t - t0, 1) for t in cols[K.TIME]]
    return cols


def update_seconds(rows: list[dict[str, Any]]) -> float:
    """Median wall seconds between consecutive updates (NaN under 3 steps)."""
    ts = [float(r[K.TIME]) for r in rows if isinstance(r.get(K.TIME), int | float)]
    gaps = [b - a for a, b in zip(ts, ts[1:], strict=False) if b >= a]
    return statistics.median(gaps) if len(gaps) >= 2 else math.nan


def data_file(out: Path, run_dir: Path) -> Path:
    rel = Path(run_dir).relative_to(out)
    return out / "data" / rel.parent / (rel.name + ".json")


def fp32_score(policy: str | Path, run_dir: Path, n_tasks: int, n: int, seed: int,
               threads: int = 1, top_p: float = 1.0) -> dict[str, Any]:
    """``mixrl eval POLICY --config RUN/config.toml --profile fp32 [--top-p P]`` in its own process."""
    cmd = [sys.executable, "-m", "mixrl.commands.main", "eval", str(policy), "--config", str(RunDir(run_dir).config),
           "--profile", "fp32", "--tasks", str(n_tasks), "--n", str(n), "--k", "1", "--seed", str(seed),
           "--threads", str(threads), "--top-p", str(top_p), "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        return {"error": (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]}
    res = json.loads(p.stdout.strip().splitlines()[-1])
    return {"mean_reward": res["mean_reward"], "pass@1": res["pass@1"], "per_task": res.get("per_task", {}),
            "profile": res["profile"]}


def score_checkpoints(run_dir: Path, n_tasks: int, n: int, seed: int, base: bool,
                      threads: int = 1) -> dict[str, Any]:
    """FP32 scores of the run's surviving checkpoints (and of the base policy when ``base``)."""
    from mixrl.train.checkpoint import list_checkpoints

    out: dict[str, Any] = {}
    if base:
        cfg = json.loads((run_dir / "config.json").read_text()) if (run_dir / "config.json").exists() else {}
        model = cfg.get("model", {}).get("path") or _toml_model(run_dir)
        out["0"] = fp32_score(model, run_dir, n_tasks, n, seed, threads)
    for ck in list_checkpoints(run_dir):
        if (ck / "hf").is_dir():
            out[str(int(ck.name.split("_")[-1]))] = fp32_score(ck / "hf", run_dir, n_tasks, n, seed, threads)
    return out


def _toml_model(run_dir: Path) -> str:
    import tomllib

    return str(tomllib.loads(RunDir(run_dir).config.read_text()).get("model", {}).get("path", "bundled"))


def export(out: Path, run_dir: Path, fp32: dict[str, Any] | None = None, wall_s: float = math.nan) -> Path:
    """Write the run's data file (module docstring); returns its path."""
    run = load_run(run_dir)
    ev = json.loads(RunDir(run_dir).eval.read_text()) if RunDir(run_dir).eval.exists() else {}
    final, base = ev.get("final", ev), ev.get("base") or {}
    cfg = run.config
    rt = cfg.get("runtime", {})
    data = {
        "run": {"name": str(Path(run_dir).relative_to(out)), "mode": rt.get("mode"),
                "preset": cfg.get("loss", {}).get("preset"), "seed": rt.get("seed"),
                "model": cfg.get("model", {}).get("path"), "steps": len(run.rows),
                "wall_s": _round(wall_s), "update_s": _round(update_seconds(run.rows))},
        "eval": {"k": ev.get("k", final.get("k")), "final": final.get("per_task") or {},
                 "base": base.get("per_task") or {}},
        "steps": step_columns(run.rows),
        "fp32": fp32 or {},
    }
    f = data_file(out, run_dir)
    f.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(f, data, separators=(",", ":"))  # a reader sees the old file or the new one
    return f


def to_run(data: dict[str, Any]) -> Run:
    cols = data["steps"]
    n = len(cols.get("step", []))
    rows = [{k: v[i] for k, v in cols.items() if v[i] is not None} for i in range(n)]
    ev = data["eval"]
    k = ev.get("k") or 4
    run = Run(path=Path(data["run"]["name"]), name=data["run"]["name"], rows=rows)
    run.eval = {"per_task": ev.get("final") or {}, "k": k, **passk_means(ev.get("final") or {}, k)}
    run.base = {"per_task": ev["base"]} if ev.get("base") else {}
    run.config = {"runtime": {"mode": data["run"].get("mode")}, "loss": {"preset": data["run"].get("preset")},
                  "fp32": data.get("fp32") or {}}
    return run


def passk_means(per_task: dict[str, Any], k: int) -> dict[str, float]:
    """``pass@1`` and ``pass@k``: the unbiased estimator per task ``(n, c)``, mean over tasks."""
    from mixrl.rollout.passk import pass_at_k

    if not per_task:
        return {}
    return {f"pass@{j}": statistics.fmean(pass_at_k(int(n), int(c), j) for n, c in per_task.values())
            for j in sorted({1, int(k)})}


def load(out: Path) -> list[Run]:
    """Every ``OUT/data/**/seed*.json`` as a Run, sorted by name."""
    files = sorted(Path(out, "data").glob("**/seed*.json"))
    return [to_run(json.loads(f.read_text())) for f in files]
