"""Grading: the episode's diff, applied to a fresh snapshot in a new sandbox, checked.

    result = await grade_sandbox(task.data, sb)     # diff of a finished episode
    result = await grade_patch(task.data, patch)    # any unified diff (reference patch, tests)

Two forms. A task with an ``oracle`` (every bundled task) is judged here, in the grading
process: the child in the sandbox imports the repository and returns the values of the
oracle's expressions; the expected values never enter the sandbox (``oracle.py``). A task
without one runs its hidden pytest files (``pytest_runner.py``), restored *after* the
model's patch as in SWE-bench, and is judged here too: the files enter the sandbox with
every top-level check rewritten to record what the code computed, without the value it
expects (``expect.py``), every test renamed, canaries added, order random (``canary.py``);
a test passes iff pytest reported it passed and all its recorded checks hold here
(``results.py``). What the pytest form defends against:

- a ``conftest.py`` anywhere (forcing outcomes through hooks): ``--noconftest``;
- edited, added or deleted tests, a ``tests/__init__.py``: test directories restored whole;
- a ``*.dist-info``/``*.egg-info`` with a ``pytest11`` entry point, a ``*.pth``: never in a
  diff (``DIFF_EXCLUDES``), removed from the grading tree, plugin autoload off;
- runner configuration (``pytest.ini``, ``tox.ini``, ``setup.cfg``, ``pyproject.toml``):
  pytest runs with our own ini file from a fresh ``/tmp``;
- a ``pytest.py``/``_pytest``/stdlib shadow, a ``sitecustomize.py``: ``python -I``,
  ``/testbed`` last on ``sys.path``;
- reading the hidden tests or the pristine tree from library code: they are mounted only
  while the tree is restored, in a command that runs nothing from ``/testbed``;
- library code reading the test file it runs with: it holds no expected value;
- forged reports from library code (the report pipe, the runner's plugin, pytest's
  ``TestReport``): a forged ``passed`` does not make a check hold; a test reported passed
  without recording its checks, a canary counted passed, an ill-formed message:
  ``reward_hacked``. What remains is decided by pytest's report alone, which that code can
  forge: statements left in the file (nested in a branch, loop or ``try``, an expected
  value written as an expression), and an outcome simple enough to guess (truthy, the
  usual exception class), which the truth and raises canaries only make a gamble.

Anything the model's output can shape that the grader reads (a result line nested past the
recursion limit, a huge number, wrong types) is reward 0 (``results.py``), never a raise.

Time: each task records its reference solution's grading time (``reference_seconds`` in
``instance.toml``, else measured once per process); a grading may take ``GRADE_FACTOR``
times that, at least ``GRADE_FLOOR_S``. Reward is 1 iff every required check passed.
Outcomes: ``status`` ``ok`` (reward 1 or 0: a patch that does not apply, a crash, failed
checks), ``failed`` (reward 0: the time limit, a full grading filesystem), or
``reward_hacked`` (reward 0, the patch kept, ``why`` says what: a forged or ill-formed
result). Only our own failures raise ``SandboxError`` (a runner that never started).
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import random
import secrets
import shlex
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mixrl.envs.coding import oracle as oracle_mod
from mixrl.envs.coding import results as results_mod
from mixrl.envs.coding.canary import Hidden, hide
from mixrl.envs.coding.loader import ensure_hidden
from mixrl.envs.coding.oracle_child import RESULT, STARTED
from mixrl.envs.coding.pytest_runner import RESTORE_FAILED, RESTORED
from mixrl.envs.sandbox import DiffError, ExecResult, Sandbox, SandboxError, SandboxLimits
from mixrl.models.untrusted import strip_control

RUNNER = Path(__file__).with_name("pytest_runner.py")
ORACLE_CHILD = Path(__file__).with_name("oracle_child.py")
GRADE_LIMITS = SandboxLimits(cpu_seconds=60, wall_seconds=120.0, output_bytes=2 << 20)
GRADE_FLOOR_S = 15.0  # the least time a grading is given (a loaded host stretches a 0.1 s grading)
GRADE_FACTOR = 10.0  # times the reference solution's grading time
CALIBRATION_S = 120.0  # limit while a task's reference time is being measured
CANARIES_PER_FILE = 64  # every test with a check gets a twin, up to this many
MAX_RESULTS_BYTES = 8 << 20
MAX_KEPT_PATCH = 256 << 10  # a reward-hacking patch kept for inspection
MEASURED_REFERENCE_S: dict[str, float] = {}  # measured reference grading times (tasks without the field)


@dataclass
class GradeResult:
    reward: float  # 1.0 iff all required checks passed
    tests: dict[str, str] = field(default_factory=dict)  # check id -> passed|failed|error|skipped|...
    failed: list[str] = field(default_factory=list)  # required checks that did not pass
    reason: str = ""  # why 0: patch_failed, diff_error, timeout, disk, crashed, reward_hacked
    output: str = ""  # tail of the runner's output, for logs (control characters stripped)
    seconds: float = 0.0  # time in grading commands (what reference_seconds records)
    canaries: list[str] = field(default_factory=list)  # pytest form: the canary node ids
    patch: str = ""  # the patch, kept when reward_hacked
    why: str = ""  # what made it reward_hacked
    reported: dict[str, str] = field(default_factory=dict)  # pytest form: what pytest reported per test

    def __post_init__(self) -> None:
        self.output = strip_control(self.output)
        self.failed = [strip_control(t) for t in self.failed]

    @property
    def status(self) -> str:
        if self.reason == "reward_hacked":
            return "reward_hacked"
        return "failed" if self.reason in ("timeout", "disk") else "ok"


def required_tests(data: dict[str, Any]) -> list[str]:
    return list(data["FAIL_TO_PASS"]) + list(data["PASS_TO_PASS"])


ABSENT = "absent"


def _read_results(path: str) -> Any:
    """The runner's JSON object, opened without following links and size-capped; ``ABSENT``
    when there is no such file (the runner never started), None when it is there but not
    a well-formed object (what the model's code sent made it so)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a fifo must not block us
    except OSError:
        return ABSENT
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ABSENT
        data = os.read(fd, MAX_RESULTS_BYTES + 1)
    except OSError:
        return ABSENT
    finally:
        os.close(fd)
    ok, obj = results_mod.loads(data, MAX_RESULTS_BYTES)
    return obj if ok and isinstance(obj, dict) else None


def _private_file(path: str, text: str) -> str:
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    with open(path, "w", encoding="utf-8", errors="surrogateescape") as f:
        f.write(text)
    os.chmod(path, 0o644)
    return path


def _stage(sb: Sandbox, data: dict[str, Any], patch: str) -> dict[str, Any]:
    """The grader's files on the grading sandbox's own tmpfs (never the task's own paths)."""
    gdir = sb.fs.mkdir("grader", 0o755)
    out: dict[str, Any] = {"patch": _private_file(os.path.join(gdir, "model.patch"), patch)}
    if data.get("oracle"):
        out["job"] = _private_file(os.path.join(gdir, "job.json"), json.dumps(oracle_mod.job(data["oracle"])))
        return out
    # Results: the sandbox may create files in ``/results`` but not list it (mode 0733, not
    # its own); the random name waits in ``job.txt``, which the runner deletes first.
    out["results"], out["name"] = sb.results_dir(), f"{secrets.token_hex(16)}.json"
    _private_file(os.path.join(out["results"], "job.txt"), out["name"])
    rng, hidden = random.Random(secrets.randbits(64)), {}
    for rel in data["test_files"]:
        text = Path(data["tests_dir"], rel).read_text(encoding="utf-8", errors="surrogateescape")
        try:
            h = hide(text, rng, CANARIES_PER_FILE)
        except (SyntaxError, ValueError, RecursionError, MemoryError):  # pytest reports it uncollectable
            h = Hidden(text)
        hidden[rel] = h
        _private_file(os.path.join(gdir, "tests", rel), h.text)
    out["tests"], out["hidden"] = os.path.join(gdir, "tests"), hidden
    return out


async def reference_seconds(data: dict[str, Any]) -> float:
    """The task's recorded reference grading time, or measured once (its reference must pass)."""
    if data.get("reference_seconds"):
        return float(data["reference_seconds"])
    key = f"{data.get('source_dir', '')}|{data['repo_dir']}"
    if key not in MEASURED_REFERENCE_S:
        g = await grade_patch(data, data["reference_patch"], timeout=CALIBRATION_S)
        if g.reward != 1.0:
            raise SandboxError(f"task {data.get('instance_id')!r}: its reference patch does not pass "
                               f"({g.reason or g.failed[:4]}); cannot set its grading time limit")
        MEASURED_REFERENCE_S[key] = g.seconds
    return MEASURED_REFERENCE_S[key]


async def grade_limit(data: dict[str, Any]) -> float:
    return max(GRADE_FLOOR_S, GRADE_FACTOR * await reference_seconds(data))


class _Clock:
    def __init__(self, limit: float) -> None:
        self.end, self.used = time.monotonic() + limit, 0.0

    async def run(self, sb: Sandbox, cmd: str, binds: list[tuple[str, str, bool]]) -> ExecResult:
        t0 = time.monotonic()
        r = await sb.run(cmd, timeout=max(0.1, self.end - t0), binds=binds)
        self.used += time.monotonic() - t0
        return r


def _cut(r: ExecResult, need: list[str], clock: _Clock) -> GradeResult | None:
    """Reward 0 for a command the model's code ran out of time or disk in."""
    if r.killed_by == "disk":
        return GradeResult(0.0, failed=need, reason="disk", output=r.output[-2000:], seconds=clock.used)
    if r.timed_out:
        return GradeResult(0.0, failed=need, reason="timeout", output=r.output[-2000:], seconds=clock.used)
    return None


async def grade_patch(data: dict[str, Any], patch: str, limits: SandboxLimits | None = None,
                      timeout: float | None = None) -> GradeResult:
    """Apply ``patch`` (``-p1``) to a fresh copy of the task's snapshot and check it.

    ``timeout``: seconds for the grading commands (default ``grade_limit(data)``)."""
    ensure_hidden(data)
    limit = timeout if timeout is not None else await grade_limit(data)
    need = required_tests(data)
    sb = await Sandbox.create(data["repo_dir"], limits or GRADE_LIMITS, pool="grading")
    try:
        clock = _Clock(limit)
        try:
            st = await asyncio.to_thread(_stage, sb, data, patch)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):  # a patch too large for its grading filesystem
                return GradeResult(0.0, failed=need, reason="disk", output=str(e))
            raise SandboxError(f"grading: cannot stage the grader's files ({e})") from e
        if patch.strip():
            r = await clock.run(sb, "patch -p1 -E --batch --forward --no-backup-if-mismatch -s -i /grader/model.patch",
                                [(st["patch"], "/grader/model.patch", False)])
            if (cut := _cut(r, need, clock)) is not None:
                return cut
            if r.exit_code != 0:
                full = "No space left on device" in r.output  # the file was removed after the failed write
                return GradeResult(0.0, failed=need, reason="disk" if full else "patch_failed", output=r.output[-2000:],
                                   seconds=clock.used)
        if sb.fs.full():  # the patch filled the grading filesystem: nothing can run there
            return GradeResult(0.0, failed=need, reason="disk", seconds=clock.used)
        if data.get("oracle"):
            return await _oracle(sb, data, st, clock, need, patch)
        return await _pytest(sb, data, st, clock, need, patch)
    finally:
        await sb.close()


