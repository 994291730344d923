"""What ``--json`` prints: one strict JSON object (RFC 8259), on one line unless indented.

Python's ``json.dumps`` writes NaN and Infinity as bare words that strict parsers
(``jq``, JavaScript, most languages' libraries) refuse; a measurement that is not
a number is ``null`` here. Objects that are not JSON types are written as their
``float`` (numpy and torch scalars), else their ``str``.
"""

from __future__ import annotations

import json
import math
from typing import Any


def _plain(x: Any) -> Any:
    if isinstance(x, bool) or x is None or isinstance(x, (int, str)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    try:
        return _plain(float(x))
    except (TypeError, ValueError):
        return str(x)


def json_text(obj: Any, indent: int | None = None) -> str:
    """``obj`` as strict JSON text: non-finite floats are ``null``."""
    return json.dumps(_plain(obj), indent=indent, allow_nan=False)
