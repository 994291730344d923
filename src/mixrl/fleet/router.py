"""The router: capacity-weighted, sticky group choice, then the least-loaded replica.

Each session is pinned to one sampler group, drawn with probability
proportional to the group's serving capacity

    capacity_g = (ready replicas of g) × relative_throughput_g

so over many sessions each group serves a steady share of the samples. Inside
the group the session goes to the replica with the fewest requests in flight.
Both pins are sticky: later turns of the session go to the same replica while
it serves, else to the least-loaded replica of the same group. When every
replica of the pinned group is gone, the session is re-pinned (capacity-
weighted again, among the groups that still serve).

Replica states (the fleet drives them):

    catching_up ──weights at the newest version──► ready ──failure──► failed
                                                      └──remove()──► draining (no new requests)

Only ``ready`` replicas take traffic, so a new or restarted replica serves only
after it has caught up with the trainer's newest weights.

Pure bookkeeping: no I/O, no awaits; the random draws come from one seeded
``random.Random`` so a run's routing is reproducible.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

READY, CATCHING_UP, FAILED, DRAINING = "ready", "catching_up", "failed", "draining"


@dataclass
class ReplicaInfo:
    name: str  # unique replica name, e.g. "h100-fp8/1"
    group: str
    state: str = CATCHING_UP
    inflight: int = 0  # requests in flight on this replica
    served: int = 0  # requests completed


class NoReplicaAvailable(RuntimeError):
    """No ready replica in any group."""


class Router:
    def __init__(self, throughput: dict[str, float], seed: int = 0):
        """``throughput``: group name -> relative throughput of one replica (> 0)."""
        for g, t in throughput.items():
            if not t > 0:
                raise ValueError(f"relative_throughput of group {g!r} must be > 0, got {t}")
        self.throughput = dict(throughput)
        self.replicas: dict[str, ReplicaInfo] = {}
        self.pins: dict[str, str] = {}  # session id -> group
        self.replica_pins: dict[str, str] = {}  # session id -> replica it last used
        self._rng = random.Random(seed)

    # -- replicas -------------------------------------------------------------
    def add(self, name: str, group: str) -> ReplicaInfo:
        if group not in self.throughput:
            raise ValueError(f"unknown sampler group {group!r}; known: {sorted(self.throughput)}")
        if name in self.replicas:
            raise ValueError(f"replica {name!r} already exists")
        info = ReplicaInfo(name, group)
        self.replicas[name] = info
        return info

    def set_state(self, name: str, state: str) -> None:
        self.replicas[name].state = state

    def forget(self, name: str) -> None:
        self.replicas.pop(name, None)

    def ready(self, group: str | None = None) -> list[ReplicaInfo]:
        return [r for r in self.replicas.values() if r.state == READY and (group is None or r.group == group)]

    def capacity(self) -> dict[str, float]:
        cap = dict.fromkeys(self.throughput, 0.0)
        for r in self.ready():
            cap[r.group] += self.throughput[r.group]
        return cap

    # -- sessions -------------------------------------------------------------
    def pin(self, session: str) -> str:
        """The session's group: sticky while the group has a ready replica."""
        g = self.pins.get(session)
        if g is not None and self.ready(g):
            return g
        cap = {k: v for k, v in self.capacity().items() if v > 0}
        if not cap:
            raise NoReplicaAvailable("no ready sampler replica in any group")
        groups = sorted(cap)
        g = self._rng.choices(groups, weights=[cap[k] for k in groups])[0]
        self.pins[session] = g
        return g

    def pick(self, session: str, exclude: set[str] = frozenset()) -> ReplicaInfo:  # type: ignore[assignment]
        """The session's replica: the one it used before while that one is ready, else the
        least-loaded ready replica of its group (ties by name).

        Keeping a session on one replica keeps its prefix warm there, and makes the batches
        a replica forms independent of timing elsewhere (sync runs are reproducible)."""
        group = self.pin(session)
        prev = self.replica_pins.get(session)
        if prev is not None and prev not in exclude:
            info = self.replicas.get(prev)
            if info is not None and info.state == READY and info.group == group:
                return info
        chosen = self._least_loaded(session, group, exclude)
        self.replica_pins[session] = chosen.name
        return chosen

    def _least_loaded(self, session: str, group: str, exclude: set[str]) -> ReplicaInfo:
        cands = [r for r in self.ready(group) if r.name not in exclude]
        if not cands:  # only excluded replicas left in the pinned group: try another group
            others = [r for r in self.ready() if r.name not in exclude]
            if not others:
                raise NoReplicaAvailable(f"no ready replica for session {session!r}")
            cap: dict[str, float] = {}
            for r in others:
                cap[r.group] = cap.get(r.group, 0.0) + self.throughput[r.group]
            groups = sorted(cap)
            group = self._rng.choices(groups, weights=[cap[k] for k in groups])[0]
            self.pins[session] = group
            cands = [r for r in others if r.group == group]
        return min(cands, key=lambda r: (r.inflight, r.name))

    def release(self, session: str) -> None:
        """The session ended: forget its pins."""
        self.pins.pop(session, None)
        self.replica_pins.pop(session, None)

    def inflight(self, group: str | None = None) -> int:
        return sum(r.inflight for r in self.replicas.values() if group is None or r.group == group)

    # -- checkpoint -------------------------------------------------------------
    def state_dict(self) -> dict[str, object]:
        return {"rng": self._rng.getstate()}

    def load_state_dict(self, sd: dict[str, object]) -> None:
        st = sd["rng"]
        # JSON round trips turn the state tuple into lists
        self._rng.setstate((st[0], tuple(st[1]), st[2]))  # type: ignore[index]
