"""Oracle checks, hidden expectations and canary tests, without a sandbox: encoding,
comparison, verdicts, what the child and the tests are given, and hostile results."""

from __future__ import annotations

import ast
import json
import math
import random

import pytest
from test_coding_tasks import BY_ID

from mixrl.envs.coding import results as R
from mixrl.envs.coding.canary import hide
from mixrl.envs.coding.oracle import decode, job, judge, parse_oracle, same
from mixrl.envs.coding.oracle_child import encode
from mixrl.envs.coding.pytest_runner import read_pipe


def _roundtrip(v):  # type: ignore[no-untyped-def]
    return decode(json.loads(json.dumps(encode(v, [10_000]))))


@pytest.mark.parametrize("v", [None, True, 0, -7, 2**80, 2.5, "héllo", b"\x00\xff", [], (), [1, (2, "x")],
                               {"a": [1, 2], "b": None}, {("k", 1): 1.5}, {1, 2, "x"}, frozenset({3}),
                               [("a", 3), ("b", 1)]])
def test_values_round_trip_with_their_types(v):  # type: ignore[no-untyped-def]
    got = _roundtrip(v)
    want = set(v) if isinstance(v, frozenset) else v  # a frozenset comes back as a set
    assert same(got, want) and type(got) is type(want)


def test_comparison_rules_by_hand():
    assert same((1, 2), (1, 2)) and not same([1, 2], (1, 2))  # a tuple is not a list
    assert same(3, 3.0) and same(2.5, 2.5 * (1 + 1e-12)) and not same(2.5, 2.5 * (1 + 1e-6))
    assert not same(True, 1) and not same(1, True) and not same(0, False) and same(False, False)
    assert same(math.nan, math.nan) and not same(math.nan, 0.0)
    assert same({"a": 1, "b": [1]}, {"b": [1], "a": 1.0}) and not same({"a": 1}, {"a": 1, "b": 2})
    assert not same(None, 0) and not same("1", 1) and same(b"x", b"x") and not same(b"x", "x")


def test_subclasses_and_foreign_objects_are_never_equal():
    class Liar(str):
        def __eq__(self, other):  # type: ignore[no-untyped-def]
            return True

        __hash__ = str.__hash__

    assert encode(Liar("x"), [10]) == {"o": "Liar"}
    assert encode(object(), [10]) == {"o": "object"}
    with pytest.raises(Exception):  # noqa: B017 - not decodable: judged failed
        decode({"o": "Liar"})
    orc = {"imports": [], "cases": [{"test": "t", "expr": "x", "expect": "'x'"}]}
    assert judge(orc, [{"v": {"o": "Liar"}}]) == {"t": "failed"}


def test_judge_per_check():
    orc = parse_oracle({"imports": ["import math"], "case": [
        {"test": "a", "expr": "f(1)", "expect": "[('x', 1)]"},
        {"test": "a", "expr": "f(2)", "expect": "None"},
        {"test": "b", "expr": "f(0)", "raises": "ValueError"},
    ]}, "here")
    ok = [{"v": [{"t": ["x", 1]}]}, {"v": None}, {"raised": ["UnicodeError", "ValueError", "Exception"]}]
    assert judge(orc, ok) == {"a": "passed", "b": "passed"}
    assert judge(orc, [{"v": [["x", 1]]}, {"v": None}, ok[2]]) == {"a": "failed", "b": "passed"}  # list != tuple
    assert judge(orc, [ok[0], ok[1], {"v": None}]) == {"a": "passed", "b": "failed"}  # returned, not raised
    assert judge(orc, [ok[0], ok[1], {"raised": ["KeyError", "Exception"]}])["b"] == "failed"
    assert judge(orc, ok[:2]) == {"a": "failed", "b": "failed"}  # wrong length: nothing counts
    assert judge(orc, "garbage") == {"a": "failed", "b": "failed"}
    assert judge(orc, [{"error": "import failed"}] * 3) == {"a": "failed", "b": "failed"}


def test_the_child_never_sees_an_expectation():
    for iid, t in BY_ID.items():
        j = json.dumps(job(t.data["oracle"]))
        assert "expect" not in j and "raises" not in j, iid
        assert set(job(t.data["oracle"])) == {"imports", "exprs"}


