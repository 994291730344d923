"""The grading test runner; runs *inside* the grading sandbox as a script.

    python3 -I /opt/grader/pytest_runner.py --restore TESTS_DIR PRISTINE_DIR TEST_FILE...
    python3 -I /opt/grader/pytest_runner.py RESULTS_DIR TEST_FILE...

Two sandboxed commands. The first (``--restore``, nothing from ``/testbed`` is imported)
sees the hidden test files and the pristine tree and prepares ``/testbed``:

1. restore every directory holding a task test file *whole* from ``PRISTINE_DIR`` (files
   the model added there, a ``tests/__init__.py`` or a ``conftest.py``, are gone), then
   the task's test files from ``TESTS_DIR`` over it (rewritten: ``canary.py``);
2. remove every import-time hook from the tree: ``*.dist-info``/``*.egg-info`` (entry
   points: a ``pytest11`` plugin), ``*.pth``, ``*.egg-link``, ``sitecustomize.py``,
   ``usercustomize.py`` (walks are iterative: the tree came from the model's patch);
   it prints ``RESTORED`` (or ``RESTORE_FAILED`` when the model's tree resisted).

The second runs the tests in a new sandbox where ``TESTS_DIR`` and ``PRISTINE_DIR`` are
not mounted. Two processes; the parent never imports pytest or anything from ``/testbed``:

3. read the results file name from ``RESULTS_DIR/job.txt`` and delete it (the directory is
   not listable: nothing started later can find the name), write ``{"started": true}`` —
   a runner that never gets this far failed on our side — and make itself non-dumpable
   (its memory, fds and environment are then closed to the child, which has the same uid);
4. run the child: ``python3 -I`` with ``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1``; it appends
   ``/testbed`` to ``sys.path`` (after the standard library and pytest), runs pytest with
   our own ini file in a fresh ``/tmp`` (no repository configuration is read),
   ``--noconftest``, no cache provider, ``--import-mode=append``, and streams each test
   report to the parent over a pipe on a randomly numbered descriptor, named in an
   environment variable the child removes before pytest starts (not in its argv);
5. the child also installs the recording functions the rewritten test files call
   (``__mixrl_value__``, ``__mixrl_truth__``, ``__mixrl_raises__``: ``expect.py``), which
   send each computed value, encoded by ``oracle_child.encode``, under the running test's
   node id over the same pipe; no expected value is in this sandbox;
6. the parent folds the reports (a test counts as ``passed`` only when setup, call and
   teardown passed and it was not an xfail/xpass), keeps the recorded values as JSON text
   (capped), counts every message it cannot parse or that has the wrong shape (``bad``:
   never raised), and writes ``{"started": true, "exit": N, "tests": {nodeid: outcome},
   "checks": [[node, id, value], ...], "bad": n, "overflow": bool}``.

The code under test runs in the child and can rewrite anything in it (its reports, the
pipe, the recording functions); what it cannot do is know the values the grading process
expects (``results.py`` judges there).

Imports nothing from mixrl: it runs on the bare interpreter of the sandbox.
"""

from __future__ import annotations

import contextlib
import ctypes
import fnmatch
import json
import os
import random
import resource
import shutil
import stat
import subprocess
import sys
from typing import Any

TESTBED = "/testbed"
PYSITE = "/opt/pysite"  # pytest, bound read only (-I ignores PYTHONPATH)
HOOKS = ("*.dist-info", "*.egg-info", "*.pth", "*.egg-link", "sitecustomize.py", "usercustomize.py")
MAX_REPORTS = 100_000  # reports, and recorded checks
MAX_ID = 4096  # one node id
MAX_VALUE = 64 << 10  # one recorded value, as JSON (larger: recorded as an error)
MAX_CHECK_BYTES = 4 << 20  # all recorded values (the results file stays under the grader's 8 MiB)
MAX_REPORT_BYTES = 2 << 20  # all node ids of the reports
WIRE = "/opt/grader/oracle_child.py"
FD_ENV = "MIXRL_GRADER_FD"
RESTORED, RESTORE_FAILED = "@@mixrl-restored@@", "@@mixrl-restore-failed@@"


