"""The oracle child; runs *inside* the grading sandbox as a script, imports the repository.

    python3 -I /opt/grader/oracle_child.py /grader/job.json

The job holds inputs only: ``{"imports": [...], "exprs": [...]}``. The expected values stay
in the grading process on the host, which this process cannot reach; what it writes is a
list of computed values, never a verdict. Order of work:

1. read the job, keep a private duplicate of stdout, point fds 0, 1 and 2 at ``/dev/null``
   (what the repository prints goes nowhere), write ``STARTED`` on the private fd: a child
   that gets this far was started by us, anything after is the repository's doing;
2. put ``/testbed`` last on ``sys.path``, run the imports, evaluate each expression;
3. write ``RESULT`` and one JSON list: per expression ``{"v": value}``, ``{"raised": [class
   names of the exception's MRO]}`` or ``{"error": why}`` (an import that failed, a value
   that cannot be encoded or is too large).

Values are encoded with their container types kept (a tuple is not a list): ``None``,
``bool``, ``int``, ``float``, ``str`` as JSON; ``{"t": [...]}`` tuple, ``[...]`` list,
``{"d": [[k, v], ...]}`` dict, ``{"s": [...]}`` set/frozenset, ``{"b": hex}`` bytes; only
exact built-in types (a subclass, whatever its ``__eq__``, is ``{"o": type name}``).

Imports nothing from mixrl: it runs on the bare interpreter of the sandbox.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

STARTED = "@@mixrl-oracle-started@@"
RESULT = "@@mixrl-oracle-result@@"
TESTBED = "/testbed"
MAX_VALUE_BYTES = 64 << 10  # one encoded value
MAX_NODES = 100_000  # containers and scalars walked per value


class TooLarge(Exception):
    pass


LOOSE_BASES = (int, float, str, bytes, list, tuple, dict, set, frozenset)


def _base(v: Any) -> type:
    """``type(v)``, or with ``loose`` the built-in base whose equality a subclass keeps
    (a namedtuple is a tuple, an ``IntEnum`` an int; a class with its own ``__eq__`` is not)."""
    t = type(v)
    if t in LOOSE_BASES or t is bool:
        return t
    for b in LOOSE_BASES:
        if isinstance(v, b) and t.__eq__ is b.__eq__:
            return b
    return t


def encode(v: Any, budget: list[int], depth: int = 0, loose: bool = False) -> Any:
    """``v`` as JSON with container types kept; ``loose``: subclasses that keep a built-in's
    equality are encoded as that built-in (the pytest form compares with Python's ``==``)."""
    budget[0] -= 1
    if budget[0] < 0 or depth > 64:
        raise TooLarge
    t = _base(v) if loose else type(v)
    if v is None or t is bool:
        return v
    if t is int:
        return int.__int__(v)
    if t is float:
        return float.__float__(v)
    if t is str:
        return str.__str__(v)
    if t in (list, tuple, set, frozenset):
        items = [encode(x, budget, depth + 1, loose) for x in t.__iter__(v)]
        return items if t is list else ({"t": items} if t is tuple else {"s": items})
    if t is dict:
        return {"d": [[encode(k, budget, depth + 1, loose), encode(x, budget, depth + 1, loose)]
                      for k, x in dict.items(v)]}
    if t is bytes:
        return {"b": bytes.hex(v)}
    return {"o": t.__name__}


def _one(expr: str, ns: dict[str, Any]) -> dict[str, Any]:
    try:
        value = eval(compile(expr, "<oracle>", "eval"), ns)  # the task's own expression
    except BaseException as e:  # noqa: BLE001 - SystemExit/KeyboardInterrupt are answers too
        return {"raised": [c.__name__ for c in type(e).__mro__]}
    try:
        out = {"v": encode(value, [MAX_NODES])}
        if len(json.dumps(out)) > MAX_VALUE_BYTES:
            return {"error": "value too large"}
        return out
    except (TooLarge, RecursionError, ValueError, TypeError):
        return {"error": "value too large or not encodable"}


def main(argv: list[str]) -> int:
    with open(argv[0]) as f:
        job = json.load(f)
    out = os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    out.write(STARTED + "\n")
    out.flush()
    sys.path.append(TESTBED)
    os.chdir(TESTBED)
    ns: dict[str, Any] = {}
    results: list[dict[str, Any]]
    try:
        for line in job["imports"]:
            exec(compile(line, "<oracle-imports>", "exec"), ns)  # the task's own import lines
    except BaseException as e:  # noqa: BLE001 - the repository does not import: every case fails
        results = [{"error": f"import failed: {type(e).__name__}"} for _ in job["exprs"]]
    else:
        results = [_one(expr, ns) for expr in job["exprs"]]
    out.write(RESULT + json.dumps(results) + "\n")
    out.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