@pytest.mark.parametrize("bad, match", [
    ({"case": []}, "at least one"),
    ({"case": [{"test": "t", "expr": "f("}]}, "exactly one of expect or raises"),
    ({"case": [{"test": "t", "expr": "f(", "expect": "1"}]}, "not valid"),
    ({"case": [{"test": "t", "expr": "f()", "expect": "open('x')"}]}, "not valid"),
    ({"case": [{"test": "t", "expr": "f()", "raises": "not a name"}]}, "exception class name"),
    ({"imports": ["from x import ("], "case": [{"test": "t", "expr": "1", "expect": "1"}]}, "does not parse"),
])
def test_oracle_errors_name_the_field(bad, match):  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=match):
        parse_oracle(bad, "oracle.toml")


def _tests(tree: ast.Module) -> dict[str, str]:
    return {n.name: ast.dump(n) for n in tree.body if isinstance(n, ast.FunctionDef)}


def _literals(text: str) -> set:  # type: ignore[type-arg]
    """Every literal in ``text``'s test functions except the recording calls' check ids."""
    out = set()
    for fn in ast.parse(text).body:
        if isinstance(fn, ast.FunctionDef):
            ids = {id(c.args[0]) for c in ast.walk(fn) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)
                   and c.func.id.startswith("__mixrl_")}
            out |= {repr(n.value) for n in ast.walk(fn) if isinstance(n, ast.Constant) and id(n) not in ids}
    return out


def expected_literals(src: str) -> set:  # type: ignore[type-arg]
    """The literals an ``assert`` compares with, less those that are also inputs elsewhere."""
    tree = ast.parse(src)
    want = set()
    for a in ast.walk(tree):
        if isinstance(a, ast.Assert) and isinstance(a.test, ast.Compare):
            for n in (a.test.left, *a.test.comparators):
                if isinstance(n, ast.Constant):
                    want.add(repr(n.value))
                    n.value = None
    return want - _literals(ast.unparse(tree))


@pytest.mark.parametrize("iid", sorted(BY_ID))
def test_sandbox_files_hold_no_expected_value(iid):  # type: ignore[no-untyped-def]
    """Every bundled test's expected values are gone from the file that enters the sandbox,
    its tests renamed; each canary is the body of a test it copies up to its check ids, so
    nothing in the file tells them apart; the expectations are kept outside."""
    from pathlib import Path

    data = BY_ID[iid].data
    for rel in data["test_files"]:
        src = Path(data["tests_dir"], rel).read_text()
        h = hide(src, random.Random(7), per_file=64)
        assert hide(src, random.Random(7), per_file=64).text == h.text  # deterministic in the rng
        assert not expected_literals(src) & _literals(h.text)  # no expected literal is in the sandbox's file
        for c in h.checks.values():
            assert c.kind != "raises" or c.exc[0] not in h.text  # nor the exception classes
        after = _tests(ast.parse(h.text))
        assert set(h.names.values()) == {n for n in _tests(ast.parse(src))}  # every test renamed
        assert set(after) == set(h.names) | set(h.canaries) and h.canaries
        blank = {k: __import__("re").sub(r"Constant\(value='[0-9a-f]{16}'\)", "", v.replace(f"name='{k}'", ""))
                 for k, v in after.items()}
        for name, (kind, partner) in h.canaries.items():
            assert blank[name] == blank[partner] and kind in ("literal", "truth", "raises")
            assert [h.checks[c] for c in h.funcs[name]] != [h.checks[c] for c in h.funcs[partner]]


def test_expectations_by_hand():
    """Each kind of check, rewritten and judged as pytest would: a test passes iff its report
    passed and every check was recorded and holds."""
    src = ("import pytest\n\n"
           "def test_a():\n    assert f(1) == [1, 2]\n    assert 0 < g() <= 3\n    assert 'x' in h()\n"
           "    assert not k()\n    assert m() == pytest.approx(0.3)\n"
           "    with pytest.raises(ValueError, match='bad'):\n        f(0)\n")
    h = hide(src, random.Random(1), per_file=0)
    assert "[1, 2]" not in h.text and "0.3" not in h.text and "ValueError" not in h.text and "'bad'" not in h.text
    (name,) = h.funcs
    node = f"t.py::{name}"
    pay = [{"v": [1, 2]}, {"v": 3}, {"v": "axb"}, {"t": False}, {"v": 0.1 + 0.2},
           {"raised": ["ValueError", "Exception"], "msg": "a bad one"}]
    good = [[node, cid, json.dumps(p)] for cid, p in zip(h.funcs[name], pay, strict=True)]
    v = R.judge_pytest({"t.py": h}, {"tests": {node: "passed"}, "checks": good})
    assert v.tests == {"t.py::test_a": "passed"} and not v.hacked
    for i, wrong in enumerate([{"v": {"t": [1, 2]}}, {"v": 4}, {"v": "ab"}, {"t": True}, {"v": 0.31},
                               {"raised": ["ValueError"], "msg": "fine"}]):
        recs = [r if j != i else [node, r[1], json.dumps(wrong)] for j, r in enumerate(good)]
        v = R.judge_pytest({"t.py": h}, {"tests": {node: "passed"}, "checks": recs})
        assert v.tests == {"t.py::test_a": "failed"} and not v.hacked, i
    v = R.judge_pytest({"t.py": h}, {"tests": {node: "failed"}, "checks": good})  # pytest's own verdict counts
    assert v.tests == {"t.py::test_a": "failed"}
    v = R.judge_pytest({"t.py": h}, {"tests": {node: "passed"}, "checks": good[:-1]})  # a check never recorded
    assert v.tests == {"t.py::test_a": "failed"} and "without running its checks" in v.hacked


