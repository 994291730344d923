"""The versioned weight store: the trainer publishes, replicas pull the newest.

Versions are immutable: ``publish`` stores what ``put`` returns for the
trainer's state dict (in-process: a detached copy, so later optimizer steps do
not change a published version). With ``put=None`` the store holds what it is
given: a run's trainer handle publishes a reference that is already immutable
(a version in shared memory, a Ray object written once and read by every
replica), made by its backend. The store holds the trainer's own
precision; each replica quantizes on load into its profile's formats.

Only the newest ``keep`` versions are held: a replica always pulls the newest
one, so older versions are needed only by pulls already in progress. An
evicted reference with a ``retire()`` method (``shared_weights.SharedVersion``)
is told so, and frees its shared memory once those pulls are done.

Timing: ``publish`` records when a version was published and the fleet calls
``served(version, replica)`` when a replica serves it; ``latency(version)`` is
the time from publication until every replica that was ready at publication
time serves it (``fleet/publish_s``).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from mixrl.weights.refs import WeightsRef
from mixrl.weights.versions import KEEP_VERSIONS  # noqa: F401 - the store's default, named here too


def copy_state_dict(sd: dict[str, Any]) -> dict[str, Any]:
    """A detached copy (the in-process ``put``): later in-place updates do not leak in."""
    return {k: (v.detach().clone() if hasattr(v, "detach") else v) for k, v in sd.items()}


class WeightStore:
    def __init__(self, put: Callable[[Any], WeightsRef] | None = copy_state_dict, keep: int = KEEP_VERSIONS):
        if keep < 1:
            raise ValueError(f"WeightStore.keep must be >= 1, got {keep}")
        self._put = put
        self.keep = keep
        self._versions: OrderedDict[int, WeightsRef] = OrderedDict()  # version -> stored ref
        self._published_at: dict[int, float] = {}
        self._waiting: dict[int, set[str]] = {}  # version -> replicas that must serve it
        self.latencies: dict[int, float] = {}  # version -> seconds until all replicas served it
        self.put_s: dict[int, float] = {}  # version -> seconds spent in put()

    @property
    def latest(self) -> int:
        return next(reversed(self._versions)) if self._versions else -1

    def publish(self, version: int, state_dict: WeightsRef, replicas: list[str]) -> None:
        """Store ``version`` (must be newer than every stored one) for ``replicas`` to pull."""
        if version <= self.latest:
            raise ValueError(f"version {version} is not newer than the latest stored {self.latest}")
        t0 = time.perf_counter()
        self._versions[version] = state_dict if self._put is None else self._put(state_dict)
        self.put_s[version] = time.perf_counter() - t0
        self._published_at[version] = t0
        self._waiting[version] = set(replicas)
        if not replicas:
            self.latencies[version] = self.put_s[version]
        while len(self._versions) > self.keep:
            _, old = self._versions.popitem(last=False)
            if hasattr(old, "retire"):  # a shared-memory version: freed once no load holds it
                old.retire()

    def get(self, version: int | None = None) -> tuple[int, WeightsRef]:
        """(version, stored ref); None = the newest."""
        v = self.latest if version is None else version
        if v not in self._versions:
            raise KeyError(f"weights version {v} is not held (held: {list(self._versions)})")
        return v, self._versions[v]

    def served(self, version: int, replica: str) -> None:
        """``replica`` now serves ``version`` (and so every older version's wait is over for it)."""
        for v, waiting in list(self._waiting.items()):
            if v <= version and replica in waiting:
                waiting.discard(replica)
                if not waiting:
                    self.latencies[v] = time.perf_counter() - self._published_at[v]
                    del self._waiting[v]

    def forget_replica(self, replica: str) -> None:
        """A failed or removed replica is no longer waited for."""
        for v, waiting in list(self._waiting.items()):
            if replica in waiting:
                waiting.discard(replica)
                if not waiting:
                    self.latencies[v] = time.perf_counter() - self._published_at[v]
                    del self._waiting[v]
