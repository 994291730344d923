"""The rollout buffer: assembles complete GRPO groups and measures staleness.

One prompt moves through these states (``seq`` is its issue order):

    open ──add()×G──► complete ──take()──► taken          (normal path)
                          │
                          └─ take() finds staleness > max_staleness
                                ├─ policy "drop":    dropped (never trained on)
                                └─ policy "requeue": reopened with no trajectories;
                                                     its task is handed back to be
                                                     sampled again (same prompt_id)

Worked example, G = 2, max_staleness = 1, policy "requeue":

    open(p0), open(p1)                      open: p0[0/2], p1[0/2]
    add(p0#0 @v0), add(p1#0 @v0)            open: p0[1/2], p1[1/2]
    add(p0#1 @v0)                           complete: p0
    take(1, trainer_version=0)  -> [p0]     staleness 0; p0 taken
    ... trainer publishes v1, v2 ...
    add(p1#1 @v2)                           complete: p1 (tokens at v0 and v2)
    take(1, trainer_version=2)  -> None     p1 has a token with staleness 2 > 1:
                                            requeued; requeued() -> [p1's task]

Staleness of a token = trainer version at the update that consumes it − the
version that generated it, over generated tokens only (``Trajectory.staleness``,
the one definition; docs/corrections.md section 10). ``take`` bounds it and is the
one producer of ``rollout/staleness_mean`` and ``rollout/staleness_max``, over the
generated tokens of the groups it hands out.
It is unbounded by default. Sync mode needs nothing special here: the
orchestrator issues exactly B prompts per update, so every group is taken at
staleness 0.

Dynamic sampling (``dynamic_sampling=True``, DAPO arXiv 2503.14476 §3.2):
``take`` first discards every complete group that carries no signal (fewer
than two rewarded trajectories, or all their rewards equal: every advantage
would be 0), counting it in ``rollout/dynamic_skipped_groups``; the caller's
top-up then issues new prompts in its place, so each update still gets B groups
with signal. Such a group is never requeued (its prompt was sampled fine).

Complete groups are handed out oldest ``seq`` first, which makes the batch
order independent of completion timing (sync mode is then reproducible).
Adding a trajectory twice (same prompt and ``sample_idx``) is an error: a
session must never be counted twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mixrl.records.trajectory import UNREWARDED, Trajectory


@dataclass
class _Entry:
    seq: int  # issue order
    task: dict[str, Any]  # the task record (serializable), used to requeue
    trajs: dict[int, Trajectory] = field(default_factory=dict)  # sample_idx -> finished trajectory


class RolloutBuffer:
    def __init__(self, group_size: int, max_staleness: int | None = None, policy: str = "drop",
                 dynamic_sampling: bool = False):
        if group_size < 1:
            raise ValueError(f"RolloutBuffer.group_size must be >= 1, got {group_size}")
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"RolloutBuffer.max_staleness must be >= 0 or None, got {max_staleness}")
        if policy not in ("drop", "requeue"):
            raise ValueError(f"RolloutBuffer.policy must be 'drop' or 'requeue', got {policy!r}")
        self.group_size = group_size
        self.max_staleness = max_staleness
        self.policy = policy
        self.dynamic_sampling = dynamic_sampling
        self._open: dict[str, _Entry] = {}  # prompt_id -> entry still missing trajectories
        self._complete: dict[str, _Entry] = {}  # prompt_id -> entry with G trajectories
        self._requeue: list[dict[str, Any]] = []  # tasks to sample again
        self._seq = 0
        self.counts = {"dropped_groups": 0, "requeued_groups": 0, "taken_groups": 0, "skipped_groups": 0}

    # -- producer side -------------------------------------------------------
    def open(self, prompt_id: str, task: dict[str, Any]) -> None:
        """Register a prompt whose G sessions are about to start."""
        if prompt_id in self._open or prompt_id in self._complete:
            raise ValueError(f"prompt {prompt_id!r} is already in the buffer")
        self._open[prompt_id] = _Entry(seq=self._seq, task=task)
        self._seq += 1

    def add(self, traj: Trajectory) -> bool:
        """Add one finished trajectory; return True when it completes its group."""
        e = self._open.get(traj.prompt_id)
        if e is None:
            raise ValueError(f"trajectory for prompt {traj.prompt_id!r} which is not open")
        if not 0 <= traj.sample_idx < self.group_size:
            raise ValueError(f"sample_idx {traj.sample_idx} outside [0, {self.group_size})")
        if traj.sample_idx in e.trajs:
            raise ValueError(f"duplicate trajectory {traj.prompt_id}#{traj.sample_idx}")
        e.trajs[traj.sample_idx] = traj
        if len(e.trajs) == self.group_size:
            self._complete[traj.prompt_id] = self._open.pop(traj.prompt_id)
            return True
        return False

    def missing(self, prompt_id: str) -> list[int]:
        """Sample indices of an open prompt that have no trajectory yet."""
        e = self._open[prompt_id]
        return [i for i in range(self.group_size) if i not in e.trajs]

    def requeued(self) -> list[dict[str, Any]]:
        """Tasks handed back by the requeue policy (cleared by this call)."""
        out, self._requeue = self._requeue, []
        return out

    # -- consumer side -------------------------------------------------------
    def num_complete(self) -> int:
        return len(self._complete)

    def num_open(self) -> int:
        return len(self._open)

    def open_prompts(self) -> list[str]:
        return sorted(self._open, key=lambda p: self._open[p].seq)

    def take(self, n: int, trainer_version: int) -> tuple[list[list[Trajectory]], dict[str, float]] | None:
        """Hand out ``n`` complete groups (oldest first) within the staleness bound.

        Returns None (and keeps the eligible groups) when fewer than ``n`` are
        eligible. Groups beyond the bound are dropped or requeued on the way.
        """
        for pid in sorted(self._complete, key=lambda p: self._complete[p].seq):
            e = self._complete[pid]
            if self.max_staleness is not None and _max_staleness(e, trainer_version) > self.max_staleness:
                del self._complete[pid]
                if self.policy == "drop":
                    self.counts["dropped_groups"] += 1
                else:
                    self.counts["requeued_groups"] += 1
                    self._requeue.append(e.task)
        if self.dynamic_sampling:
            for pid in [p for p, e in self._complete.items() if not _has_signal(e)]:
                del self._complete[pid]
                self.counts["skipped_groups"] += 1
        if len(self._complete) < n:
            return None
        pids = sorted(self._complete, key=lambda p: self._complete[p].seq)[:n]
        groups = []
        total, count, worst = 0, 0, 0
        for pid in pids:
            e = self._complete.pop(pid)
            group = [e.trajs[i] for i in range(self.group_size)]
            groups.append(group)
            for t in group:
                stale = t.staleness(trainer_version)
                total, count, worst = total + sum(stale), count + len(stale), max([worst, *stale])
        self.counts["taken_groups"] += n
        metrics = {
            "rollout/staleness_mean": total / count if count else 0.0,
            "rollout/staleness_max": float(worst),
            "rollout/dropped_groups": float(self.counts["dropped_groups"]),
            "rollout/requeued_groups": float(self.counts["requeued_groups"]),
        }
        if self.dynamic_sampling:
            metrics["rollout/dynamic_skipped_groups"] = float(self.counts["skipped_groups"])
        return groups, metrics

    # -- checkpoint ----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        def dump(d: dict[str, _Entry]) -> list[dict[str, Any]]:
            return [
                {"prompt_id": p, "seq": e.seq, "task": e.task, "trajs": [t.to_dict() for t in e.trajs.values()]}
                for p, e in d.items()
            ]

        return {
            "group_size": self.group_size,
            "open": dump(self._open),
            "complete": dump(self._complete),
            "requeue": list(self._requeue),
            "seq": self._seq,
            "counts": dict(self.counts),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd["group_size"] != self.group_size:
            raise ValueError(f"checkpoint buffer has group_size {sd['group_size']}, config has {self.group_size}")

        def load(items: list[dict[str, Any]]) -> dict[str, _Entry]:
            out = {}
            for it in items:
                trajs = [Trajectory.from_dict(t) for t in it["trajs"]]
                out[it["prompt_id"]] = _Entry(it["seq"], it["task"], {t.sample_idx: t for t in trajs})
            return out

        self._open, self._complete = load(sd["open"]), load(sd["complete"])
        self._requeue, self._seq = list(sd["requeue"]), sd["seq"]
        self.counts = {"skipped_groups": 0, **sd["counts"]}  # checkpoints from before dynamic sampling


def _max_staleness(e: _Entry, trainer_version: int) -> int:
    return max((s for t in e.trajs.values() for s in t.staleness(trainer_version)), default=0)


def _has_signal(e: _Entry) -> bool:
    """At least two rewarded trajectories with different rewards (else every advantage is 0)."""
    rewards = {t.reward for t in e.trajs.values() if t.reward is not None and t.status not in UNREWARDED}
    n = sum(t.reward is not None and t.status not in UNREWARDED for t in e.trajs.values())
    return n >= 2 and len(rewards) > 1
