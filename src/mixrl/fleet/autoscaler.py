"""A simple autoscaler: in-flight sessions per replica near a target.

Every ``interval_s`` it looks at each group's load, the requests in flight per
ready replica, and moves the replica count by one:

    load > target × (1 + tolerance)  and  live < max_replicas  → add one
    load < target × (1 − tolerance)  and  live > min_replicas  → remove one (drained)

One step per group per decision keeps it from oscillating on a burst; a new
replica serves only after catching up with the newest weights (the fleet
guarantees that), so scaling up never serves stale weights.
"""

from __future__ import annotations

import asyncio
import contextlib

from mixrl.fleet.fleet import Fleet


def decide(load: float, live: int, lo: int, hi: int, target: float, tolerance: float) -> int:
    """+1, -1 or 0 replicas for one group (pure; tested on its own)."""
    if load > target * (1 + tolerance) and live < hi:
        return 1
    if load < target * (1 - tolerance) and live > lo:
        return -1
    return 0


class Autoscaler:
    def __init__(self, fleet: Fleet, target: float, tolerance: float = 0.5, interval_s: float = 2.0):
        self.fleet, self.target, self.tolerance, self.interval_s = fleet, target, tolerance, interval_s
        self.events: list[tuple[str, int]] = []  # (group, +1/-1) decisions taken

    async def tick(self) -> None:
        for g, spec in self.fleet.specs.items():
            ready = self.fleet.router.ready(g)
            live = self.fleet.live(g)
            load = self.fleet.router.inflight(g) / max(len(ready), 1)
            d = decide(load, live, spec.min_replicas, spec.max_replicas, self.target, self.tolerance)
            if d > 0:
                await self.fleet.add_replica(g, wait=False)
            elif d < 0 and ready:
                victim = min(ready, key=lambda r: (r.inflight, r.name))
                asyncio.ensure_future(self.fleet.remove_replica(victim.name))
            if d:
                self.events.append((g, d))

    async def run(self) -> None:
        while not self.fleet.closed:
            await asyncio.sleep(self.interval_s)
            # bounds may race with a failure or a manual change: decide again next tick
            with contextlib.suppress(ValueError):
                await self.tick()
