"""Bundled coding tasks: reference patches and untouched snapshots in both grading forms,
the time limit each task records, instance validation, hidden assets.

The reward hacks are in ``test_coding_hacks.py``.
"""

from __future__ import annotations

import asyncio
import re
import shutil
from pathlib import Path

import pytest

from mixrl.envs.coding import CodingEnv
from mixrl.envs.coding import grade as grade_mod
from mixrl.envs.coding.grade import grade_limit, grade_patch
from mixrl.envs.coding.loader import ensure_hidden, load_tasks, read_instance, split_tasks
from mixrl.envs.sandbox.runtime import visible_host_paths
from mixrl.records.task import Task

pytest_plugins = ("sandbox_tables",)  # private_root: each test's own episode root
pytestmark = [
    pytest.mark.sandbox,
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed"),
    pytest.mark.usefixtures("private_root"),  # every sandbox under its own episode root
]

TASKS = load_tasks()
BY_ID = {t.data["instance_id"]: t for t in TASKS}


def pytest_form(data: dict) -> dict:  # type: ignore[type-arg]
    """The same task graded by its hidden pytest files (a user's SWE-style task)."""
    return {k: v for k, v in data.items() if k != "oracle"}


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
        assert d["oracle"]["cases"] and 0 < d["reference_seconds"] < 5, d["instance_id"]
        # every required check has oracle cases, and no oracle case is outside them
        assert {c["test"] for c in d["oracle"]["cases"]} == set(d["FAIL_TO_PASS"] + d["PASS_TO_PASS"])


@pytest.mark.parametrize("iid", sorted(BY_ID))
def test_reference_patch_solves_and_snapshot_does_not(iid):  # type: ignore[no-untyped-def]
    """Both forms: the reference earns 1 (every canary of the pytest form reported failed, so
    never ``reward_hacked``), the untouched snapshot 0 with exactly FAIL_TO_PASS failing;
    the reference grades well within the task's time limit."""
    data = BY_ID[iid].data

    async def go():  # type: ignore[no-untyped-def]
        return [await grade_patch(d, p) for d in (data, pytest_form(data)) for p in (data["reference_patch"], "")]

    ref, none, pref, pnone = asyncio.run(go())
    need = data["FAIL_TO_PASS"] + data["PASS_TO_PASS"]
    for r, n in ((ref, none), (pref, pnone)):
        assert (r.reward, r.status) == (1.0, "ok"), (r.reason, r.tests, r.output)
        assert all(r.tests[t] == "passed" for t in need)
        assert (n.reward, n.status) == (0.0, "ok")
        assert sorted(n.failed) == sorted(data["FAIL_TO_PASS"]), n.tests  # PASS_TO_PASS pass already
    assert pref.canaries and all(pref.tests[c] == "failed" for c in pref.canaries), pref.tests
    assert set(pref.canaries).isdisjoint(need)
    limit = asyncio.run(grade_limit(data))
    assert limit == max(grade_mod.GRADE_FLOOR_S, grade_mod.GRADE_FACTOR * data["reference_seconds"])
    assert ref.seconds < limit and pref.seconds < limit, (ref.seconds, pref.seconds, limit)


def test_reference_time_is_measured_when_not_recorded(monkeypatch):  # type: ignore[no-untyped-def]
    """A user task without ``reference_seconds``: its reference is graded once, timed."""
    data = dict(BY_ID["mathx-clamp"].data)
    del data["reference_seconds"]
    monkeypatch.setattr(grade_mod, "MEASURED_REFERENCE_S", {})
    calls = []
    real = grade_mod.grade_patch

    async def counted(*a, **k):  # type: ignore[no-untyped-def]
        calls.append(k.get("timeout"))
        return await real(*a, **k)

    monkeypatch.setattr(grade_mod, "grade_patch", counted)

    async def go():  # type: ignore[no-untyped-def]
        return await grade_mod.grade_limit(data), await grade_mod.grade_limit(data)

    first, second = asyncio.run(go())
    assert calls == [grade_mod.CALIBRATION_S]  # measured once, with the generous limit
    assert first == second == max(grade_mod.GRADE_FLOOR_S, grade_mod.GRADE_FACTOR * next(iter(grade_mod.MEASURED_REFERENCE_S.values())))
    bad = dict(data, reference_patch="")  # a reference that does not pass cannot set a limit
    monkeypatch.setattr(grade_mod, "MEASURED_REFERENCE_S", {})
    with pytest.raises(grade_mod.SandboxError, match="reference patch does not pass"):
        asyncio.run(grade_mod.grade_limit(bad))


def test_hidden_assets_check():
    """Task files under a path every sandbox mounts read only are refused before anything runs."""
    for t in TASKS:
        ensure_hidden(t.data)  # the bundled ones, where this checkout keeps them
    for mount in visible_host_paths():
        data = dict(BY_ID["mathx-clamp"].data, source_dir=f"{mount}/lib/python3/dist-packages/mixrl/tasks/x")
        with pytest.raises(ValueError, match="sandbox mounts read only"):
            ensure_hidden(data)
    data = dict(BY_ID["mathx-clamp"].data, tests_dir="/usr/share/mixrl/tests")
    with pytest.raises(ValueError, match="tests_dir"):
        asyncio.run(grade_patch(data, ""))
    with pytest.raises(ValueError, match="tests_dir"):  # an episode refuses to start
        CodingEnv(Task("coding/x", "coding", "train", data), chat=None)  # type: ignore[arg-type]


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
    (d / "instance.toml").write_text(re.sub(r"reference_seconds = [0-9.]+", "reference_seconds = -1", toml))
    with pytest.raises(ValueError, match="reference_seconds must be"):
        read_instance(d)
    (d / "instance.toml").write_text(toml)
    orc = (d / "oracle.toml").read_text()
    (d / "oracle.toml").write_text(orc.replace('expect = "\'hello\'"', 'raises = "ValueError"\nexpect = "1"'))
    with pytest.raises(ValueError, match="exactly one of expect or raises"):
        read_instance(d)
    (d / "oracle.toml").write_text(orc.replace("test_text_of_exact_width_is_kept", "test_other"))
    with pytest.raises(ValueError, match="no case for"):
        read_instance(d)
    (d / "oracle.toml").write_text(orc)
    (d / "repo" / "stray.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="lacks the .txt suffix"):
        load_tasks(tmp_path, cache_root=str(tmp_path / "cache"))


