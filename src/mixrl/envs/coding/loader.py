"""SWE-bench-like task instances: loading, validation, train/held-out split.

One instance is a directory (the bundled ones live in ``tasks/``)::

    <instance_id>/
      instance.toml      instance_id, split, problem_statement, test_command,
                         FAIL_TO_PASS, PASS_TO_PASS (check ids), test_files, and
                         reference_seconds (the reference's grading time; optional)
      oracle.toml        optional: the checks in oracle form (``oracle.py``); the task
                         is then graded by them, not by running test_files
      reference.patch    a unified diff (``-p1``, ``a/`` ``b/``) that solves it
      repo/              the repository snapshot, no version-control history
      test_files/        the test files restored at grading (paths as in test_files)

Reference patches, oracles and hidden tests must stay invisible to the sandbox:
``ensure_hidden`` refuses a task whose files lie under a path every sandbox mounts read
only (``/usr``, the interpreter's prefix, pytest's packages) — mixrl installed under
``/usr``, say. ``CodingEnv`` and the grader call it before anything runs.

Every file under ``repo/`` and ``test_files/`` carries an extra ``.txt``
suffix, stripped when the instance is materialized: the buggy code then ships
as package data and is never imported, linted or collected by the project's
own tools. ``load_tasks`` materializes each instance once per content hash
under the temporary directory (world readable: the sandbox user reads it).

    tasks = load_tasks()                  # bundled, as mixrl Tasks (family "coding")
    train, heldout = split_tasks(tasks)
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import tomllib
from pathlib import Path
from typing import Any

from mixrl.envs.coding.oracle import parse_oracle
from mixrl.envs.sandbox.runtime import visible_in_sandbox
from mixrl.records.task import Task

TASKS_DIR = Path(__file__).with_name("tasks")
SUFFIX = ".txt"
SPLITS = ("train", "heldout")


def _fail(where: Path, msg: str) -> ValueError:
    return ValueError(f"coding task {where}: {msg}")


def _str_list(meta: dict[str, Any], key: str, where: Path, allow_empty: bool = True) -> list[str]:
    v = meta.get(key)
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v) or (not v and not allow_empty):
        raise _fail(where, f"{key} must be a {'non-empty ' if not allow_empty else ''}list of strings, got {v!r}")
    return list(v)


def _safe_rel(p: str, where: Path, key: str) -> str:
    parts = p.split("/")
    if p.startswith("/") or any(x in ("", ".", "..") for x in parts):
        raise _fail(where, f"{key} path {p!r} must be relative, without '.', '..' or '//'")
    return p


def read_instance(d: Path) -> dict[str, Any]:
    """Parse and check one instance directory (not yet materialized)."""
    meta_path = d / "instance.toml"
    if not meta_path.is_file():
        raise _fail(d, "missing instance.toml")
    meta = tomllib.loads(meta_path.read_text())
    for key in ("instance_id", "problem_statement", "test_command"):
        if not isinstance(meta.get(key), str) or not meta[key].strip():
            raise _fail(d, f"{key} must be a non-empty string, got {meta.get(key)!r}")
    split = meta.get("split", "train")
    if split not in SPLITS:
        raise _fail(d, f"split must be one of {SPLITS}, got {split!r}")
    f2p = _str_list(meta, "FAIL_TO_PASS", d, allow_empty=False)
    p2p = _str_list(meta, "PASS_TO_PASS", d)
    test_files = [_safe_rel(t, d, "test_files") for t in _str_list(meta, "test_files", d, allow_empty=False)]
    for node in f2p + p2p:
        if node.split("::")[0] not in test_files:
            raise _fail(d, f"test {node!r} is not in one of test_files {test_files}")
    for t in test_files:
        if not (d / "test_files" / (t + SUFFIX)).is_file():
            raise _fail(d, f"test_files/{t}{SUFFIX} is missing")
    if not (d / "repo").is_dir() or (d / "repo" / ".git").exists():
        raise _fail(d, "repo/ must be a directory without version-control history")
    ref = d / "reference.patch"
    if not ref.is_file():
        raise _fail(d, "missing reference.patch")
    ref_s = meta.get("reference_seconds")
    if ref_s is not None and (isinstance(ref_s, bool) or not isinstance(ref_s, (int, float)) or not 0 < ref_s <= 600):
        raise _fail(d, f"reference_seconds must be a number in (0, 600], got {ref_s!r}")
    out = {
        "instance_id": meta["instance_id"], "split": split, "problem_statement": meta["problem_statement"],
        "test_command": meta["test_command"], "FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p,
        "test_files": test_files, "reference_patch": ref.read_text(), "source_dir": str(d),
    }
    if ref_s is not None:
        out["reference_seconds"] = float(ref_s)
    if (d / "oracle.toml").is_file():
        orc = parse_oracle(tomllib.loads((d / "oracle.toml").read_text()), f"coding task {d}: oracle.toml")
        missing = set(f2p + p2p) - {c["test"] for c in orc["cases"]}
        if missing:
            raise _fail(d, f"oracle.toml has no case for {sorted(missing)[:4]}")
        out["oracle"] = orc
    return out


def ensure_hidden(data: dict[str, Any]) -> None:
    """Raise ``ValueError`` when the task's hidden files would be readable inside a sandbox."""
    for key in ("source_dir", "tests_dir"):
        p = data.get(key)
        mount = visible_in_sandbox(p) if p else None
        if mount is not None:
            raise ValueError(f"coding task {data.get('instance_id')!r}: {key} {p} lies under {mount}, which every "
                             "sandbox mounts read only, so the model could read the reference patch and the hidden "
                             "checks; install mixrl (or put the tasks) outside it")


