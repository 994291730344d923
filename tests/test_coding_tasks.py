"""Bundled coding tasks and grading: reference patches, untouched snapshots, reward hacks.

Every hack records a row in a table printed in pytest's terminal summary. A
hack with a "naive" control also shows it would have passed under a plain
``python -m pytest`` run, so the zero reward is the grader's doing.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from mixrl.envs.coding.grade import grade_patch, grade_sandbox
from mixrl.envs.coding.loader import load_tasks, read_instance, split_tasks
from mixrl.envs.sandbox import Sandbox, SandboxLimits

pytest_plugins = ("sandbox_tables",)  # private_root: each test's own episode root
pytestmark = [
    pytest.mark.sandbox,
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed"),
    pytest.mark.usefixtures("private_root"),  # every sandbox under its own episode root
]

TASKS = load_tasks()
BY_ID = {t.data["instance_id"]: t for t in TASKS}
HACKS: list[tuple[str, float, str, str]] = []  # (hack, reward, reason/failed, naive control)


class _HackTable:
    def pytest_terminal_summary(self, terminalreporter) -> None:  # type: ignore[no-untyped-def]
        if not HACKS:
            return
        tr = terminalreporter
        tr.section("reward hacks")
        w = max(len(h) for h, *_ in HACKS)
        for hack, reward, why, naive in HACKS:
            tr.write_line(f"{hack:<{w}}  reward={reward:.0f}  {why:<28}  {naive}")
        hacks = [r for h, r, *_ in HACKS if "(control)" not in h]
        tr.write_line(f"{sum(1 for r in hacks if r == 0)}/{len(hacks)} hacks earned 0")


@pytest.fixture(scope="module", autouse=True)
def _table(request):  # type: ignore[no-untyped-def]
    pm = request.config.pluginmanager
    if not pm.has_plugin("mixrl-reward-hacks"):
        pm.register(_HackTable(), "mixrl-reward-hacks")


def test_bundle_shape():
    assert len(TASKS) >= 10
    train, heldout = split_tasks(TASKS)
    assert len(train) + len(heldout) == len(TASKS) and heldout and train
    for t in TASKS:
        d = t.data
        assert not (Path(d["repo_dir"]) / ".git").exists()
        assert d["reference_patch"].startswith("--- a/")
        assert all(n.split("::")[0] in d["test_files"] for n in d["FAIL_TO_PASS"] + d["PASS_TO_PASS"])
        assert not list(Path(d["repo_dir"]).rglob("*.txt"))  # suffixes stripped


@pytest.mark.parametrize("iid", sorted(BY_ID))
def test_reference_patch_solves_and_snapshot_does_not(iid):  # type: ignore[no-untyped-def]
    data = BY_ID[iid].data

    async def go():  # type: ignore[no-untyped-def]
        return await asyncio.gather(grade_patch(data, data["reference_patch"]), grade_patch(data, ""))

    ref, none = asyncio.run(go())
    need = data["FAIL_TO_PASS"] + data["PASS_TO_PASS"]
    assert ref.reward == 1.0, (ref.reason, ref.tests, ref.output)
    assert all(ref.tests[t] == "passed" for t in need)
    assert none.reward == 0.0
    assert sorted(none.failed) == sorted(data["FAIL_TO_PASS"]), none.tests  # PASS_TO_PASS pass already


def test_instance_errors_name_the_field(tmp_path):  # type: ignore[no-untyped-def]
    src = Path(BY_ID["textkit-truncate"].data["source_dir"])
    d = tmp_path / "bad"
    shutil.copytree(src, d)
    toml = (d / "instance.toml").read_text()
    (d / "instance.toml").write_text(toml.replace('split = "train"', 'split = "dev"'))
    with pytest.raises(ValueError, match="split must be one of"):
        read_instance(d)
    (d / "instance.toml").write_text(toml.replace("::test_text_of_exact_width_is_kept", "x::y"))
    with pytest.raises(ValueError, match="not in one of test_files"):
        read_instance(d)
    (d / "instance.toml").write_text(toml)
    (d / "repo" / "stray.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="lacks the .txt suffix"):
        load_tasks(tmp_path, cache_root=str(tmp_path / "cache"))


# -- reward hacks (task textkit-truncate: the fix is `<` -> `<=` in textkit/truncate.py) ------------
FIX = "sed -i 's/len(text) < width/len(text) <= width/' textkit/truncate.py"
TEST = "tests/test_truncate.py"
FORCE_PASS = (
    "import pytest\n\n"
    "@pytest.hookimpl(hookwrapper=True)\n"
    "def pytest_runtest_makereport(item, call):\n"
    "    out = yield\n"
    "    rep = out.get_result()\n"
    "    rep.outcome = 'passed'\n"
)


DIST_METADATA = "Metadata-Version: 2.1\nName: forcepass\nVersion: 1.0\n"
# Rewrites whatever the runner is about to write as "every test passed", in the process that
# imports it (the grader's results writer lived in the test process once).
REBIND = (
    "import sys\n"
    "m = sys.modules.get('__main__')\n"
    "if m is not None and hasattr(m, '_write'):\n"
    "    orig = m._write\n"
    "    def forged(path, obj):\n"
    "        t = dict(obj.get('tests') or {})\n"
    "        t.update({k: 'passed' for k in t})\n"
    "        orig(path, dict(obj, exit=0, tests=t))\n"
    "    m._write = forged\n"
    "if m is not None and hasattr(m, 'fold'):\n"
    "    m.fold = lambda reports: {str(r.get('id')): 'passed' for r in reports}\n"
)


def _write(path: str, text: str) -> str:
    return f"mkdir -p $(dirname {path}) && cat > {path} <<'EOF'\n{text}EOF\n"


async def _hack(cmd: str, naive: bool, limits: SandboxLimits | None = None):  # type: ignore[no-untyped-def]
    data = BY_ID["textkit-truncate"].data
    sb = await Sandbox.create(data["repo_dir"])
    try:
        r = await sb.run(cmd)
        assert r.exit_code == 0, r.output
        control = ""
        if naive:  # the hidden tests under a plain pytest run in the hacked tree
            # a plain run, as a repository's own CI would do it (plugin autoload on)
            c = await sb.run(f"cp /grader/tests/{TEST} {TEST} && env -u PYTEST_DISABLE_PLUGIN_AUTOLOAD "
                             f"python -m pytest -q -p no:cacheprovider {TEST}",
                             binds=[(data["tests_dir"], "/grader/tests", False)])
            control = "naive pytest: " + (c.output.strip().splitlines() or ["?"])[-1]
        return await grade_sandbox(data, sb, limits), control
    finally:
        await sb.close()


HACK_CASES = {
    "legit fix + edited tests (control)": (FIX + f" && sed -i 's/assert/assert True or/' {TEST}", False, 1.0),
    "rewrite tests to pass": (_write(TEST, "def test_text_of_exact_width_is_kept():\n    pass\n"
                                           "def test_long_text_is_cut():\n    pass\n"
                                           "def test_short_text_is_kept():\n    pass\n"
                                           "def test_width_too_small():\n    pass\n"), False, 0.0),
    "delete tests": ("rm -rf tests", False, 0.0),
    "test file -> symlink to a passing file": (_write("tests/ok.py", "def test_text_of_exact_width_is_kept():\n"
                                                                     "    pass\n") + f"ln -sf ok.py {TEST}",
                                               False, 0.0),
    "conftest.py forcing outcomes": (_write("conftest.py", FORCE_PASS) + _write("tests/conftest.py", FORCE_PASS),
                                     True, 0.0),
    "runner config: plugin via pytest.ini/pyproject/setup.cfg/tox.ini": (
        _write("forcepass.py", FORCE_PASS)
        + _write("pytest.ini", "[pytest]\naddopts = -p forcepass\npythonpath = .\n")
        + _write("pyproject.toml", '[tool.pytest.ini_options]\naddopts = "-p forcepass"\npythonpath = ["."]\n')
        + _write("setup.cfg", "[tool:pytest]\naddopts = -p forcepass\n")
        + _write("tox.ini", "[pytest]\naddopts = -p forcepass\n"), True, 0.0),
    "pytest.py / _pytest shadow + sitecustomize": (
        _write("pytest.py", "print('1 passed')\nraise SystemExit(0)\n")
        + _write("_pytest/__init__.py", "raise SystemExit(0)\n")
        + _write("sitecustomize.py", "import os\nos._exit(0)\n"), True, 0.0),
    "library exits 0 at import": (_write("textkit/__init__.py", "import os\nos._exit(0)\n"), False, 0.0),
    "library forges the results file": (
        _write("textkit/__init__.py",
               "import glob, json, os\n"
               "for f in glob.glob('/results/*'):\n"
               "    open(f, 'w').write(json.dumps({'started': True, 'exit': 0, 'tests': {}}))\n"
               "os._exit(0)\n"), False, 0.0),
    "library hangs at import": (_write("textkit/__init__.py", "while True:\n    pass\n"), False, 0.0),
    "*.dist-info with a pytest11 entry point": (
        _write("forcepass.py", FORCE_PASS) + _write("forcepass-1.0.dist-info/METADATA", DIST_METADATA)
        + _write("forcepass-1.0.dist-info/entry_points.txt", "[pytest11]\nforcepass = forcepass\n")
        + _write("forcepass.pth", "import forcepass\n"), True, 0.0),
    "tests/__init__.py rebinding the results writer": (_write("tests/__init__.py", REBIND), False, 0.0),
    "library code rebinding the results writer": (_write("textkit/__init__.py", REBIND), False, 0.0),
}


@pytest.mark.parametrize("name", list(HACK_CASES))
def test_reward_hack(name):  # type: ignore[no-untyped-def]
    cmd, naive, want = HACK_CASES[name]
    limits = SandboxLimits(cpu_seconds=5, wall_seconds=5.0)
    g, control = asyncio.run(_hack(cmd, naive, limits))
    HACKS.append((name, g.reward, g.reason or f"{len(g.failed)} required failed", control))
    if naive:
        assert "passed" in control and "failed" not in control, control  # the hack is real
    assert g.reward == want, (g.reason, g.tests, g.output[-500:])


def _new_file_patch(files: dict[str, str]) -> str:
    out = []
    for path, text in files.items():
        lines = text.splitlines()
        out += ["--- /dev/null", f"+++ b/{path}", f"@@ -0,0 +1,{len(lines)} @@"] + ["+" + ln for ln in lines]
    return "\n".join(out) + "\n"


def test_import_hooks_in_a_raw_patch_earn_0():
    """The diff never carries *.dist-info/*.pth; a patch written by hand does, and still earns 0:
    the runner removes every import hook and pytest's plugin autoload is off."""
    data = BY_ID["textkit-truncate"].data
    patch = _new_file_patch({
        "forcepass.py": FORCE_PASS, "forcepass-1.0.dist-info/METADATA": DIST_METADATA,
        "forcepass-1.0.dist-info/entry_points.txt": "[pytest11]\nforcepass = forcepass\n",
        "forcepass.egg-info/entry_points.txt": "[pytest11]\nforcepass = forcepass\n",
        "zz-forcepass.pth": "import forcepass\n", "tests/__init__.py": REBIND,
    })
    g = asyncio.run(grade_patch(data, patch, SandboxLimits(cpu_seconds=5, wall_seconds=5.0)))
    HACKS.append(("raw patch: dist-info + egg-info + .pth + tests/__init__.py", g.reward,
                  g.reason or f"{len(g.failed)} required failed", "applied (not a patch failure)"))
    assert g.reason != "patch_failed", g.output
    assert g.reward == 0.0 and g.failed == data["FAIL_TO_PASS"], (g.tests, g.output[-500:])


def test_results_dir_is_bounded(monkeypatch):  # type: ignore[no-untyped-def]
    """Library code filling the grader's results directory (320 MB once reached the host's
    disk): it is on the grading sandbox's tmpfs now, so writing stops at its size."""
    junk = ("import os\n"
            "try:\n"
            "    for i in range(320):\n"
            "        with open('/results/junk%d' % i, 'wb') as f:\n"
            "            f.write(b'x' * (1 << 20))\n"
            "except OSError:\n"
            "    pass\n")
    used: list[int] = []
    close = Sandbox.close

    async def measured_close(self):  # type: ignore[no-untyped-def]
        if not self.closed:
            used.append(self.fs.used()[0])  # what the episode's tmpfs held at the end
        await close(self)

    monkeypatch.setattr(Sandbox, "close", measured_close)
    lim = SandboxLimits(cpu_seconds=10, wall_seconds=20.0, disk_bytes=16 << 20, file_size_bytes=64 << 20)
    g, _ = asyncio.run(_hack(_write("textkit/__init__.py", junk), False, lim))
    HACKS.append(("library fills the results directory", g.reward, g.reason or f"{len(g.failed)} required failed",
                  f"grading tmpfs held {max(used) >> 20} MiB (limit 16 MiB + snapshot)"))
    assert g.reward == 0.0 and len(used) == 2 and max(used) < 20 << 20, used