async def _oracle(sb: Sandbox, data: dict[str, Any], st: dict[str, Any], clock: _Clock,
                  need: list[str], patch: str) -> GradeResult:
    r = await clock.run(sb, "python3 -I /opt/grader/oracle_child.py /grader/job.json",
                        [(str(ORACLE_CHILD), "/opt/grader/oracle_child.py", False), (st["job"], "/grader/job.json", False)])
    lines = r.output.splitlines()
    if STARTED not in lines and not r.timed_out and r.killed_by != "disk":
        raise SandboxError(f"oracle child did not start (exit {r.exit_code}): {r.output[-800:]}")
    found = [ln[len(RESULT):] for ln in lines if ln.startswith(RESULT)]
    if not found:
        if (cut := _cut(r, need, clock)) is not None:
            return cut
        return GradeResult(0.0, failed=need, reason="crashed", output=r.output[-2000:], seconds=clock.used)
    results = results_mod.oracle_results(found[0], len(data["oracle"]["cases"]))
    why = "several result lines" if len(found) > 1 else "an ill-formed result line" if results is None else ""
    if why and r.truncated and len(found) == 1 and lines[-1].startswith(RESULT):
        return GradeResult(0.0, failed=need, reason="crashed", output=r.output[-2000:], seconds=clock.used)
    if why:  # our child writes one well-formed line: this one was forged
        return GradeResult(0.0, {}, need, "reward_hacked", r.output[-2000:], clock.used, patch=patch[:MAX_KEPT_PATCH],
                           why=why)
    tests = oracle_mod.judge(data["oracle"], results)
    failed = [t for t in need if tests.get(t) != "passed"] + [t for t in tests if t not in need and tests[t] != "passed"]
    return GradeResult(0.0 if failed else 1.0, tests, failed, output=r.output[-2000:], seconds=clock.used)


