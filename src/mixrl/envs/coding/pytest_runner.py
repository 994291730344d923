"""The grading test runner; runs *inside* the grading sandbox as a script.

    python3 -I /opt/grader/pytest_runner.py RESULTS_DIR TESTS_DIR TEST_FILE...

Started with ``-I`` (no current directory on ``sys.path``, no ``PYTHON*``
variables, no user site), so nothing under ``/testbed`` can shadow pytest,
its plugins or the standard library. Steps:

1. restore every task test file from ``TESTS_DIR`` over ``/testbed`` (a
   symlink or file standing where a parent directory belongs is removed
   first, so the restored file is the file pytest reads);
2. read the results file name from ``RESULTS_DIR/job.txt`` and delete it
   (the directory is not listable: code under test cannot find the name),
   import pytest (from ``/opt/pysite``), then write ``{"started": true}`` to
   the results file — a runner that never gets this far failed on our side;
3. append ``/testbed`` to ``sys.path`` (after the standard library and
   pytest: the code under test cannot shadow them) and run pytest on the test
   files with our own ini file in a fresh ``/tmp`` (the repository's
   ``pytest.ini``/``tox.ini``/``setup.cfg``/``pyproject.toml`` are never
   read), ``--noconftest`` (no conftest.py is loaded), no cache provider and
   ``--import-mode=append``;
4. write ``{"started": true, "exit": N, "tests": {nodeid: outcome}}``.

A test counts as ``passed`` only when setup, call and teardown passed and it
was not an xfail/xpass. Imports nothing from mixrl: it runs on the bare
interpreter of the sandbox.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any

TESTBED = "/testbed"
PYSITE = "/opt/pysite"  # pytest, bound read only (-I ignores PYTHONPATH)


def _write(path: str, obj: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def _restore(tests_dir: str, rel: str) -> None:
    parts = rel.split("/")
    cur = TESTBED
    for p in parts[:-1]:  # every parent must be a real directory
        cur = os.path.join(cur, p)
        if os.path.islink(cur) or (os.path.lexists(cur) and not os.path.isdir(cur)):
            os.remove(cur)
        os.makedirs(cur, exist_ok=True)
    dst = os.path.join(TESTBED, rel)
    if os.path.islink(dst) or os.path.isfile(dst):
        os.remove(dst)
    elif os.path.isdir(dst):
        shutil.rmtree(dst)
    shutil.copyfile(os.path.join(tests_dir, rel), dst)


class _Collector:
    """Per-test outcome from the three report phases."""

    def __init__(self) -> None:
        self.tests: dict[str, str] = {}

    def pytest_runtest_logreport(self, report: Any) -> None:
        prev = self.tests.get(report.nodeid)
        if report.failed:
            self.tests[report.nodeid] = "error" if report.when != "call" else "failed"
        elif report.skipped:
            if prev in (None, "passed"):
                self.tests[report.nodeid] = "xfailed" if hasattr(report, "wasxfail") else "skipped"
        elif report.when == "call" and prev is None:
            self.tests[report.nodeid] = "xpassed" if hasattr(report, "wasxfail") else "passed"

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:
            self.tests[report.nodeid or "<collection>"] = "error"


def main(argv: list[str]) -> int:
    results_dir, tests_dir, test_files = argv[0], argv[1], argv[2:]
    job = os.path.join(results_dir, "job.txt")
    with open(job) as f:
        results = os.path.join(results_dir, os.path.basename(f.read().strip()))
    os.remove(job)
    for rel in test_files:
        _restore(tests_dir, rel)
    sys.path.insert(1, PYSITE)
    import pytest

    _write(results, {"started": True})
    ini = "/tmp/grader-pytest.ini"
    with open(ini, "w") as f:
        f.write("[pytest]\n")
    sys.path.append(TESTBED)
    os.chdir(TESTBED)
    col = _Collector()
    args = ["-c", ini, "--rootdir", TESTBED, "--noconftest", "-p", "no:cacheprovider",
            "--import-mode=append", "-q", "--no-header", *test_files]
    code = int(pytest.main(args, plugins=[col]))
    _write(results, {"started": True, "exit": code, "tests": col.tests})
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
