"""Sandbox latency and concurrency: ``python -m mixrl.bench.sandbox [--json]``.

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
- ``grade`` (unless ``--no-grade``): one grading of the task's reference patch.

Medians and 90th percentiles over ``--repeats`` rounds, in milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from typing import Any

GOAL_MS = 50.0


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=40, help="timed rounds per measurement (>= 3)")
    parser.add_argument("--concurrency", type=int, default=32, help="episodes run at once (>= 1)")
    parser.add_argument("--task", default="textkit-truncate", help="bundled instance whose repository is used")
    parser.add_argument("--root", default=None,
                        help="directory for the episodes' private copies (default: the system temp dir)")
    parser.add_argument("--no-grade", action="store_true", help="skip the grading measurement")
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


async def measure(repeats: int, concurrency: int, task: str, grade: bool, root: str | None = None) -> dict[str, Any]:
    from mixrl.envs.coding.grade import grade_patch
    from mixrl.envs.coding.loader import load_tasks
    from mixrl.envs.sandbox import HOST, Sandbox
    from mixrl.envs.sandbox.cgroup import hierarchy
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
        t = time.perf_counter()
        g = await grade_patch(data, data["reference_patch"])
        out["grade"] = {"seconds": round(time.perf_counter() - t, 3), "reward": g.reward}
    return out


def main(args: argparse.Namespace) -> int:
    if args.repeats < 3:
        raise SystemExit(f"--repeats must be >= 3, got {args.repeats}")
    if args.concurrency < 1:
        raise SystemExit(f"--concurrency must be >= 1, got {args.concurrency}")
    res = asyncio.run(measure(args.repeats, args.concurrency, args.task, not args.no_grade, args.root))
    if args.json:
        print(json.dumps(res))
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
        print(f"grading (reference patch): {res['grade']['seconds']:.2f} s, reward {res['grade']['reward']}")
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m mixrl.bench.sandbox", description=__doc__.splitlines()[0])
    configure(_parser)
    sys.exit(main(_parser.parse_args()))
