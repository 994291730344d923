"""The one place that holds the numerical tolerances of the correction tests.

``f64``: float64 against a float64 brute-force reference. The implementation
works in log space and the reference in probability space, so agreement is
to a few ulps times the condition of the expression, not bit-exact.
``f32``: a float32 computation against a float64 reference.
"""

from __future__ import annotations

import torch

TOLERANCES = {
    "f64": {"rtol": 1e-9, "atol": 1e-11},
    "f32": {"rtol": 2e-5, "atol": 2e-6},
}


def assert_close(actual, expected, *, kind: str = "f64", msg: str | None = None) -> None:
    """``torch.testing.assert_close`` with the tolerance of ``kind``; floats are compared as float64."""
    tol = TOLERANCES[kind]
    a = torch.as_tensor(actual, dtype=torch.float64)
    e = torch.as_tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(a, e, rtol=tol["rtol"], atol=tol["atol"], msg=msg)
