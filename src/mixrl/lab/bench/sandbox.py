"""Sandbox latency and concurrency: ``python -m mixrl.lab.bench.sandbox [--json]``.

Measures, on a bundled task's repository:

- ``plain``: a plain subprocess (``bash -c true``), the floor;
- ``episode``: ``Sandbox.create`` + ``run("true")`` + ``close`` (the episode's
  cgroup, its size- and inode-limited tmpfs with two copies of the repository,
  one ``bwrap`` under the seccomp filter, cleanup by cgroup kill and unmount) —
  the goal is a median of at most 50 ms; ``bounds`` says which kernel limits
  were in place;
- ``run``: one more ``run("true")`` in an existing sandbox;
- ``concurrent``: N episodes at once (create, write a file of its own, list
  the work dir, diff, close); ``isolated`` is true iff every episode saw
  exactly its own file and its diff held only its own edit;
- ``grade`` (unless ``--no-grade``): the grading overhead per episode, the reference
  patch graded ``--grade-repeats`` times per arm, arms alternating within each round:
  ``oracle`` (the bundled form: values judged outside the sandbox), ``pytest`` (the
  pytest form: restore, canaries, runner) and, with ``--grade-baseline REV``, ``baseline``
  (the grader of git revision REV, loaded from the repository beside the current one);
  ``*_ratio`` are medians over the baseline's.
- ``pool``: admissions that waited for memory budget (``mixrl.envs.sandbox.pool``).

Medians and 90th percentiles over ``--repeats`` rounds, in milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from mixrl.system.jsonout import json_text

GOAL_MS = 50.0


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=40, help="timed rounds per measurement (>= 3)")
    parser.add_argument("--concurrency", type=int, default=32, help="episodes run at once (>= 1)")
    parser.add_argument("--task", default="textkit-truncate", help="bundled instance whose repository is used")
    parser.add_argument("--root", default=None,
                        help="directory for the episodes' private copies (default: the system temp dir)")
    parser.add_argument("--no-grade", action="store_true", help="skip the grading measurement")
    parser.add_argument("--grade-repeats", type=int, default=15, help="gradings per arm (>= 3)")
    parser.add_argument("--grade-baseline", default=None, metavar="REV",
                        help="also time the grader of this git revision (needs a git checkout)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _stats(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {"median_ms": round(statistics.median(s) * 1e3, 2), "p90_ms": round(s[int(0.9 * (len(s) - 1))] * 1e3, 2),
            "min_ms": round(s[0] * 1e3, 2)}


async def _plain() -> float:
    t = time.perf_counter()
    p = await asyncio.create_subprocess_exec("/bin/bash", "-c", "true")
    await p.wait()
    return time.perf_counter() - t


async def _episode(repo: str, root: str | None) -> float:
    from mixrl.envs.sandbox import Sandbox

    t = time.perf_counter()
    sb = await Sandbox.create(repo, tmp_root=root)
    try:
        r = await sb.run("true")
        if r.exit_code != 0:
            raise RuntimeError(f"sandbox 'true' exited {r.exit_code}: {r.output[:200]}")
    finally:
        await sb.close()
    return time.perf_counter() - t


async def _concurrent(repo: str, n: int, root: str | None) -> dict[str, Any]:
    from mixrl.envs.sandbox import Sandbox

    cmd_times: list[float] = []

    async def one(i: int) -> bool:
        sb = await Sandbox.create(repo, tmp_root=root)
        try:
            for cmd in (f"echo {i} > own_{i}.txt", "ls"):
                t = time.perf_counter()
                r = await sb.run(cmd)
                cmd_times.append(time.perf_counter() - t)
            own = [x for x in r.output.split() if x.startswith("own_")]
            diff = await sb.diff()
            return own == [f"own_{i}.txt"] and diff.count("+++ ") == 1 and f"+{i}\n" in diff
        finally:
            await sb.close()

    t = time.perf_counter()
    ok = await asyncio.gather(*(one(i) for i in range(n)))
    wall = time.perf_counter() - t
    return {"episodes": n, "wall_s": round(wall, 3), "isolated": all(ok), "failed": ok.count(False),
            "command": _stats(cmd_times)}


def _baseline_grader(rev: str, tmp: str) -> Any:
    """``grade_patch`` of git revision ``rev`` (its grade.py and pytest_runner.py, in ``tmp``)."""
    here = Path(__file__).resolve().parent
    top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=here, capture_output=True, text=True)
    if top.returncode != 0:
        raise SystemExit(f"--grade-baseline needs a git checkout: {top.stderr.strip()}")
    for name in ("grade.py", "pytest_runner.py"):
        got = subprocess.run(["git", "show", f"{rev}:src/mixrl/envs/coding/{name}"], cwd=top.stdout.strip(),
                             capture_output=True, text=True)
        if got.returncode != 0:
            raise SystemExit(f"--grade-baseline {rev!r}: {got.stderr.strip()}")
        Path(tmp, name).write_text(got.stdout)
        os.chmod(Path(tmp, name), 0o644)
    os.chmod(tmp, 0o755)  # the sandbox uid reads the runner
    spec = importlib.util.spec_from_file_location("mixrl_grade_baseline", Path(tmp, "grade.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod.grade_patch


async def _grading(data: dict[str, Any], repeats: int, baseline: str | None) -> dict[str, Any]:
    """The reference patch graded per arm, arms alternating (rotated) within each round."""
    from mixrl.envs.coding.grade import grade_patch

    pytest_form = {k: v for k, v in data.items() if k != "oracle"}
    with tempfile.TemporaryDirectory(prefix="mixrl-baseline-") as tmp:
        arms: dict[str, Any] = {"oracle": lambda: grade_patch(data, data["reference_patch"]),
                                "pytest": lambda: grade_patch(pytest_form, data["reference_patch"])}
        if baseline:
            old = _baseline_grader(baseline, tmp)
            arms["baseline"] = lambda: old(pytest_form, data["reference_patch"])
        names = list(arms)
        times: dict[str, list[float]] = {n: [] for n in names}
        for n in names:  # warm-up
            await arms[n]()
        for i in range(repeats):
            for n in names[i % len(names):] + names[: i % len(names)]:
                t = time.perf_counter()
                g = await arms[n]()
                times[n].append(time.perf_counter() - t)
                if g.reward != 1.0:
                    raise RuntimeError(f"grading arm {n}: the reference patch earned {g.reward} ({g.reason})")
    out: dict[str, Any] = {n: _stats(v) for n, v in times.items()}
    if baseline:
        out["baseline_rev"] = baseline
        for n in ("oracle", "pytest"):
            out[f"{n}_ratio"] = round(statistics.median(times[n]) / statistics.median(times["baseline"]), 3)
    out["repeats"] = repeats
    return out


async def measure(repeats: int, concurrency: int, task: str, grade: bool, root: str | None = None,
                  grade_repeats: int = 15, baseline: str | None = None) -> dict[str, Any]:
    from mixrl.envs.coding.loader import load_tasks
    from mixrl.envs.sandbox import HOST, Sandbox
    from mixrl.envs.sandbox.cgroup import hierarchy
    from mixrl.envs.sandbox.pool import POOL
    from mixrl.envs.sandbox.seccomp import program

    tree = hierarchy()
    by_id = {t.data["instance_id"]: t for t in load_tasks()}
    if task not in by_id:
        raise ValueError(f"--task {task!r} is not a bundled instance; known: {sorted(by_id)}")
    data = by_id[task].data
    repo = data["repo_dir"]
    await _episode(repo, root)  # warm-up: runtime discovery, page cache
    plain = [await _plain() for _ in range(repeats)]
    episode = [await _episode(repo, root) for _ in range(repeats)]
    sb = await Sandbox.create(repo, tmp_root=root)
    try:
        run = []
        for _ in range(repeats):
            t = time.perf_counter()
            await sb.run("true")
            run.append(time.perf_counter() - t)
    finally:
        await sb.close()
    out: dict[str, Any] = {
        "plain": _stats(plain), "episode": _stats(episode), "run": _stats(run),
        "overhead_ms": round((statistics.median(episode) - statistics.median(plain)) * 1e3, 2),
        "goal_ms": GOAL_MS, "meets_goal": statistics.median(episode) * 1e3 <= GOAL_MS,
        "concurrent": await _concurrent(repo, concurrency, root), "repeats": repeats, "task": task,
        "root": root or HOST.episode_root(), "load_avg_1m": os.getloadavg()[0], "cpus": os.cpu_count(),
        "bounds": {"cgroup": f"v{tree.version}:{','.join(tree.controllers)}", "tmpfs": True,
                   "seccomp": len(program()) // 8,  # instructions in the filter
                   # highest memory of all episodes together so far, and its cap
                   "memory_peak_mb": round(tree.memory_peak() / 2**20, 1), "memory_cap_mb": tree.memory_cap >> 20},
    }
    if grade:
        out["grade"] = await _grading(data, grade_repeats, baseline)
    out["pool"] = POOL.stats()
    out["load_avg_1m_end"] = os.getloadavg()[0]
    return out


def main(args: argparse.Namespace) -> int:
    if args.repeats < 3:
        raise SystemExit(f"--repeats must be >= 3, got {args.repeats}")
    if args.concurrency < 1:
        raise SystemExit(f"--concurrency must be >= 1, got {args.concurrency}")
    if args.grade_repeats < 3:
        raise SystemExit(f"--grade-repeats must be >= 3, got {args.grade_repeats}")
    res = asyncio.run(measure(args.repeats, args.concurrency, args.task, not args.no_grade, args.root,
                              args.grade_repeats, args.grade_baseline))
    if args.json:
        print(json_text(res))
        return 0
    p, e, r, c = res["plain"], res["episode"], res["run"], res["concurrent"]
    print(f"plain subprocess        median {p['median_ms']:7.2f} ms   p90 {p['p90_ms']:7.2f} ms")
    print(f"sandbox create+run+close median {e['median_ms']:6.2f} ms   p90 {e['p90_ms']:7.2f} ms"
          f"   (goal <= {GOAL_MS:.0f} ms: {'met' if res['meets_goal'] else 'NOT met'})")
    print(f"run in a live sandbox   median {r['median_ms']:7.2f} ms   p90 {r['p90_ms']:7.2f} ms")
    print(f"{c['episodes']} concurrent episodes: {c['wall_s']:.2f} s wall, isolated={c['isolated']}, "
          f"command median {c['command']['median_ms']:.1f} ms, p90 {c['command']['p90_ms']:.1f} ms")
    print(f"episode root {res['root']}, load average {res['load_avg_1m']:.1f} on {res['cpus']} CPUs")
    if "grade" in res:
        g = res["grade"]
        for n in ("oracle", "pytest", "baseline"):
            if n in g:
                ratio = f"   {g[n + '_ratio']:.2f}x the baseline" if n + "_ratio" in g else ""
                print(f"grading ({n:8s})      median {g[n]['median_ms']:7.1f} ms   p90 {g[n]['p90_ms']:7.1f} ms{ratio}")
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m mixrl.lab.bench.sandbox", description=__doc__.splitlines()[0])
    configure(_parser)
    sys.exit(main(_parser.parse_args()))
