"""The real-model tables' interval of a gain: Newcombe's hybrid score interval, checked two ways."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("readme_tables", ROOT / "scripts" / "readme_tables.py")
tables = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tables)


def test_newcombe_matches_the_published_example() -> None:
    # Newcombe (1998), Stat. Med. 17:873, Table II, example (a): 56/70 vs 48/80, method 10: 0.0524 to 0.3339
    lo, hi = tables.newcombe(48 / 80, 80, 56 / 70, 70)
    assert lo == pytest.approx(0.0524, abs=1e-4) and hi == pytest.approx(0.3339, abs=1e-4)


def test_newcombe_against_brute_force_wilson_bounds() -> None:
    # The Wilson bounds are the roots of |p - x| = z sqrt(x(1-x)/n): found by bisection in float64.
    def bound(p: float, n: int, upper: bool) -> float:
        a, b = (p, 1.0) if upper else (0.0, p)
        for _ in range(200):
            m = (a + b) / 2
            inside = abs(p - m) <= 1.959963984540054 * (m * (1 - m) / n) ** 0.5
            a, b = ((m, b) if inside else (a, m)) if upper else ((a, m) if inside else (m, b))
        return (a + b) / 2

    for p1, n1, p2, n2 in ((0.19, 150, 0.31, 150), (0.0, 20, 0.5, 30), (0.9, 40, 0.7, 60)):
        l1, u1, l2, u2 = bound(p1, n1, False), bound(p1, n1, True), bound(p2, n2, False), bound(p2, n2, True)
        d = p2 - p1
        want = d - ((p2 - l2) ** 2 + (u1 - p1) ** 2) ** 0.5, d + ((u2 - p2) ** 2 + (p1 - l1) ** 2) ** 0.5
        got = tables.newcombe(p1, n1, p2, n2)
        assert got == pytest.approx(want, abs=1e-3)  # wilson() uses z = 1.96, the bisection 1.95996
