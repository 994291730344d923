"""Object references to each weights version's quantization into each sampler format.

The Ray backend's replica handles of one driver share one ``FormatRefs``: the
first replica of a format to load a version asks its actor to quantize it (an
actor task whose result is one object in the object store, owned by the
driver); every replica of the format passes that one reference, which Ray
resolves in each actor; the driver never fetches it. So a version is quantized
once per format, not once per replica. Only the newest ``keep`` versions are
held, like the weight store; a reference whose task failed is dropped, so the
next replica of the format builds it again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class FormatRefs:
    """(version, format) -> the reference of that version's quantization (see module doc)."""

    def __init__(self, keep: int = 2):
        self.keep = keep
        self.refs: dict[tuple[int, str], Any] = {}
        self.built: dict[str, int] = {}  # format -> quantizations asked for (once per version)

    def claim(self, version: int, fmt: str, build: Callable[[], Any]) -> tuple[Any, bool]:
        """(reference, whether this call built it); no await inside: atomic on the loop."""
        ref = self.refs.get((version, fmt))
        if ref is not None:
            return ref, False
        ref = self.refs[(version, fmt)] = build()
        self.built[fmt] = self.built.get(fmt, 0) + 1
        for v, f in [k for k in self.refs if k[0] <= version - self.keep]:
            del self.refs[(v, f)]
        return ref, True

    def drop(self, version: int, fmt: str, ref: Any) -> None:
        if self.refs.get((version, fmt)) is ref:
            del self.refs[(version, fmt)]
