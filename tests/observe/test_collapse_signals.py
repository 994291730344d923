"""The seed's collapse signals in the rollout metrics: empty last replies, reply spans."""

from mixrl.records.trajectory import Trajectory
from mixrl.runtime.episodes import reply_spans, rollout_metrics


def _traj(mask, status="ok", reward=1.0):
    n = len(mask)
    return Trajectory(prompt_id="p", sample_idx=0, tokens=list(range(n)), loss_mask=mask,
                      sampler_logprobs=[-0.1 if m else 0.0 for m in mask],
                      versions=[0 if m else -1 for m in mask], groups=["g" if m else "" for m in mask],
                      reward=reward, status=status, turns=sum(1 for s in reply_spans_ref(mask)))


def reply_spans_ref(mask):  # brute force: a span starts where a 1 follows a 0 (or the start)
    starts = [i for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])]
    ends = [i + 1 for i, m in enumerate(mask) if m and (i == len(mask) - 1 or not mask[i + 1])]
    return list(zip(starts, ends, strict=True))


def test_reply_spans_match_brute_force():
    import itertools

    for n in range(1, 9):
        for mask in itertools.product((0, 1), repeat=n):
            t = _traj(list(mask))
            assert reply_spans(t) == reply_spans_ref(list(mask))


def test_empty_last_reply_share():
    trajs = [
        _traj([0, 0, 1, 1, 1, 0, 0, 1, 1]),  # last reply 2 tokens: not empty
        _traj([0, 0, 1, 1, 0, 0, 1]),  # last reply is the end-of-turn token alone
        _traj([0, 0, 1, 1, 1, 0, 0]),  # ends on tool output; the last reply has 3 tokens
        _traj([0, 0, 1], status="format_error", reward=0.0),  # empty and a format-error end
    ]
    m = rollout_metrics(trajs, ["g"])
    assert m["rollout/empty_last_reply"] == 2 / 4
    assert m["rollout/format_error_end"] == 1 / 4


def test_clipped_share_counts_replies_cut_by_a_limit():
    trajs = [_traj([0, 1, 1]), _traj([0, 1, 1]), _traj([0, 1], status="truncated", reward=0.0), _traj([0, 1])]
    trajs[0].info["clipped"] = 1  # a reply that reached max_new_tokens (the session marks it)
    trajs[1].info["clipped"] = 0
    m = rollout_metrics(trajs, ["g"])
    assert m["rollout/clipped_frac"] == 2 / 4  # the marked one and the truncated episode
