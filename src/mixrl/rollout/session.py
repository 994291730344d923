"""The session runner: one (multi-turn) episode, token in, token out.

    tokens = env.reset()                                   # prompt, loss_mask 0
    loop:
        result = generate(tokens, params)                  # one assistant turn
        tokens += result.token_ids                         # loss_mask 1, per-token q, version, group
        step = env.step(result.token_ids, finish_reason)
        tokens += step.tokens                              # tool output + next header, loss_mask 0
        until step.done, or the token budget is spent (status "truncated")

Invariants (tested): ``traj.tokens`` is exactly the concatenation of the
prompt, generated and environment ids (nothing is decoded and re-encoded);
``loss_mask`` is 1 exactly on generated ids; each generated id carries the
sampler logprob, weights version and group of the result that produced it;
candidates are appended ragged, one offset per generated id.

Status rules:

- the env ends the episode: its status and reward (``ok``, ``format_error``,
  ``max_turns``); ``infra_failed`` from the env always gets reward ``None``;
- the total budget ``max_total_tokens`` runs out before the env is done:
  ``truncated``, reward 0 (the model was too long; tokens never exceed the budget);
- the sampler fails (finish reason ``numerical_error``, ``error`` or
  ``context_exceeded``), ``generate`` raises, or the env raises:
  ``infra_failed``, reward ``None`` and the reason in ``info["error"]`` —
  never a reward of 0. The failed result's tokens are not kept.

Stop ids: the request's ``stop_ids`` are ``params.stop_ids`` plus the env's
``stop_ids`` attribute when it has one (the chat format's end of turn).

Resume (checkpoints, a replica lost mid-episode): ``resume`` is a partial
trajectory of the same task. The env is reset and the completed turns are
replayed into it (deterministic envs give the same tokens back; a mismatch is
``infra_failed``). If the last generated run has no env tokens after it, no
entry in ``info["finish_reasons"]`` and no stop id at its end, that turn was
cut mid-way: it continues from the whole prefix and the two pieces form one
turn, each token keeping its own version and group (a last run that ends
with a stop id is a finished turn the env has not answered yet: it is
stepped). The runner closes the env at the end.

Interruptible turns (``chunk_tokens > 0``, ``rollout.interrupt_tokens``): a turn is
asked for in pieces of at most ``chunk_tokens`` tokens, each piece a request with the
whole prefix (prompt + the turn so far). A replica loads new weights between two
batches, so a weights version published while a long turn is being decoded takes
effect at the next piece: the turn is paused, the new weights loaded, and decoding
continues by prefilling the tokens generated so far under them (as AReaL and slime
do). Each token keeps the version, group and log q of the piece that produced it,
which are the behaviour log-probabilities the trainer's corrections use. A piece
that ends with a stop id ends the turn; one that is spent (``length``, all its
tokens) is continued; the turn's limits (``max_new_tokens``, the total budget) are
those of the whole turn, never of a piece.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable

from mixrl.envs.base import Env, StepResult
from mixrl.records.generation import GenerationRequest, GenerationResult, SamplingParams
from mixrl.records.trajectory import Trajectory

Generate = Callable[[GenerationRequest], Awaitable[GenerationResult]]
SAMPLER_FAILURES = ("numerical_error", "error", "context_exceeded")


class _InfraError(Exception):
    pass


def piece_id(turn_id: str, done: int, cut: bool) -> str:
    """Request id of one piece of a turn: ``@k`` after k tokens of it, ``~`` when the piece
    is shorter than what the turn may still generate (so a ``length`` finish is not its end)."""
    return turn_id + (f"@{done}" if done else "") + ("~" if cut else "")


def piece_cut(req: GenerationRequest, res: GenerationResult) -> bool:
    """True when ``res`` answers a cut piece (``piece_id`` with ``~``) and stopped only
    because the piece was spent: the turn goes on."""
    return (req.request_id.endswith("~") and res.finish_reason == "length"
            and len(res.token_ids) == req.params.max_new_tokens)


def _runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs (start, end, mask value) of ``mask``."""
    out: list[tuple[int, int, int]] = []
    for i, m in enumerate(mask):
        if out and out[-1][2] == m:
            out[-1] = (out[-1][0], i + 1, m)
        else:
            out.append((i, i + 1, m))
    return out


def _finish(traj: Trajectory, status: str, reward: float | None, error: str = "") -> Trajectory:
    traj.status = status
    traj.reward = None if status == "infra_failed" else reward
    if error:
        traj.info["error"] = error
    traj.info["done"] = True
    return traj


