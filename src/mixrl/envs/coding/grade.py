"""Grading: the episode's diff, applied to a fresh snapshot in a new sandbox, tested.

    result = await grade_sandbox(task.data, sb)     # diff of a finished episode
    result = await grade_patch(task.data, patch)    # any unified diff (reference patch, tests)

As in SWE-bench, the task's test directories are restored *after* the model's
patch (whole, from the pristine snapshot, then the hidden test files over them),
so editing, adding or deleting tests gains nothing. What else a reward hacker
might try, and why it does not count:

- a ``conftest.py`` anywhere (forcing outcomes through hooks): ``--noconftest``;
- a ``tests/__init__.py`` (or any module) rebinding the results writer: the test
  directory is restored whole, and the results are written by the runner's parent
  process, which never imports pytest or the repository (``pytest_runner.py``);
- a ``*.dist-info``/``*.egg-info`` with a ``pytest11`` entry point, a ``*.pth``:
  never in a diff (``DIFF_EXCLUDES``), removed from the grading tree, and plugin
  autoload is off (``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1``);
- runner configuration (``pytest.ini``, ``tox.ini``, ``setup.cfg``,
  ``pyproject.toml`` with ``addopts``/``python_files``/deselects): pytest runs
  with our own ini file from a fresh ``/tmp``, none of the repository's is read;
- a ``pytest.py``/``_pytest``/``pluggy``/stdlib module shadow, a
  ``sitecustomize.py``: the runner starts with ``python -I`` and puts
  ``/testbed`` last on ``sys.path``;
- symlinks, fifos, file modes, binary files: the diff carries text edits of
  regular files only, and the fresh copy gets nothing else;
- results: a test counts only with an explicit ``passed`` for setup, call
  and teardown; a missing test, skip, xfail or crash is a failure, and the
  results file has a random name known only to the non-dumpable parent, in a
  directory on the grading sandbox's own tmpfs that the sandbox can write but
  not list (bounded like the work tree).

Known limit (shared with SWE-bench): the code under test runs in the test
process, so a patch whose *library code* rewrites pytest's reporting in that
process at import time is not caught here; it cannot reach the parent (other
process, ptrace denied by seccomp, not dumpable) nor name the results file.

Reward is 1 iff every FAIL_TO_PASS and every PASS_TO_PASS test passed, else 0
(including a patch that does not apply, a timeout, a crash). Our own
failures (no sandbox, the runner never started) raise ``SandboxError``.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shlex
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mixrl.envs.sandbox import DiffError, Sandbox, SandboxError, SandboxLimits
from mixrl.envs.untrusted import strip_control

RUNNER = Path(__file__).with_name("pytest_runner.py")
GRADE_LIMITS = SandboxLimits(cpu_seconds=60, wall_seconds=120.0, output_bytes=64 << 10)
MAX_RESULTS_BYTES = 8 << 20


@dataclass
class GradeResult:
    reward: float  # 1.0 iff all FAIL_TO_PASS and PASS_TO_PASS passed
    tests: dict[str, str] = field(default_factory=dict)  # nodeid -> passed|failed|error|skipped|...
    failed: list[str] = field(default_factory=list)  # required tests that did not pass
    reason: str = ""  # why 0 without test results: patch_failed, diff_error, timeout, crashed
    output: str = ""  # tail of the runner's output, for logs (control characters stripped)

    def __post_init__(self) -> None:
        self.output = strip_control(self.output)
        self.failed = [strip_control(t) for t in self.failed]


def _read_results(path: str) -> dict[str, Any] | None:
    """The runner's JSON, opened without following links and size-capped."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a fifo must not block us
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = os.read(fd, MAX_RESULTS_BYTES + 1)
        obj = json.loads(data) if len(data) <= MAX_RESULTS_BYTES else None
        return obj if isinstance(obj, dict) else None
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def required_tests(data: dict[str, Any]) -> list[str]:
    return list(data["FAIL_TO_PASS"]) + list(data["PASS_TO_PASS"])


def _stage(sb: Sandbox, patch: str) -> tuple[str, str, str]:
    """(results dir, results file name, patch file) on the grading sandbox's own tmpfs.

    Results: the sandbox may create files in ``/results`` but not list it (mode 0733, not
    its own, so no chmod); the file's random name waits in ``job.txt``, which the runner's
    parent deletes before anything else runs. Both are bounded by the episode's tmpfs."""
    results = sb.results_dir()
    name = f"{secrets.token_hex(16)}.json"
    job = os.path.join(results, "job.txt")
    with open(job, "w") as f:
        f.write(name)
    os.chmod(job, 0o644)
    gdir = sb.fs.mkdir("grader", 0o755)
    patch_file = os.path.join(gdir, "model.patch")
    with open(patch_file, "w", encoding="utf-8", errors="surrogateescape") as f:
        f.write(patch)
    os.chmod(patch_file, 0o644)
    return results, name, patch_file


async def grade_patch(data: dict[str, Any], patch: str, limits: SandboxLimits | None = None) -> GradeResult:
    """Apply ``patch`` (``-p1``) to a fresh copy of the task's snapshot and run its tests."""
    need = required_tests(data)
    sb = await Sandbox.create(data["repo_dir"], limits or GRADE_LIMITS)
    try:
        results, name, patch_file = await asyncio.to_thread(_stage, sb, patch)
        binds = [(patch_file, "/grader/model.patch", False), (data["tests_dir"], "/grader/tests", False),
                 (sb.snapshot, "/grader/pristine", False), (str(RUNNER), "/opt/grader/pytest_runner.py", False),
                 (results, "/results", True)]
        if patch.strip():
            r = await sb.run("patch -p1 -E --batch --forward --no-backup-if-mismatch -s -i /grader/model.patch",
                             binds=binds)
            if r.exit_code != 0:
                return GradeResult(0.0, failed=need, reason="patch_failed", output=r.output[-2000:])
        files = " ".join(shlex.quote(t) for t in data["test_files"])
        r = await sb.run(f"python3 -I /opt/grader/pytest_runner.py /results /grader/tests /grader/pristine {files}",
                         binds=binds)
        res = await asyncio.to_thread(_read_results, os.path.join(results, name))
        if res is None or res.get("started") is not True:
            if r.timed_out:
                return GradeResult(0.0, failed=need, reason="timeout", output=r.output[-2000:])
            raise SandboxError(f"grading runner did not start (exit {r.exit_code}): {r.output[-800:]}")
        tests = res.get("tests")
        if not isinstance(tests, dict):
            reason = "timeout" if r.timed_out else "crashed"
            return GradeResult(0.0, failed=need, reason=reason, output=(str(res.get("error", "")) + "\n"
                                                                         + r.output[-2000:]))
        tests = {str(k): str(v) for k, v in tests.items()}
        failed = [t for t in need if tests.get(t) != "passed"]
        return GradeResult(0.0 if failed else 1.0, tests, failed, output=r.output[-2000:])
    finally:
        await sb.close()


async def grade_sandbox(data: dict[str, Any], sb: Sandbox, limits: SandboxLimits | None = None) -> GradeResult:
    """Grade a finished episode: its diff against the snapshot, via ``grade_patch``."""
    try:
        patch = await sb.diff()
    except DiffError as e:
        return GradeResult(0.0, failed=required_tests(data), reason="diff_error", output=str(e))
    return await grade_patch(data, patch, limits)
