"""What a batch's episodes say: rollout metrics, reply spans, tokens per sampler group.

Rollout metrics (docs/corrections.md §10), over the batch's episodes that did not
fail for infrastructure reasons; per sampler group ``g`` over the episodes
whose generated tokens came mostly from ``g`` (a session re-routed after a
failure may span groups):

    rollout/reward, rollout/length (generated tokens), rollout/turns   (and /<g>)
    rollout/format_error_end   share of episodes ended by repeated format errors
    rollout/empty_last_reply   share of episodes whose last reply is empty (<= 1 token: end of turn)
    rollout/clipped_frac       share of episodes cut by a limit: a reply that reached
                               ``max_new_tokens`` (finish "length") or the episode's token budget
                               (status "truncated"); TRL's ``completions/clipped_ratio``
    rollout/infra_failed       episodes lost to infrastructure (never reward 0)
    rollout/status/<status>    share of each status
    rollout/mixed_version_turns  turns continued under newer weights (interruptible turns)
"""

from __future__ import annotations

from collections import Counter

from mixrl.records.trajectory import STATUSES, UNREWARDED, Trajectory


def main_group(t: Trajectory) -> str:
    """The sampler group that generated most of ``t``'s tokens ("" if none)."""
    c = Counter(g for g, m in zip(t.groups, t.loss_mask, strict=True) if m)
    return c.most_common(1)[0][0] if c else ""


def rollout_metrics(trajs: list[Trajectory], group_names: list[str]) -> dict[str, float]:
    # rewards, lengths and turns are over episodes that have a reward: an infrastructure, reward
    # function or agent failure has none (never counted as 0)
    ok = [t for t in trajs if t.status not in UNREWARDED]
    m: dict[str, float] = {"rollout/episodes": float(len(trajs))}
    m["rollout/infra_failed"] = float(sum(t.status == "infra_failed" for t in trajs))
    m["rollout/unrewarded"] = float(len(trajs) - len(ok))

    def put(prefix: str, items: list[Trajectory]) -> None:
        if not items:
            return
        n = len(items)
        m[f"rollout/reward{prefix}"] = sum(float(t.reward or 0.0) for t in items) / n
        m[f"rollout/length{prefix}"] = sum(t.num_generated for t in items) / n
        m[f"rollout/turns{prefix}"] = sum(t.turns for t in items) / n

    put("", ok)
    by_group: dict[str, list[Trajectory]] = {g: [] for g in group_names}
    for t in ok:
        by_group.setdefault(main_group(t), []).append(t)
    for g, items in by_group.items():
        if g:
            put(f"/{g}", items)
    n = max(len(trajs), 1)
    for s in STATUSES:
        m[f"rollout/status/{s}"] = sum(t.status == s for t in trajs) / n
    m["rollout/format_error_end"] = sum(t.status == "format_error" for t in trajs) / n
    # the seed's collapsed episodes end on an empty reply: at most the end-of-turn token
    m["rollout/empty_last_reply"] = sum(_last_reply_len(t) <= 1 for t in trajs) / n
    m["rollout/clipped_frac"] = sum(int(t.info.get("clipped", t.status == "truncated")) for t in trajs) / n
    m["rollout/malformed_calls"] = float(sum(t.num_malformed for t in trajs))
    # agent episodes whose history was edited by the agent: segments left out of training
    # turns continued under newer weights (rollout.interrupt_tokens): generated runs with > 1 version
    m["rollout/mixed_version_turns"] = float(sum(mixed_version_turns(t) for t in trajs))
    m["rollout/history_rewrites"] = float(sum(int(t.info.get("history_rewrites", 0)) for t in trajs))
    return m


def reply_spans(t: Trajectory) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of generated tokens: one per assistant reply."""
    spans, start = [], None
    for i, m in enumerate(t.loss_mask):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans + ([(start, len(t.loss_mask))] if start is not None else [])


def _last_reply_len(t: Trajectory) -> int:
    spans = reply_spans(t)
    return spans[-1][1] - spans[-1][0] if spans else 0


def mixed_version_turns(t: Trajectory) -> int:
    """Maximal runs of generated tokens of ``t`` whose tokens carry more than one weights version."""
    out, prev = 0, 0
    seen: set[int] = set()
    for m, v in zip(t.loss_mask, t.versions, strict=True):
        if m:
            seen.add(v)
        elif prev:
            out, seen = out + (len(seen) > 1), set()
        prev = m
    return out + (len(seen) > 1)


def tokens_by_group(trajs: list[Trajectory]) -> dict[str, int]:
    """Generated tokens per sampler group (cost accounting)."""
    c: Counter[str] = Counter()
    for t in trajs:
        for g, mk in zip(t.groups, t.loss_mask, strict=True):
            if mk:
                c[g] += 1
    return dict(c)
