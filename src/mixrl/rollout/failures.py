"""When episodes without a reward end a run: a run in which nothing can be learned is not a success.

Episodes without a reward (``records.trajectory.UNREWARDED``) are left out of
advantages and counted, never scored 0. Two rules turn them into a failed run,
applied to every training batch and to every evaluation:

- ``reward.on_error = "fail"`` (the default): the first episode whose reward
  function raised or returned NaN / None / the wrong length stops the run
  (``"skip"`` leaves such episodes out and goes on);
- whatever ``on_error`` says, a batch (or an evaluation) in which no episode
  has a reward stops it: nothing can be learned (or measured) from it. The
  line names the status counts and the most common reason.

:class:`EpisodesFailed` carries ``user``: True when the run's own code failed
(a reward function, the environment, an agent: status 2 at the command line),
False when every episode was lost to the host or a sampler (``infra_failed``
from a sampler, never the user's fault, status 1).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from mixrl.records.trajectory import UNREWARDED

# infra_failed reasons that are the run's own code (the environment), not the host or a sampler
_USER_INFRA = ("env.step raised", "env raised")  # rollout.session's reasons


class EpisodesFailed(RuntimeError):
    """The run's episodes give nothing to learn from (``user``: the run's own code failed)."""

    def __init__(self, message: str, user: bool) -> None:
        super().__init__(message)
        self.user = user


def _reason(t: Any) -> str:
    return str(t.info.get("error") or "no reason recorded")


def check_episodes(trajs: Sequence[Any], on_error: str, where: str) -> None:
    """Raise :class:`EpisodesFailed` when ``trajs`` (one batch, or one evaluation) must end the run."""

    if on_error == "fail":
        bad = next((t for t in trajs if t.status == "reward_failed"), None)
        if bad is not None:
            raise EpisodesFailed(f"{_reason(bad)} ({where}; reward.on_error = \"skip\" would leave such "
                                 "episodes out instead)", user=True)
    if not trajs or any(t.status not in UNREWARDED for t in trajs):
        return
    statuses = Counter(t.status for t in trajs)
    reasons = Counter(_reason(t) for t in trajs)
    top, n = reasons.most_common(1)[0]
    counts = ", ".join(f"{s} {c}" for s, c in statuses.most_common())
    user = any(s != "infra_failed" for s in statuses) or top.startswith(_USER_INFRA)
    raise EpisodesFailed(f"no episode of the {where} has a reward ({counts} of {len(trajs)}): nothing to learn "
                         f"from; most common reason ({n}x): {top}", user=user)
