"""Stable seeds: the same parts give the same seed in every process, run and machine.

Python's ``hash`` of a string is salted per process (``PYTHONHASHSEED``), so it never seeds
anything here. ``stable_seed(*parts)`` is the 63-bit BLAKE2b digest of the parts joined by
``|``: the seed of a sampling request (run seed, request id), of an evaluation request, of a
replica's engine, of ``mixrl serve``'s groups.
"""

from __future__ import annotations

import hashlib


def stable_seed(*parts: object) -> int:
    text = "|".join(str(p) for p in parts)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") >> 1