def _write(path: str, obj: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def _remove(path: str) -> None:
    """Remove ``path`` (file, link or tree) without recursion and without following links."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.remove(path)
        return
    stack, dirs = [path], []
    while stack:
        d = stack.pop()
        os.chmod(d, 0o700)  # inside the sandbox, on the model's own tree
        dirs.append(d)
        with os.scandir(d) as it:
            for e in it:
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
                else:
                    os.remove(e.path)
    for d in reversed(dirs):
        os.rmdir(d)


def _real_dirs(rel_dir: str) -> None:
    """Every parent of ``/testbed/rel_dir`` a real directory (a link or file there removed)."""
    cur = TESTBED
    for p in [x for x in rel_dir.split("/") if x]:
        cur = os.path.join(cur, p)
        if os.path.islink(cur) or (os.path.lexists(cur) and not os.path.isdir(cur)):
            os.remove(cur)
        os.makedirs(cur, exist_ok=True)


def restore(tests_dir: str, pristine: str, test_files: list[str]) -> None:
    """Test directories whole from the pristine snapshot, then the task's test files."""
    for d in sorted({os.path.dirname(t) for t in test_files}):
        if d:
            _real_dirs(os.path.dirname(d))
            _remove(os.path.join(TESTBED, d))
            src = os.path.join(pristine, d)
            if os.path.isdir(src) and not os.path.islink(src):
                shutil.copytree(src, os.path.join(TESTBED, d), symlinks=True)
            else:
                os.makedirs(os.path.join(TESTBED, d))
    for rel in test_files:
        _real_dirs(os.path.dirname(rel))
        _remove(os.path.join(TESTBED, rel))
        shutil.copyfile(os.path.join(tests_dir, rel), os.path.join(TESTBED, rel))


def strip_hooks(root: str = TESTBED) -> list[str]:
    """Remove every import-time hook below ``root``; returns what was removed (relative)."""
    removed, stack = [], [root]
    while stack:
        d = stack.pop()
        try:
            with os.scandir(d) as it:
                entries = list(it)
        except OSError:
            continue
        for e in entries:
            if any(fnmatch.fnmatch(e.name, p) for p in HOOKS):
                _remove(e.path)
                removed.append(os.path.relpath(e.path, root))
            elif e.is_dir(follow_symlinks=False):
                stack.append(e.path)
    return removed


def fold(reports: list[dict[str, Any]]) -> dict[str, str]:
    """Per-test outcome from the report phases (setup, call, teardown, collection)."""
    tests: dict[str, str] = {}
    for r in reports:
        node, when, outcome, xfail = str(r.get("id")), r.get("when"), r.get("outcome"), bool(r.get("xfail"))
        prev = tests.get(node)
        if outcome == "failed":
            tests[node] = "error" if when != "call" else "failed"
        elif outcome == "skipped":
            if prev in (None, "passed"):
                tests[node] = "xfailed" if xfail else "skipped"
        elif outcome == "passed" and when == "call" and prev is None:
            tests[node] = "xpassed" if xfail else "passed"
    return tests


def _no_dump() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4


def _free_fd(rng: random.SystemRandom, limit: int) -> int:
    """A random descriptor number below ``limit`` that is not open here."""
    while True:
        fd = rng.randrange(10, max(11, limit))
        try:
            os.fstat(fd)
        except OSError:
            return fd


def restore_main(argv: list[str]) -> int:
    tests_dir, pristine, test_files = argv[0], argv[1], argv[2:]
    try:
        restore(tests_dir, pristine, test_files)
        strip_hooks()
    except (OSError, ValueError) as e:  # the model's tree resisted (a file where a directory belongs ...)
        print(f"{RESTORE_FAILED} {e}", flush=True)
        return 0
    print(RESTORED, flush=True)
    return 0


def _check_record(msg: dict[str, Any]) -> list[str] | None:
    """``[node, check id, payload as JSON text]`` of a check message; None if ill-formed."""
    node, cid = msg.get("node"), msg.get("check")
    if type(node) is not str or type(cid) is not str or len(cid) > 64 or len(node) > MAX_ID:
        return None
    text = json.dumps(msg.get("p"))
    if len(text) > MAX_VALUE:
        text = json.dumps({"error": "value too large"})
    return [node, cid, text]


def _report(msg: dict[str, Any]) -> bool:
    return all(type(msg.get(k)) is str for k in ("id", "when", "outcome")) and len(msg["id"]) <= MAX_ID


def read_pipe(f: Any) -> dict[str, Any]:
    """Fold the test process's messages; what it cannot be trusted to send well-formed
    (anything: it runs the model's code) is counted in ``bad``, never raised. Totals are
    capped (``overflow``) so that the results file stays within what the grader reads."""
    reports: list[dict[str, Any]] = []
    checks: list[list[str]] = []
    code, bad, size, overflow = None, 0, 0, False
    for line in f:
        try:
            msg = json.loads(line)
            rec = _check_record(msg) if isinstance(msg, dict) and "check" in msg else None
        except Exception:  # noqa: BLE001 - nested past the recursion limit, a huge number, not JSON ...
            bad += line.endswith(b"\n")  # a cut last line is a process killed mid-write
            continue
        if not isinstance(msg, dict):
            bad += 1
        elif "check" in msg:
            if rec is None:
                bad += 1
            elif size + sum(map(len, rec)) > MAX_CHECK_BYTES or len(checks) >= MAX_REPORTS:
                overflow = True
            else:
                size += sum(map(len, rec))
                checks.append(rec)
        elif "exit" in msg:
            if type(msg["exit"]) is int:
                code = msg["exit"]
            else:
                bad += 1
        elif not _report(msg):
            bad += 1
        elif len(reports) >= MAX_REPORTS or size + len(msg["id"]) > MAX_CHECK_BYTES + MAX_REPORT_BYTES:
            overflow = True
        else:
            size += len(msg["id"])
            reports.append(msg)
    return {"exit": code, "reports": reports, "checks": checks, "bad": bad, "overflow": overflow}


def parent(argv: list[str]) -> int:
    results_dir, test_files = argv[0], argv[1:]
    job = os.path.join(results_dir, "job.txt")
    with open(job) as f:
        results = os.path.join(results_dir, os.path.basename(f.read().strip()))
    os.remove(job)
    _write(results, {"started": True})
    _no_dump()
    r, w0 = os.pipe()
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    w = _free_fd(random.SystemRandom(), min(soft, 1 << 16))
    os.dup2(w0, w, inheritable=True)
    if w != w0:
        os.close(w0)
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
           FD_ENV: str(w)}
    child = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__), "--child", *test_files],
                             pass_fds=(w,), env=env, cwd=TESTBED, stdin=subprocess.DEVNULL)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        got = read_pipe(f)
    child.wait()
    if got["exit"] is None or child.returncode != 0:  # died before pytest returned: no results
        _write(results, {"started": True, "error": f"test process exited {child.returncode}", "bad": got["bad"]})
        return 0
    _write(results, {"started": True, "exit": got["exit"], "tests": fold(got["reports"]), "checks": got["checks"],
                     "bad": got["bad"], "overflow": got["overflow"]})
    return 0