async def _replay(
    env: Env, resume: Trajectory, stop: tuple[int, ...]
) -> tuple[Trajectory, int, StepResult | None]:
    """Reset ``env`` and feed it the completed turns of ``resume``.

    Returns (trajectory copy, length of an unfinished last turn or 0, the
    final step when the last recorded turn ended the episode).
    """
    traj = Trajectory.from_dict(dataclasses.replace(resume, info=dict(resume.info)).to_dict())
    traj.info["finish_reasons"] = list(resume.info.get("finish_reasons", []))
    prompt = await env.reset()
    runs = _runs(traj.loss_mask)
    if not runs or runs[0][2] != 0 or traj.tokens[: runs[0][1]] != prompt:
        raise _InfraError("resume: the trajectory does not start with this env's prompt")
    reasons = traj.info["finish_reasons"]
    gen_runs = [r for r in runs if r[2] == 1]
    for k, (s, e, _) in enumerate(gen_runs):
        nxt = next((r for r in runs if r[0] == e), None)
        if k >= len(reasons):  # no recorded finish reason: infer it from the stop id
            if nxt is None and traj.tokens[e - 1] not in stop:
                # Cut mid-way: continue it. (A turn that had reached the turn limit
                # gets no new tokens and is stepped as "length".)
                return traj, e - s, None
            reasons.append("stop" if traj.tokens[e - 1] in stop else "length")
        traj.turns = k + 1
        step = await env.step(traj.tokens[s:e], reasons[k])
        if nxt is None:
            # Completed turn whose env answer was not recorded yet: take it now.
            if step.done:
                return traj, 0, step
            traj.append_env(step.tokens)
            return traj, 0, None
        if step.tokens != traj.tokens[nxt[0] : nxt[1]]:
            raise _InfraError(f"resume: env tokens differ from the record after turn {k}")
    return traj, 0, None


async def run_episode(
    env: Env,
    generate: Generate,
    params: SamplingParams,
    *,
    prompt_id: str,
    sample_idx: int,
    max_total_tokens: int,
    resume: Trajectory | None = None,
    chunk_tokens: int = 0,
) -> Trajectory:
    """Run one episode of ``env``; see the module docstring for every rule.

    ``chunk_tokens > 0``: a turn is generated in pieces of at most that many tokens
    (see "Interruptible turns" in the module docstring)."""
    if max_total_tokens < 1:
        raise ValueError(f"run_episode: max_total_tokens must be >= 1, got {max_total_tokens}")
    t_start = time.perf_counter()
    ep = _Episode(env, generate, params, max_total_tokens, chunk_tokens,
                  Trajectory(prompt_id=prompt_id, sample_idx=sample_idx, task=env.task.family))
    try:
        if resume is not None and resume.info.get("done"):
            return resume
        partial = await ep.start(resume)
        while True:
            turn_start = len(ep.traj.tokens) - partial
            finish = await ep.generate_turn(partial)
            partial = 0
            await ep.answer_turn(turn_start, finish)
    except _Ended as e:
        return _finish(ep.traj, e.status, e.reward, e.error)
    except _InfraError as e:
        return _finish(ep.traj, "infra_failed", None, str(e))
    except Exception as e:  # env.reset or the replay into it failed: the environment's code, never the model's
        return _finish(ep.traj, "infra_failed", None, f"env raised {type(e).__name__}: {e}")
    finally:
        ep.timings["total_s"] = time.perf_counter() - t_start
        for k, v in ep.timings.items():
            ep.traj.timings[k] = ep.traj.timings.get(k, 0.0) + v
        try:
            await env.close()
        except Exception as e:  # a close failure does not change the episode's outcome
            ep.traj.info["close_error"] = f"{type(e).__name__}: {e}"


class _Ended(Exception):
    """The episode is over with this status, reward and error (``_finish``'s arguments)."""

    def __init__(self, status: str, reward: float | None, error: str = "") -> None:
        super().__init__(status)
        self.status, self.reward, self.error = status, reward, error