async def _pytest(sb: Sandbox, data: dict[str, Any], st: dict[str, Any], clock: _Clock, need: list[str],
                  patch: str) -> GradeResult:
    files = " ".join(shlex.quote(t) for t in data["test_files"])
    runner = (str(RUNNER), "/opt/grader/pytest_runner.py", False)
    r = await clock.run(sb, f"python3 -I /opt/grader/pytest_runner.py --restore /grader/tests /grader/pristine {files}",
                        [runner, (st["tests"], "/grader/tests", False), (sb.snapshot, "/grader/pristine", False)])
    if (cut := _cut(r, need, clock)) is not None:
        return cut
    if RESTORED not in r.output.splitlines():
        if RESTORE_FAILED in r.output:  # the model's tree resisted (a file where a directory belongs)
            return GradeResult(0.0, failed=need, reason="crashed", output=r.output[-2000:], seconds=clock.used)
        raise SandboxError(f"grading restore did not run (exit {r.exit_code}): {r.output[-800:]}")
    r = await clock.run(sb, f"python3 -I /opt/grader/pytest_runner.py /results {files}",
                        [runner, (str(ORACLE_CHILD), "/opt/grader/oracle_child.py", False),
                         (st["results"], "/results", True)])
    res = await asyncio.to_thread(_read_results, os.path.join(st["results"], st["name"]))
    out = r.output[-2000:]
    if res is ABSENT or (isinstance(res, dict) and res.get("started") is not True):
        if (cut := _cut(r, need, clock)) is not None:
            return cut
        raise SandboxError(f"grading runner did not start (exit {r.exit_code}): {r.output[-800:]}")
    kept = patch[:MAX_KEPT_PATCH]
    if res is None or res.get("bad"):  # the runner writes well-formed JSON of what it was sent
        cut = _cut(r, need, clock)
        return cut or GradeResult(0.0, {}, need, "reward_hacked", out, clock.used, patch=kept,
                                  why="ill-formed results from the test process")
    if "tests" not in res:
        cut = _cut(r, need, clock)
        return cut or GradeResult(0.0, failed=need, reason="crashed", seconds=clock.used,
                                  output=str(res.get("error", ""))[:200] + "\n" + out)
    try:
        v = results_mod.judge_pytest(st["hidden"], res)
    except Exception as e:  # noqa: BLE001 - whatever the test process sent, it is a reward of 0
        v = results_mod.Verdict(hacked=f"results the grader cannot judge ({type(e).__name__})")
    if v.hacked:
        return GradeResult(0.0, v.tests, need, "reward_hacked", out, clock.used, v.canaries, kept, v.hacked,
                           v.reported)
    failed = [t for t in need if v.tests.get(t) != "passed"]
    return GradeResult(0.0 if failed else 1.0, v.tests, failed, output=out, seconds=clock.used,
                       canaries=v.canaries, reported=v.reported)


async def grade_sandbox(data: dict[str, Any], sb: Sandbox, limits: SandboxLimits | None = None) -> GradeResult:
    """Grade a finished episode: its diff against the snapshot, via ``grade_patch``."""
    try:
        patch = await sb.diff()
    except DiffError as e:
        return GradeResult(0.0, failed=required_tests(data), reason="diff_error", output=str(e))
    return await grade_patch(data, patch, limits)