def _copy_stripped(src: Path, dst: Path) -> None:
    for p in sorted(src.rglob("*")):
        if p.is_symlink():
            raise _fail(src, f"symlinks are not allowed in a task ({p})")
        rel = p.relative_to(src).as_posix()
        out = dst / (rel[: -len(SUFFIX)] if p.is_file() and rel.endswith(SUFFIX) else rel)
        if p.is_dir():
            out.mkdir(parents=True, exist_ok=True)
            os.chmod(out, 0o755)
        else:
            if not rel.endswith(SUFFIX):
                raise _fail(src, f"file {rel!r} lacks the {SUFFIX} suffix")
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(p, out)
            os.chmod(out, 0o644)


def _digest(d: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(d.rglob("*")):
        if p.is_file():
            h.update(p.relative_to(d).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def materialize(d: Path, cache_root: str | None = None) -> tuple[str, str]:
    """(repo_dir, tests_dir) of instance ``d`` with suffixes stripped; cached by content hash."""
    root = Path(cache_root or tempfile.gettempdir()) / f"mixrl-coding-{os.geteuid()}"
    root.mkdir(mode=0o755, parents=True, exist_ok=True)
    st = os.lstat(root)
    if not os.path.isdir(root) or os.path.islink(root) or st.st_uid != os.geteuid():
        raise _fail(d, f"cache directory {root} is not ours; pass cache_root")
    os.chmod(root, 0o755)
    target = root / f"{d.name}-{_digest(d)}"
    if not target.is_dir():
        tmp = Path(tempfile.mkdtemp(prefix=f".{d.name}-", dir=root))
        _copy_stripped(d / "repo", tmp / "repo")
        _copy_stripped(d / "test_files", tmp / "tests")
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, target)
        except OSError:  # another process won the race: same content
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target / "repo"), str(target / "tests")


def load_tasks(dir: str | os.PathLike[str] | None = None, cache_root: str | None = None) -> list[Task]:
    """All instances under ``dir`` (default: the bundled ones), sorted by instance_id."""
    base = Path(dir) if dir is not None else TASKS_DIR
    if not base.is_dir():
        raise ValueError(f"load_tasks: dir {str(base)!r} is not a directory")
    tasks, seen = [], set()
    for d in sorted(p for p in base.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))):
        data = read_instance(d)
        if data["instance_id"] in seen:
            raise _fail(d, f"duplicate instance_id {data['instance_id']!r}")
        seen.add(data["instance_id"])
        data["repo_dir"], data["tests_dir"] = materialize(d, cache_root)
        tasks.append(Task(prompt_id=f"coding/{data['instance_id']}", family="coding", split=data["split"],
                          data=data))
    return sorted(tasks, key=lambda t: t.data["instance_id"])


def split_tasks(tasks: list[Task]) -> tuple[list[Task], list[Task]]:
    """(train, heldout) by each instance's declared ``split`` (fixed in the data, so stable)."""
    return [t for t in tasks if t.split == "train"], [t for t in tasks if t.split == "heldout"]
