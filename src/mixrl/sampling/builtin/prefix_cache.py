"""Prefill that never computes a token twice: a group's shared prompt once, a session's turns incrementally.

Two sources of KV rows a prefill can reuse instead of computing:

- **its own cohort** (group prefix sharing): requests admitted together whose prompt ids are
  identical (the G samples of a GRPO group) are prefilled as one row; the cache rows and the
  last hidden state are then copied to each request (``rows``);
- **the session's cache** (``PrefixStore``): when a request of a session finishes, the KV of
  its prompt and output (every column it wrote: the prompt and all generated tokens but the
  last, which was sampled and never fed) is kept under the session key. The session's next
  request reuses the longest common prefix of its prompt ids with the kept ids (at most all
  but its last token: the logits of the last prompt position must be computed), and the
  prefill computes only the rest.

A prefill of left-padded rows runs one forward over a common column range [col0, P): the
reused columns of each row are copied into the fresh cache at [start, col0), so
``col0 = P - T`` with T the most new tokens of any row; a row with fewer new tokens than T
recomputes part of its reused prefix (counted as prefilled). Attention reads exactly the
keys and values it would have computed: the stored ones were written in the profile's KV
format, and the current weights computed them (or, where the profile opts into reuse across
versions, an older version: ``reused_stale_tokens`` counts them per result and
``reused_stale_versions`` says how many versions back, the mismatch that reuse adds).

Accounting per result (``GenerationResult.timings``): ``prefill_tokens`` (prompt tokens this
request's prefill computed), ``reused_tokens`` (its prompt tokens whose KV came from a sibling
or the session's cache; the two sum to the prompt length) and ``kv_evictions`` (entries the
store dropped, least recently used first, to keep this request's KV within its byte budget).

Example: turn 1 of session ``s`` has a 20-token prompt and writes 8 tokens (the last not fed):
27 columns kept under ``s``. Turn 2's prompt is those 28 tokens plus 5 of a tool's output
(33): 27 reused, 6 prefilled.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Entry:
    tokens: list[int]  # the ids whose keys and values ``kv`` holds, in order
    kv: torch.Tensor  # [2 * layers, Hkv, len(tokens), D]: each layer's keys, then values, as stored
    version: int  # the oldest weights version that computed any of them

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two id lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case (an extended conversation): one C-level comparison
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]: bisect on the first difference
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class PrefixStore:
    """Sessions' KV kept between requests, least recently used dropped first beyond ``budget``
    bytes. ``across_versions``: reuse an entry computed by older weights (else it is dropped
    when the version changes). Counters: ``bytes`` held now, ``peak`` bytes ever held,
    ``evictions`` (dropped for the budget), ``invalidated`` (dropped for a version change)."""

    def __init__(self, budget: int, across_versions: bool = False) -> None:
        if budget < 0:
            raise ValueError(f"kv_retain_bytes must be >= 0, got {budget}")
        self.budget, self.across_versions = budget, across_versions
        self.entries: collections.OrderedDict[str, Entry] = collections.OrderedDict()
        self.bytes = self.peak = self.evictions = self.invalidated = 0

    def take(self, session: str, prompt: list[int], version: int) -> tuple[Entry, int] | None:
        """Remove and return the session's entry with the number of prompt tokens it covers
        (at most ``len(prompt) - 1``); None when there is none to use."""
        e = self.entries.pop(session, None)
        if e is None:
            return None
        self.bytes -= e.nbytes
        if e.version != version and not self.across_versions:
            self.invalidated += 1
            return None
        n = min(common_prefix(e.tokens, prompt), len(prompt) - 1)
        return (e, n) if n > 0 else None

    def put(self, session: str, entry: Entry) -> int:
        """Keep ``entry`` for ``session`` (replacing its older one); returns the entries evicted."""
        old = self.entries.pop(session, None)
        if old is not None:
            self.bytes -= old.nbytes
        size = entry.nbytes
        if size > self.budget:
            return 0
        evicted = 0
        while self.bytes + size > self.budget:
            _, e = self.entries.popitem(last=False)
            self.bytes -= e.nbytes
            evicted += 1
        self.entries[session] = entry
        self.bytes += size
        self.peak = max(self.peak, self.bytes)
        self.evictions += evicted
        return evicted

    def drop_older(self, version: int) -> None:
        """Drop the entries older than ``version`` (a weights load) unless reused across versions."""
        if self.across_versions:
            return
        for s in [s for s, e in self.entries.items() if e.version != version]:
            self.bytes -= self.entries.pop(s).nbytes
            self.invalidated += 1


@dataclass
class Plan:
    """How one cohort's prefill runs: ``uniq`` request indices prefilled (one per distinct
    prompt), ``rows`` [len(requests)] the prefilled row each request copies (None: each its
    own), ``prefix`` (col0, kv per prefilled row [2 layers, Hkv, col0 - start, D] or None) to
    copy before the forward (None: a whole prefill), ``stats`` per request."""

    uniq: list[int]
    rows: torch.Tensor | None
    prefix: tuple[int, list[torch.Tensor | None]] | None
    stats: list[dict[str, float]]


def plan(store: PrefixStore | None, reqs: list[Any], version: int) -> Plan:
    """Share identical prompts within the cohort and find each distinct prompt's session KV."""
    first: dict[tuple[int, ...], int] = {}
    uniq: list[int] = []
    of: list[int] = []
    for i, r in enumerate(reqs):
        u = first.setdefault(tuple(r.prompt_ids), len(uniq))
        if u == len(uniq):
            uniq.append(i)
        of.append(u)
    hits: list[tuple[Entry, int] | None] = [None] * len(uniq)
    if store is not None:
        for i, r in enumerate(reqs):
            if r.session:  # every sibling's old entry is consumed; the first prompt's is used
                hit = store.take(r.session, r.prompt_ids, version)
                if hit is not None and hits[of[i]] is None:
                    hits[of[i]] = hit
    lens = [len(reqs[i].prompt_ids) for i in uniq]
    P = max(lens)
    T = max(L - (h[1] if h else 0) for L, h in zip(lens, hits, strict=True))  # new tokens of the widest row
    col0 = P - T
    kvs: list[torch.Tensor | None] = []
    done: list[dict[str, float]] = []
    for L, h in zip(lens, hits, strict=True):
        r = max(0, L - T)  # columns copied for this row: [P - L, col0)
        kvs.append(h[0].kv[:, :, :r] if h is not None and r else None)
        st = {"prefill_tokens": float(L - r), "reused_tokens": float(r), "kv_evictions": 0.0}
        if h is not None and r and h[0].version != version:
            st["reused_stale_tokens"], st["reused_stale_versions"] = float(r), float(version - h[0].version)
        done.append(st)
    stats = []
    for i, u in enumerate(of):
        if uniq[u] == i:
            stats.append(done[u])
        else:  # a sibling: every prompt token comes from the shared row
            L = float(len(reqs[i].prompt_ids))
            stats.append({**done[u], "prefill_tokens": 0.0, "reused_tokens": L, "kv_evictions": 0.0})
    rows = None if len(uniq) == len(reqs) else torch.tensor(of)
    return Plan(uniq, rows, (col0, kvs) if col0 > 0 else None, stats)
