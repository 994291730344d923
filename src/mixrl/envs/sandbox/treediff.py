"""The episode's diff, computed *inside* a sandbox by the sandbox's Python (``-I -S``).

The script gets ``a/`` (snapshot) and ``b/`` (work) read only in its cwd. It walks both
trees with an explicit stack (a 1,500-level tree cannot raise ``RecursionError``), never
follows a link, skips every path it cannot stat or open (too long, unreadable) instead of
failing, and asks GNU diff for each changed regular UTF-8 text file. What never becomes
part of a patch (``DIFF_EXCLUDES``): caches, version control, and every packaging or
import-time hook the grader's interpreter could pick up from the repository
(``*.dist-info`` and ``*.egg-info`` entry points, ``*.pth``, ``*.egg-link``,
``sitecustomize.py``, ``usercustomize.py``).
"""

from __future__ import annotations

DIFF_EXCLUDES = ("__pycache__", "*.pyc", ".pytest_cache", ".git", ".hypothesis", "*.egg-info", "*.dist-info",
                 "*.pth", "*.egg-link", "sitecustomize.py", "usercustomize.py")
MAX_PATH = 3800  # longer relative paths are left out (diff and patch need them under PATH_MAX)

TREEDIFF = r"""
import fnmatch, os, stat, subprocess, sys
MAX_PATH = {max_path}
pats = sys.argv[1].split(",")
def skip(n):
    return any(fnmatch.fnmatch(n, p) for p in pats)
def files(root):
    out, stack = {}, [root]
    while stack:
        d = stack.pop()
        try:
            with os.scandir(d) as it:
                entries = list(it)
        except OSError:
            continue
        for e in entries:
            if skip(e.name) or len(e.path) > MAX_PATH:
                continue
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                stack.append(e.path)
            elif stat.S_ISREG(st.st_mode) and "\n" not in e.path and "\t" not in e.path:
                out[os.path.relpath(e.path, root)] = e.path
    return out
def text(p):
    if p is None:
        return b""
    try:
        with open(p, "rb") as f:
            data = f.read()
        data.decode("utf-8")
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return None if b"\0" in data else data
a, b = files("a"), files("b")
for rel in sorted(set(a) | set(b)):
    ta, tb = text(a.get(rel)), text(b.get(rel))
    if ta is None or tb is None or ta == tb:
        continue
    sys.stdout.flush()
    subprocess.run(["diff", "-u", "--label", "a/" + rel, "--label", "b/" + rel,
                    a.get(rel, "/dev/null"), b.get(rel, "/dev/null")], stderr=subprocess.DEVNULL)
""".replace("{max_path}", str(MAX_PATH))
