"""Debug mode (``fleet.check_loads``): every replica proves, after every weights load, that it
serves the version it says it serves.

    check = LoadCheck(vocab_size)
    check.expect(version, await trainer.probe_logprobs(check.prompts))   # before publishing it
    await check.after_load(name, group, handle, version)                 # the fleet, after each load

``prompts`` are a few fixed token sequences. For each, the replica samples one token at
temperature 1 and records the head of its distribution (``head:8``: the log-probabilities,
under the weights it runs, of its 8 most likely tokens); the trainer gave, for the same
version and before publishing it, the whole next-token distribution after each prompt. The
deviation is ``max |log q - log p|`` over those tokens and prompts.
A profile's own numerics (FP8, NVFP4, an FP8 KV cache) make it non-zero: each group's first
check sets its floor ``d0``, and a later load fails when its deviation exceeds
``FACTOR * d0 + SLACK`` — a replica still serving older weights (or half of the new ones:
a stale packed copy of one layer) deviates by as much as the weights moved.
``metrics()``: the newest deviation per group (``fleet/load_check/max_abs_logq/<group>``).
"""

from __future__ import annotations

import math
import random
from typing import Any

from mixrl.records.generation import GenerationRequest, SamplingParams

FACTOR, SLACK = 3.0, 0.01
N_PROMPTS, PROMPT_LEN, HEAD = 4, 6, 8


class StaleWeights(RuntimeError):
    """A replica serves other weights than the version it loaded."""


class LoadCheck:
    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        rng = random.Random(f"load-check/{seed}")
        self.prompts = [[rng.randrange(2, vocab_size) for _ in range(PROMPT_LEN)] for _ in range(N_PROMPTS)]
        self._expected: dict[int, list[list[float]]] = {}
        self.floor: dict[str, float] = {}  # group -> d0
        self.latest: dict[str, float] = {}
        self.failure: StaleWeights | None = None

    def expect(self, version: int, logprobs: list[list[float]]) -> None:
        """The trainer's next-token log-probabilities after each prompt, for ``version``."""
        self._expected[version] = logprobs
        for v in [v for v in self._expected if v < version - 4]:  # replicas load recent versions only
            del self._expected[v]

    async def after_load(self, name: str, group: str, handle: Any, version: int) -> float:
        """The deviation of replica ``name`` at ``version``; raises ``StaleWeights`` (and keeps it in
        ``failure``) past the group's bound."""
        want = self._expected.get(version)
        if want is None:
            return math.nan  # a version this check was not given (published before it started)
        dev = 0.0
        for i, (ids, lp) in enumerate(zip(self.prompts, want, strict=True)):
            params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=1, record=f"head:{HEAD}",
                                    stop_ids=(), seed=1_000_003 * (version + 1) + i)
            res = await handle.generate(GenerationRequest(list(ids), params, request_id=f"load-check/{version}/{i}"))
            if res.version != version:
                return self._fail(name, version, f"answered with version {res.version}")
            pairs = [(res.token_ids[0], res.logprobs[0]), *zip(res.cand_ids, res.cand_logprobs, strict=True)]
            dev = max(dev, *(abs(float(q) - lp[t]) for t, q in pairs))
        self.latest[group] = dev
        d0 = self.floor.setdefault(group, dev)
        if dev > FACTOR * d0 + SLACK:
            self._fail(name, version, f"its log q is {dev:.3g} from the trainer's (at its first check {d0:.3g}; "
                                      f"bound {FACTOR:g} x that + {SLACK:g})")
        return dev

    def _fail(self, name: str, version: int, why: str) -> float:
        self.failure = StaleWeights(f"replica {name} does not serve weights version {version}: {why} "
                                    "(fleet.check_loads)")
        raise self.failure

    def metrics(self) -> dict[str, float]:
        return {f"fleet/load_check/max_abs_logq/{g}": v for g, v in self.latest.items()}
