"""Hidden expectations for pytest-form grading: test files enter the sandbox without the
values they expect.

    checks, funcs = rewrite_function(fn, qual, rng)   # one test function, in place

Every top-level statement of a test function that checks something is rewritten into a
call that only *records* what the code computed (``pytest_runner.py`` sends it to the
runner's parent, which hands it to the grading process); what it should have computed is
kept here, in a ``Check``, and compared outside the sandbox (``results.py``):

- ``assert X <op> L`` (also chained, ``L1 < X <= L2``), where every operand but one is a
  literal (``ast.literal_eval``), ops ``== != < <= > >= in not in is is not``, a literal
  also ``pytest.approx(L, rel=.., abs=..)``: ``__mixrl_value__(ID, X)`` records ``X``
  (encoded with container types kept, ``oracle_child.encode``); here the comparison runs
  with Python's own operators on the decoded value (a value of a class of the
  repository's own, not a built-in or a subclass keeping the built-in's equality, fails);
- any other ``assert X`` / ``assert not X``: ``__mixrl_truth__(ID, X)`` records ``bool(X)``;
  truthy or falsy is expected here;
- ``with pytest.raises(E, match=L):`` (or ``raises(...)``; ``as info`` kept):
  ``with __mixrl_raises__(ID):`` records the class names of what the block raised and its
  message; ``E``'s name must be among them and ``re.search(L, message)`` hold.

``ID`` is a random check id, new each grading. What stays in the file is decided by
pytest's report only: statements nested in a branch, loop or ``try``, asserts whose
expected value is written as an expression rather than a literal, ``self.assertEqual``.
A test passes when pytest reports it passed *and* every one of its checks was recorded
and holds.
"""

from __future__ import annotations

import ast
import math
import operator
import random
import re
from dataclasses import dataclass, field
from typing import Any

VALUE, TRUTH, RAISES = "__mixrl_value__", "__mixrl_truth__", "__mixrl_raises__"
OPS: dict[type, Any] = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
    ast.Gt: operator.gt, ast.GtE: operator.ge, ast.Is: operator.is_, ast.IsNot: operator.is_not,
    ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
}
APPROX = ("approx",)  # pytest.approx / approx, with literal arguments


@dataclass
class Approx:
    """``pytest.approx(expected, rel, abs)`` evaluated here (numbers, sequences, dict values)."""
    want: Any
    rel: float | None = None
    abs: float | None = None

    def _one(self, got: Any, want: Any) -> bool:
        if type(got) is bool or type(want) is bool or not isinstance(got, (int, float)):
            return bool(got == want)
        if not isinstance(want, (int, float)):
            return False
        if math.isinf(want) or math.isnan(want):
            return bool(got == want)
        rel = 1e-6 if self.rel is None else self.rel
        tol = max(rel * abs(want), 1e-12 if self.abs is None else self.abs)
        return abs(got - want) <= tol

    def __eq__(self, got: object) -> bool:
        w = self.want
        if isinstance(w, dict):
            return isinstance(got, dict) and got.keys() == w.keys() and all(self._one(got[k], w[k]) for k in w)
        if isinstance(w, (list, tuple)):
            return (isinstance(got, (list, tuple)) and len(got) == len(w)
                    and all(self._one(a, b) for a, b in zip(got, w, strict=True)))
        return self._one(got, w)

    __hash__ = None  # type: ignore[assignment]


@dataclass
class Check:
    """What one recorded value must satisfy (never enters the sandbox)."""
    kind: str  # "value" | "truth" | "raises"
    func: str  # the test function's qualified name (``test_x`` or ``TestK.test_x``)
    ops: list[Any] = field(default_factory=list)  # value: the comparison chain's operators
    operands: list[Any] = field(default_factory=list)  # value: literal values, ``None`` at ``slot``
    slot: int = 0  # value: where the recorded value goes in the chain
    truthy: bool = True  # truth: what bool(X) must be
    exc: list[str] = field(default_factory=list)  # raises: accepted class names
    match: str | None = None  # raises: a regex the message must contain

    def holds(self, payload: Any) -> bool:
        """Does the recorded ``payload`` satisfy this check? Never raises (``results.py``
        decodes the value first and treats any exception as a failed check)."""
        if self.kind == "truth":
            return payload.get("t") is self.truthy
        if self.kind == "raises":
            names, msg = payload.get("raised"), payload.get("msg", "")
            if not isinstance(names, list) or not any(e in names for e in self.exc):
                return False
            return self.match is None or (isinstance(msg, str) and re.search(self.match, msg) is not None)
        vals = list(self.operands)
        vals[self.slot] = payload["value"]
        return all(bool(op(vals[i], vals[i + 1])) for i, op in enumerate(self.ops))


