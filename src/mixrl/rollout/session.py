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
from typing import Any

from mixrl.envs.base import Env, StepResult
from mixrl.rollout.types import Trajectory
from mixrl.sampling.base import GenerationRequest, GenerationResult, SamplingParams

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
    stop = tuple(dict.fromkeys(tuple(params.stop_ids) + tuple(getattr(env, "stop_ids", ()))))
    t_start = time.perf_counter()
    traj = Trajectory(prompt_id=prompt_id, sample_idx=sample_idx, task=env.task.family)
    traj.info["finish_reasons"] = []
    timings = {"generate_s": 0.0, "env_s": 0.0}
    try:
        partial = 0
        if resume is not None and resume.info.get("done"):
            return resume
        t0 = time.perf_counter()
        if resume is None:
            traj.append_env(await env.reset())
        else:
            traj, partial, final = await _replay(env, resume, stop)
            traj.prompt_id, traj.sample_idx = prompt_id, sample_idx
            if final is not None:
                return _finish(traj, final.status or "ok", final.reward, final.info.get("error", ""))
        timings["env_s"] += time.perf_counter() - t0
        reasons: list[str] = traj.info["finish_reasons"]
        while True:
            room = max_total_tokens - len(traj.tokens)
            if room <= 0:
                return _finish(traj, "truncated", 0.0)
            want = params.max_new_tokens - partial
            turn_start = len(traj.tokens) - partial
            if want <= 0:  # a resumed partial turn already used its whole turn limit
                finish = "length"
            else:
                max_new = min(want, room)
                piece = min(max_new, chunk_tokens) if chunk_tokens > 0 else max_new
                req = GenerationRequest(
                    prompt_ids=list(traj.tokens),
                    params=dataclasses.replace(params, max_new_tokens=piece, stop_ids=stop),
                    request_id=piece_id(f"{prompt_id}/{sample_idx}/{len(reasons)}", partial, piece < max_new)
                    if chunk_tokens > 0 else f"{prompt_id}/{sample_idx}/{len(reasons)}",
                )
                t0 = time.perf_counter()
                try:
                    res = await generate(req)
                except Exception as e:  # retries exhausted upstream: our failure, not the model's
                    return _finish(traj, "infra_failed", None, f"generate raised {type(e).__name__}: {e}")
                timings["generate_s"] += time.perf_counter() - t0
                if res.finish_reason in SAMPLER_FAILURES:
                    traj.num_nonfinite += res.num_nonfinite
                    msg = f"sampler finish_reason={res.finish_reason} group={res.group!r}: {res.error}"
                    return _finish(traj, "infra_failed", None, msg)
                n = len(res.token_ids)
                if not 1 <= n <= piece:
                    return _finish(traj, "infra_failed", None, f"sampler returned {n} tokens (limit {piece})")
                traj.append_generated(res, req.params)  # the trainer uses these params, not the run-wide ones
                finish = res.finish_reason
                if piece_cut(req, res):  # a piece of a longer turn: continue it (maybe under new weights)
                    partial += n
                    continue
                if finish == "length" and max_new < want:
                    return _finish(traj, "truncated", 0.0)  # cut by the total budget, not the turn limit
            turn = traj.tokens[turn_start:]
            partial = 0
            reasons.append(finish)
            traj.turns = len(reasons)
            t0 = time.perf_counter()
            try:
                step = await env.step(turn, finish)
            except Exception as e:  # an env bug is ours, never the model's
                return _finish(traj, "infra_failed", None, f"env.step raised {type(e).__name__}: {e}")
            timings["env_s"] += time.perf_counter() - t0
            traj.num_malformed += int(step.malformed)
            if step.info:
                traj.info.setdefault("env", []).append(step.info)
            if step.done:
                if step.tokens and len(traj.tokens) + len(step.tokens) <= max_total_tokens:
                    traj.append_env(step.tokens)
                return _finish(traj, step.status or "ok", step.reward, step.info.get("error", ""))
            if len(traj.tokens) + len(step.tokens) >= max_total_tokens:
                return _finish(traj, "truncated", 0.0)  # no room left for another reply
            traj.append_env(step.tokens)
    except _InfraError as e:
        return _finish(traj, "infra_failed", None, str(e))
    except Exception as e:  # env.reset or replay failed: ours
        return _finish(traj, "infra_failed", None, f"{type(e).__name__}: {e}")
    finally:
        timings["total_s"] = time.perf_counter() - t_start
        for k, v in timings.items():
            traj.timings[k] = traj.timings.get(k, 0.0) + v
        try:
            await env.close()
        except Exception as e:  # a close failure does not change the episode's outcome
            traj.info["close_error"] = f"{type(e).__name__}: {e}"


def episode_summary(traj: Trajectory) -> dict[str, Any]:
    """A small dict for logs."""
    return {
        "prompt_id": traj.prompt_id,
        "sample_idx": traj.sample_idx,
        "status": traj.status,
        "reward": traj.reward,
        "turns": traj.turns,
        "num_generated": traj.num_generated,
        "len": len(traj.tokens),
    }