class _Forward:
    """Streams every report and every recorded check to the parent; the parent decides
    nothing either: the grading process does."""

    def __init__(self, f: Any) -> None:
        self.f, self.node = f, ""

    def _send(self, obj: dict[str, Any]) -> None:
        self.f.write(json.dumps(obj) + "\n")
        self.f.flush()

    def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
        self.node = nodeid

    def pytest_runtest_logreport(self, report: Any) -> None:
        self._send({"id": report.nodeid, "when": report.when, "outcome": report.outcome,
                    "xfail": hasattr(report, "wasxfail")})

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:
            self._send({"id": report.nodeid or "<collection>", "when": "collect", "outcome": "failed"})


class _Raises:
    """``with __mixrl_raises__(ID) as info:``: records what the block raised, swallows it
    (pytest's own skip/fail/xfail outcomes pass through); ``info.value``/``info.type`` as
    with ``pytest.raises``."""

    def __init__(self, record: Any, cid: str) -> None:
        self.record, self.cid, self.value, self.type, self.tb = record, cid, None, None, None

    def __enter__(self) -> _Raises:
        return self

    def __exit__(self, et: Any, e: Any, tb: Any) -> bool:
        if et is not None and str(getattr(et, "__module__", "")).startswith("_pytest"):
            return False
        self.value, self.type, self.tb = e, et, tb
        try:
            msg = str(e)[:4096] if e is not None else ""
        except Exception:  # noqa: BLE001 - a message that cannot be rendered
            msg = ""
        names = None if et is None else [c.__name__ for c in et.__mro__]
        self.record(self.cid, {"raised": names, "msg": msg})
        return True


def install_recorders(fwd: _Forward, wire: Any) -> None:
    """The functions the rewritten test files call (``canary.py``, ``expect.py``), as builtins."""
    import builtins

    def record(cid: str, payload: dict[str, Any]) -> None:
        fwd._send({"check": cid, "node": fwd.node, "p": payload})

    def value(cid: str, v: Any) -> None:
        try:
            payload = {"v": wire.encode(v, [wire.MAX_NODES], loose=True)}
        except (wire.TooLarge, RecursionError, ValueError, TypeError):
            payload = {"error": "value too large or not encodable"}
        record(cid, payload)

    def truth(cid: str, v: Any) -> None:
        record(cid, {"t": bool(v)})

    builtins.__mixrl_value__ = value  # type: ignore[attr-defined]
    builtins.__mixrl_truth__ = truth  # type: ignore[attr-defined]
    builtins.__mixrl_raises__ = lambda cid: _Raises(record, cid)  # type: ignore[attr-defined]


def _load_wire() -> Any:
    """``oracle_child.py`` (bound beside this file) for its value encoder, by path."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_mixrl_wire", WIRE)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def child(test_files: list[str]) -> int:
    out = os.fdopen(int(os.environ.pop(FD_ENV)), "w")
    wire = _load_wire()
    sys.path.insert(1, PYSITE)
    import pytest

    ini = "/tmp/grader-pytest.ini"
    with open(ini, "w") as f:
        f.write("[pytest]\n")
    sys.path.append(TESTBED)
    fwd = _Forward(out)
    install_recorders(fwd, wire)
    args = ["-c", ini, "--rootdir", TESTBED, "--noconftest", "-p", "no:cacheprovider",
            "--import-mode=append", "-q", "--no-header", *test_files]
    code = int(pytest.main(args, plugins=[fwd]))
    fwd._send({"exit": code})
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        raise SystemExit(child(sys.argv[2:]))
    if sys.argv[1:2] == ["--restore"]:
        raise SystemExit(restore_main(sys.argv[2:]))
    raise SystemExit(parent(sys.argv[1:]))