def _literal(node: ast.expr) -> tuple[bool, Any]:
    """(True, value) when ``node`` is a literal or ``approx(<literals>)``."""
    if isinstance(node, ast.Call) and _called(node.func) in APPROX and len(node.args) == 1:
        ok, want = _literal(node.args[0])
        kw = {}
        for k in node.keywords:
            good, v = _literal(k.value)
            if not good or k.arg not in ("rel", "abs") or not isinstance(v, (int, float)):
                return False, None
            kw[k.arg] = v
        return (True, Approx(want, **kw)) if ok and not isinstance(want, Approx) else (False, None)
    if isinstance(node, ast.Name):  # True/False/None are Constants; a bare name is computed
        return False, None
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def _called(func: ast.expr) -> str:
    """``pytest.raises`` -> ``raises``; ``raises`` -> ``raises``; anything else ''."""
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "pytest":
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def _exc_names(node: ast.expr) -> list[str] | None:
    items = node.elts if isinstance(node, ast.Tuple) else [node]
    names = []
    for it in items:
        if isinstance(it, ast.Name):
            names.append(it.id)
        elif isinstance(it, ast.Attribute):
            names.append(it.attr)
        else:
            return None
    return names or None


def _call(name: str, cid: str, arg: ast.expr | None = None) -> ast.Call:
    args: list[ast.expr] = [ast.Constant(cid)] + ([arg] if arg is not None else [])
    return ast.Call(ast.Name(name, ast.Load()), args, [])


def new_id(rng: random.Random) -> str:
    return f"{rng.getrandbits(64):016x}"


def _assert(st: ast.Assert, func: str, rng: random.Random) -> tuple[ast.stmt, str, Check] | None:
    t, cid = st.test, new_id(rng)
    if isinstance(t, ast.Compare) and all(type(o) in OPS for o in t.ops):
        nodes = [t.left, *t.comparators]
        lits = [_literal(n) for n in nodes]
        computed = [i for i, (ok, _) in enumerate(lits) if not ok]
        if len(computed) == 1:
            slot = computed[0]
            ops = [OPS[type(o)] for o in t.ops]
            chk = Check("value", func, ops=ops, operands=[v for _, v in lits], slot=slot)
            return ast.Expr(_call(VALUE, cid, nodes[slot])), cid, chk
        if not computed:
            return None  # a constant assert: left to pytest
    truthy = True
    while isinstance(t, ast.UnaryOp) and isinstance(t.op, ast.Not):
        t, truthy = t.operand, not truthy
    return ast.Expr(_call(TRUTH, cid, t)), cid, Check("truth", func, truthy=truthy)


def _raises(st: ast.With, func: str, rng: random.Random) -> tuple[ast.stmt, str, Check] | None:
    if len(st.items) != 1 or not isinstance(st.items[0].context_expr, ast.Call):
        return None
    call = st.items[0].context_expr
    if _called(call.func) != "raises" or len(call.args) != 1 or (names := _exc_names(call.args[0])) is None:
        return None
    match = None
    for k in call.keywords:
        ok, v = _literal(k.value)
        if k.arg != "match" or not ok or not isinstance(v, str):
            return None
        match = v
    cid = new_id(rng)
    item = ast.withitem(_call(RAISES, cid), st.items[0].optional_vars)
    return ast.With([item], st.body), cid, Check("raises", func, exc=names, match=match)


def rewrite_function(fn: ast.FunctionDef, func: str, rng: random.Random) -> dict[str, Check]:
    """Rewrite ``fn``'s top-level checks in place; returns {check id: Check} in body order."""
    checks: dict[str, Check] = {}
    body = []
    for st in fn.body:
        got = None
        if isinstance(st, ast.Assert):
            got = _assert(st, func, rng)
        elif isinstance(st, ast.With):
            got = _raises(st, func, rng)
        if got is None:
            body.append(st)
            continue
        new, cid, chk = got
        body.append(ast.copy_location(new, st))
        checks[cid] = chk
    fn.body = body or [ast.Pass()]
    return checks


def ends_early(fn: ast.FunctionDef) -> bool:
    """Can ``fn`` return before its last top-level statement, or be run by something other
    than pytest (a decorator not under ``pytest.mark``)? Then a check may honestly be missing."""
    for d in fn.decorator_list:
        d = d.func if isinstance(d, ast.Call) else d
        if not (isinstance(d, ast.Attribute) and ast.unparse(d).startswith("pytest.mark.")):
            return True
    stack: list[ast.AST] = list(fn.body)
    while stack:
        n = stack.pop()
        if isinstance(n, (ast.Return, ast.Yield, ast.YieldFrom, ast.Await)):
            return True
        if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(n))
    return False
