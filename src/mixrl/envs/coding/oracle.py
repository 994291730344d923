"""Oracle checks: values computed by the repository, judged by the grading process.

A task's ``oracle.toml`` (see ``loader.py``)::

    imports = ["from textkit.truncate import truncate"]
    [[case]]
    test = "tests/test_truncate.py::test_text_of_exact_width_is_kept"   # the check it belongs to
    expr = "truncate('hello', 5)"       # evaluated in the child, after the imports
    expect = "'hello'"                  # a Python literal (ast.literal_eval), or instead:
    # raises = "ValueError"             # the expression must raise this class (or a subclass)

The child (``oracle_child.py``, in the grading sandbox) receives the imports and the
expressions only, never ``expect``/``raises``; it answers with encoded values. This module
decodes them and compares: containers by exact type (a tuple is not a list), ``bool``
apart from ``int``, ``int`` and ``float`` by value (``3 == 3.0``), a ``float`` within
``1e-9`` relative, NaN equal to NaN. A check (``test``) passes iff all its cases pass.
"""

from __future__ import annotations

import ast
import math
from typing import Any

Case = dict[str, str]  # {"test", "expr", and "expect" or "raises"}


def parse_oracle(meta: dict[str, Any], where: str) -> dict[str, Any]:
    """Validate a parsed ``oracle.toml``; raises ``ValueError`` naming the field."""
    imports = meta.get("imports", [])
    if not isinstance(imports, list) or not all(isinstance(x, str) for x in imports):
        raise ValueError(f"{where}: imports must be a list of strings, got {imports!r}")
    for line in imports:
        try:
            compile(line, "<oracle-imports>", "exec")
        except SyntaxError as e:
            raise ValueError(f"{where}: import line {line!r} does not parse ({e.msg})") from None
    cases = meta.get("case")
    if not isinstance(cases, list) or not cases:
        raise ValueError(f"{where}: needs at least one [[case]]")
    out = []
    for i, c in enumerate(cases):
        if not isinstance(c, dict) or not all(isinstance(c.get(k), str) and c[k] for k in ("test", "expr")):
            raise ValueError(f"{where}: case {i} needs string fields test and expr, got {c!r}")
        if ("expect" in c) == ("raises" in c):
            raise ValueError(f"{where}: case {i} ({c['expr']!r}) needs exactly one of expect or raises")
        try:
            compile(c["expr"], "<oracle>", "eval")
            if "expect" in c:
                ast.literal_eval(c["expect"])
        except (SyntaxError, ValueError, TypeError) as e:
            raise ValueError(f"{where}: case {i}: expr or expect is not valid ({e})") from None
        if "raises" in c and not str(c["raises"]).isidentifier():
            raise ValueError(f"{where}: case {i}: raises must be an exception class name, got {c['raises']!r}")
        out.append({k: str(c[k]) for k in ("test", "expr", "expect", "raises") if k in c})
    return {"imports": list(imports), "cases": out}


def job(oracle: dict[str, Any]) -> dict[str, Any]:
    """What the child may see: the imports and the expressions, nothing expected."""
    return {"imports": oracle["imports"], "exprs": [c["expr"] for c in oracle["cases"]]}


class _Bad(Exception):
    pass


def decode(x: Any) -> Any:
    """The child's encoding back to Python values (see ``oracle_child.py``); ``_Bad`` if malformed."""
    if x is None or type(x) in (bool, int, float, str):
        return x
    if type(x) is list:
        return [decode(v) for v in x]
    if type(x) is dict and len(x) == 1:
        (k, v), = x.items()
        if k == "t" and type(v) is list:
            return tuple(decode(e) for e in v)
        if k == "d" and type(v) is list and all(type(p) is list and len(p) == 2 for p in v):
            return {decode(a): decode(b) for a, b in v}
        if k == "s" and type(v) is list:
            return {decode(e) for e in v}
        if k == "b" and type(v) is str:
            return bytes.fromhex(v)
    raise _Bad


def same(got: Any, want: Any) -> bool:
    """Equality with container types kept and ``bool`` apart from numbers."""
    num = (int, float)
    if type(got) in num and type(want) in num:
        if isinstance(got, float) or isinstance(want, float):
            return (math.isnan(got) and math.isnan(want)) or math.isclose(got, want, rel_tol=1e-9, abs_tol=0.0)
        return got == want
    if type(got) is not type(want):
        return False
    if isinstance(got, (list, tuple)):
        return len(got) == len(want) and all(same(a, b) for a, b in zip(got, want, strict=True))
    if isinstance(got, dict):
        return got.keys() == want.keys() and all(same(got[k], want[k]) for k in want)
    return bool(got == want)  # None, bool, str, bytes, set: built-in types only


def judge(oracle: dict[str, Any], results: Any) -> dict[str, str]:
    """Per check (``test``): ``passed`` iff every one of its cases matched, else ``failed``."""
    cases = oracle["cases"]
    ok = isinstance(results, list) and len(results) == len(cases)
    tests: dict[str, str] = {}
    for i, c in enumerate(cases):
        passed = False
        if ok and isinstance(results[i], dict):
            r = results[i]
            if "raises" in c:
                raised = r.get("raised")
                passed = isinstance(raised, list) and any(type(x) is str and x == c["raises"] for x in raised)
            elif "v" in r:
                try:
                    passed = same(decode(r["v"]), ast.literal_eval(c["expect"]))
                except Exception:  # noqa: BLE001 - _Bad, unhashable keys, too deep, MemoryError: failed
                    passed = False
        prev = tests.get(c["test"], "passed")
        tests[c["test"]] = "passed" if prev == "passed" and passed else "failed"
    return tests