DEEP = "[" * 200_000 + "]" * 200_000


@pytest.mark.parametrize("line", [DEEP, '{"a": ' * 50_000 + "1" + "}" * 50_000, "[" + "9" * 100_000 + "]",
                                  "[1e999999]", "[{\"v\": 1, \"raised\": [\"ValueError\"]}]",
                                  '[{"raised": [1]}]', '[{"error": null}]', '["x"]', "{}", "null", "\x00",
                                  "[" * 5000, '[{"v": ' + DEEP + "}]", "[[]]" * 3])
def test_hostile_oracle_result_lines_are_ill_formed(line):  # type: ignore[no-untyped-def]
    """Nothing the model's code prints as a result line makes the parser raise: ill-formed."""
    assert R.oracle_results(line, 1) is None


def test_hostile_values_fail_the_check_or_are_ill_formed():
    orc = {"imports": [], "cases": [{"test": "t", "expr": "x", "expect": "[1]"}]}
    deep: object = 1
    for _ in range(5000):
        deep = [deep]
    for v in (deep, {"d": [[[1], 2]]}, {"s": [[1]]}, {"b": "zz"}, {"o": "Liar"}, {"t": 5}, 10**4000):
        assert judge(orc, [{"v": v}]) == {"t": "failed"}
    assert judge(orc, [{"raised": [["ValueError"]]}]) == {"t": "failed"}
    assert R.oracle_results(json.dumps([{"v": [1]}]), 1) == [{"v": [1]}]


def test_hostile_pipe_messages_are_counted_never_raised():
    """The runner's parent reads what the test process sends: nested past the recursion limit,
    huge numbers, wrong types are counted ``bad`` (the grader: ``reward_hacked``)."""
    lines = [DEEP.encode() + b"\n", b"[" + b"9" * 100_000 + b"]\n", b'{"id": [1], "when": "call"}\n', b'"x"\n',
             b'{"check": 1, "node": "n", "p": {}}\n', b'{"exit": "0"}\n', b'{"check": "c", "node": "n", "p": '
             + DEEP.encode() + b"}\n", b'{"id": "a", "when": "call", "outcome": "passed"}\n', b'{"exit": 0}\n',
             b'{"id": "cut']
    got = read_pipe(iter(lines))
    assert got["bad"] == 7 and got["exit"] == 0 and [r["id"] for r in got["reports"]] == ["a"]
    h = hide("def test_a():\n    assert f() == 1\n", random.Random(0), per_file=0)
    (name, ids), = h.funcs.items()
    for res in ({"tests": {"x": ["passed"]}}, {"tests": {}, "checks": "zz"}, {"tests": {}, "checks": [[1, 2, 3]]},
                {"tests": {}, "checks": [["n", "nope", "{}"]]}, {"tests": {}, "checks": [["n", ids[0], DEEP]]},
                {"tests": {}, "checks": [["n", ids[0], '{"t": 1}']]}, {"tests": {}, "bad": 1}):
        assert R.judge_pytest({"t.py": h}, res).hacked, res


def test_no_check_without_something_to_check():
    """A test without asserts or ``pytest.raises`` records nothing and is not copied."""
    src = "def test_a():\n    f()\n\ndef test_b():\n    for x in []:\n        assert h(x) == 'y'\n"
    h = hide(src, random.Random(0))
    assert h.canaries == {} and h.checks == {} and "'y'" in h.text  # nested asserts stay, pytest decides