class _Episode:
    """One episode between its turns: the trajectory so far, the stop ids, the timers.

    ``generate_turn`` asks the sampler for one assistant turn (in pieces when
    ``chunk_tokens > 0``); ``answer_turn`` gives it to the env and appends the env's
    tokens. Either raises ``_Ended`` when the episode is over.
    """

    def __init__(self, env: Env, generate: Generate, params: SamplingParams, max_total_tokens: int,
                 chunk_tokens: int, traj: Trajectory) -> None:
        self.env, self.generate, self.params = env, generate, params
        self.max_total_tokens, self.chunk_tokens = max_total_tokens, chunk_tokens
        self.stop = tuple(dict.fromkeys(tuple(params.stop_ids) + tuple(getattr(env, "stop_ids", ()))))
        self.traj = traj
        traj.info["finish_reasons"] = []
        self.timings = {"generate_s": 0.0, "env_s": 0.0}

    async def start(self, resume: Trajectory | None) -> int:
        """Reset the env (replaying ``resume``'s turns); the length of an unfinished last turn."""
        t0 = time.perf_counter()
        if resume is None:
            self.traj.append_env(await self.env.reset())
            partial = 0
        else:
            traj, partial, final = await _replay(self.env, resume, self.stop)
            traj.prompt_id, traj.sample_idx = self.traj.prompt_id, self.traj.sample_idx
            self.traj = traj
            if final is not None:
                raise _Ended(final.status or "ok", final.reward, final.info.get("error", ""))
        self.timings["env_s"] += time.perf_counter() - t0
        return partial

    async def generate_turn(self, partial: int) -> str:
        """Generate the rest of a turn that has ``partial`` tokens; its finish reason."""
        traj = self.traj
        while True:
            room = self.max_total_tokens - len(traj.tokens)
            if room <= 0:
                raise _Ended("truncated", 0.0)
            want = self.params.max_new_tokens - partial
            if want <= 0:  # a resumed partial turn already used its whole turn limit
                return "length"
            max_new = min(want, room)
            piece = min(max_new, self.chunk_tokens) if self.chunk_tokens > 0 else max_new
            turn_id = f"{traj.prompt_id}/{traj.sample_idx}/{len(traj.info['finish_reasons'])}"
            req = GenerationRequest(
                prompt_ids=list(traj.tokens),
                params=dataclasses.replace(self.params, max_new_tokens=piece, stop_ids=self.stop),
                request_id=piece_id(turn_id, partial, piece < max_new) if self.chunk_tokens > 0 else turn_id,
            )
            res = await self._sample(req)
            traj.append_generated(res, req.params)  # the trainer uses these params, not the run-wide ones
            if piece_cut(req, res):  # a piece of a longer turn: continue it (maybe under new weights)
                partial += len(res.token_ids)
                continue
            if res.finish_reason == "length" and max_new < want:
                raise _Ended("truncated", 0.0)  # cut by the total budget, not the turn limit
            return res.finish_reason

    async def _sample(self, req: GenerationRequest) -> GenerationResult:
        """One request's result; a failed or malformed one ends the episode as ``infra_failed``."""
        t0 = time.perf_counter()
        try:
            res = await self.generate(req)
        except Exception as e:  # retries exhausted upstream: our failure, not the model's
            raise _Ended("infra_failed", None, f"generate raised {type(e).__name__}: {e}") from None
        self.timings["generate_s"] += time.perf_counter() - t0
        if res.finish_reason in SAMPLER_FAILURES:
            self.traj.num_nonfinite += res.num_nonfinite
            raise _Ended("infra_failed", None,
                         f"sampler finish_reason={res.finish_reason} group={res.group!r}: {res.error}")
        n, limit = len(res.token_ids), req.params.max_new_tokens
        if not 1 <= n <= limit:
            raise _Ended("infra_failed", None, f"sampler returned {n} tokens (limit {limit})")
        return res

    async def answer_turn(self, turn_start: int, finish: str) -> None:
        """Step the env with the turn that starts at ``turn_start``; append its answer."""
        traj = self.traj
        reasons: list[str] = traj.info["finish_reasons"]
        reasons.append(finish)
        traj.turns = len(reasons)
        t0 = time.perf_counter()
        try:
            step = await self.env.step(traj.tokens[turn_start:], finish)
        except Exception as e:  # an env bug is ours, never the model's
            raise _Ended("infra_failed", None, f"env.step raised {type(e).__name__}: {e}") from None
        self.timings["env_s"] += time.perf_counter() - t0
        traj.num_malformed += int(step.malformed)
        if step.info:
            traj.info.setdefault("env", []).append(step.info)
        total = len(traj.tokens) + len(step.tokens)
        if step.done:
            if step.tokens and total <= self.max_total_tokens:
                traj.append_env(step.tokens)
            raise _Ended(step.status or "ok", step.reward, step.info.get("error", ""))
        if total >= self.max_total_tokens:
            raise _Ended("truncated", 0.0)  # no room left for another reply
        traj.append_env(step.tokens)
