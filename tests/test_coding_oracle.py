"""Oracle checks and canary tests, without a sandbox: encoding, comparison, verdicts, and
what the child and the tests are given."""

from __future__ import annotations

import ast
import json
import math
import random

import pytest
from test_coding_tasks import BY_ID

from mixrl.envs.coding.canary import with_canaries
from mixrl.envs.coding.oracle import decode, job, judge, parse_oracle, same
from mixrl.envs.coding.oracle_child import encode


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


@pytest.mark.parametrize("iid", sorted(BY_ID))
def test_canaries_are_perturbed_copies(iid):  # type: ignore[no-untyped-def]
    """The real tests come back unchanged; each canary is a renamed copy of one of them with
    at least one expected value changed; names are new and look like the real ones."""
    from pathlib import Path

    data = BY_ID[iid].data
    for rel in data["test_files"]:
        src = Path(data["tests_dir"], rel).read_text()
        text, names = with_canaries(src, random.Random(7), per_file=3)
        assert with_canaries(src, random.Random(7), per_file=3) == (text, names)  # deterministic in the rng
        before, after = _tests(ast.parse(src)), _tests(ast.parse(text))
        assert {k: after[k] for k in before} == before and set(after) == set(before) | set(names)
        assert 1 <= len(names) <= 3 and len(set(names)) == len(names)
        words = {w for n in before for w in n.split("_")[1:]}
        for n in names:
            assert n.startswith("test_") and set(n.split("_")[1:]) <= words
            body = after[n].replace(f"name='{n}'", "")
            assert all(body != b.replace(f"name='{k}'", "") for k, b in before.items())  # not a plain copy


def test_no_canary_without_a_literal_to_change():
    """Nothing to perturb (truth tests), or only asserts that might never run: no canary."""
    src = ("def test_a():\n    assert f()\n\ndef test_b():\n    assert not g(1)\n\n"
           "def test_c():\n    with pytest.raises(ValueError):\n        assert h(0) == 3\n\n"
           "def test_d():\n    for x in []:\n        assert h(x) == 'y'\n")
    assert with_canaries(src, random.Random(0)) == (src, [])
