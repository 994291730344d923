"""The built-in sampling engine: batched, seeded, precision-emulating decoding in torch.

``BuiltinEngine`` loads any HF causal LM through ``transformers``, keeps its own
fake-quantized weights and decodes incrementally with a KV cache: one prefill
over the left-padded prompts, then one token per step for the whole batch;
new requests can join a running batch between steps (``stream``, ``running``).
Two paths (``forward=``): ``"fast"``, the hand-fused kernels of dense
decoders (Qwen3, Llama, Mistral, Qwen2: ``fast``/``decoder_forward``), and ``"generic"``, the HF model's own modules with
the formats applied in place (``generic``); ``"auto"`` (default) takes the fast
path where it applies (``fast.applies``) and the generic one otherwise.
KV is computed once where it can be (``prefix_cache``): a cohort's identical prompts
share one prefill, and a session's KV is kept between its requests (LRU under
``kv_retain_bytes``), so its next turn prefills only its new tokens.
MoE models (generic path) also record, per generated token, the top-k experts
each layer routed the position that produced it to (``routed_experts``).

Per generated token it records the sampled id, ``log q`` under the distribution
actually sampled from (``sample.sampling_logprobs``) and the candidates that
``SamplingParams.record`` asks for. Reproducibility: request ``j`` (counting
every request this engine has seen) draws its uniforms from a generator seeded
with ``params.seed`` or, when that is None, ``mix(engine seed, j)``; so the same
engine seed and the same request sequence give identical tokens, and a request
with its own seed gives the same tokens in any batch.

Edge cases, each failing one request and never the batch:
- empty prompt or an id outside the vocabulary -> ``finish_reason="error"``;
- prompt length >= ``max_context`` (no room for one token) -> ``"context_exceeded"``;
- a non-finite logit in a row (counted after the temperature division, which can
  overflow) -> that request ends ``"numerical_error"`` with ``num_nonfinite``
  counted; that step's token is not emitted, so no NaN log-prob ever leaves the
  engine. The other rows of the batch are unaffected (attention never mixes rows).
Generation ends with ``"stop"`` after emitting a stop id (``params.stop_ids``, plus
the model's EOS ids unless ``stop_on_eos=False``) and with ``"length"`` after
``max_new_tokens`` or when prompt + output reaches ``max_context``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mixrl.records.generation import FinishReason, GenerationRequest, GenerationResult
from mixrl.sampling.base import Engine
from mixrl.sampling.builtin import fast
from mixrl.sampling.builtin.precision import from_profile
from mixrl.sampling.builtin.prefix_cache import PrefixStore
from mixrl.sampling.builtin.running import Running
from mixrl.sampling.support import check_builtin
from mixrl.system.memory import release_freed_memory

_MASK64 = (1 << 64) - 1


def request_seed(engine_seed: int, index: int) -> int:
    """splitmix64 of (engine seed, request index): well-spread 63-bit generator seeds."""
    z = (engine_seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def _eos_ids(model_path: str, cfg: Any) -> frozenset[int]:
    eos: Any = None
    try:
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:  # no generation_config.json: fall back to the model config
        pass
    if eos is None:
        eos = getattr(cfg, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


def _fast_only(device: str, scaled_mm: bool, generic: str | None) -> torch.device:
    """``device`` as a torch device; what only the fast path runs refused on the generic one
    (``generic``: why this model takes it, None when it takes the fast path)."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: this process sees no CUDA device")
    for what, asked in ((f"device={device!r}", dev.type != "cpu"), ("fp8_gemm='scaled_mm'", scaled_mm)):
        if asked and generic is not None:
            raise ValueError(f"{what} runs on the fast path only (dense decoders); this model takes the "
                             f"generic one: {generic}")
    return dev


class BuiltinEngine(Engine):
    """Torch engine for HF causal LMs in one precision profile (see module doc).

    Args:
        model_path: HF model directory (config + weights), loaded through transformers.
        profile: a ``Profile``: weight/KV/activation formats, compute dtype, lm_head.
        group: sampler-group name stamped on every result.
        seed: engine seed for requests without ``params.seed``.
        max_batch: rows decoded together; a longer request list runs in chunks of
            this size, grouped by prompt length to limit padding.
        max_batch_tokens: token budget of one decoded chunk, ``rows x (longest prompt
            + longest output)``: the KV cache and activations it allocates. Chunks are cut
            to fit it whatever the number of requests; a request alone may exceed it. None
            = ``profile.max_batch_tokens`` (set per group by ``fleet.groups.*.overrides``),
            else only ``max_batch`` bounds a chunk.
        max_context: prompt + output limit (default and maximum: the config's
            ``max_position_embeddings``).
        num_threads: ``torch.set_num_threads`` for the process (torch is process-wide).
        stop_on_eos: also stop on the model's EOS ids (generation_config, else config).
        forward: ``"auto"`` | ``"fast"`` (dense decoders, ``fast.applies``) | ``"generic"`` (see module doc);
            ``path_name`` says which one runs.
        prefix_reuse: prefill a cohort's identical prompts once and reuse a session's KV
            across its requests (``prefix_cache``; generic path: full-attention models only).
        kv_retain_bytes: byte budget of the sessions' KV kept between requests (LRU); None =
            ``profile.kv_retain_bytes``; 0 keeps none (prefix sharing within a cohort stays).
        device: where the weights, the KV cache and the forward live ("cpu", "cuda", "cuda:1");
            sampling and its records stay on the CPU. Another device than the CPU takes the
            fast path (``fast``); a GPU group of a run gets "cuda" (``fleet.groups.*.num_gpus``
            or ``cuda_devices``).
        lazy_weights: on the fast path, build the checkpoint's weights only when a batch first
            needs them: a replica whose first act is loading the trainer's version (a sampler
            worker) never loads the HF model nor builds weights it would replace at once. The
            same weights either way (``weights``).

    Decoding runs in ``running.Running``: rows that finish leave at once and are
    dropped from the tensors once a quarter of the batch has finished, so long tails
    do not pay for finished rows; ``stream()`` opens a batch that new requests join
    between steps (continuous batching). ``version`` is 0 for the
    checkpoint at ``model_path``; ``load_weights`` sets the trainer's versions.
    """

    def __init__(
        self,
        model_path: str,
        profile: Any,
        group: str,
        *,
        seed: int = 0,
        max_batch: int = 64,
        max_context: int | None = None,
        num_threads: int | None = None,
        stop_on_eos: bool = True,
        forward: str = "auto",
        max_batch_tokens: int | None = None,
        prefix_reuse: bool = True,
        kv_retain_bytes: int | None = None,
        device: str = "cpu",
        lazy_weights: bool = False,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_batch_tokens is None:
            max_batch_tokens = getattr(profile, "max_batch_tokens", None)
        if max_batch_tokens is not None and max_batch_tokens < 2:
            raise ValueError(f"max_batch_tokens must be >= 2, got {max_batch_tokens}")
        self.max_batch_tokens = max_batch_tokens
        if num_threads is not None:
            if num_threads < 1:
                raise ValueError(f"num_threads must be >= 1, got {num_threads}")
            torch.set_num_threads(num_threads)
        from transformers import AutoConfig

        if forward not in ("auto", "fast", "generic"):
            raise ValueError(f"forward must be 'auto', 'fast' or 'generic', got {forward!r}")
        cfg = AutoConfig.from_pretrained(model_path)

        check_builtin(cfg)  # an architecture this engine cannot run: one clear error
        why_not = fast.applies(cfg)
        if forward == "fast" and why_not:
            raise ValueError(f"forward='fast' cannot run this model: {why_not}")
        use_fast = forward == "fast" or (forward == "auto" and why_not is None)
        limit = int(getattr(cfg, "max_position_embeddings", None) or 1 << 20)
        if max_context is not None and not 2 <= max_context <= limit:
            raise ValueError(
                f"max_context must be in [2, config.max_position_embeddings={limit}], got {max_context}"
            )
        self.max_context = max_context or limit
        self.profile = profile
        self.prec = from_profile(profile)
        self.device = _fast_only(device, self.prec.scaled_mm, None if use_fast else why_not or f"forward={forward!r}")
        self.group = group
        self.seed = seed
        self.max_batch = max_batch
        self.eos_ids = _eos_ids(model_path, cfg) if stop_on_eos else frozenset()
        self.pad_id = 0  # any in-vocabulary id: padded columns are masked out
        self._seen = 0  # requests seen, for default per-request seeds
        self.model_path = model_path
        self._weights: Any = None
        self._make_path(cfg, use_fast, lazy_weights)
        self.path_name = self.path.name
        # KV reuse (prefix_cache): a cohort's identical prompts prefilled once, sessions' KV kept
        self.prefix_reuse = prefix_reuse and getattr(self.path, "reuses_kv", True)
        budget = kv_retain_bytes if kv_retain_bytes is not None else getattr(profile, "kv_retain_bytes", 0)
        across = bool(getattr(profile, "kv_reuse_across_versions", False))
        self.kv_store = PrefixStore(budget, across) if self.prefix_reuse and budget > 0 else None
        self.vocab = self.path.vocab
        self._vocab_ids = list(range(self.vocab))  # the support when nothing is truncated
        self.version = 0  # the checkpoint at model_path; load_weights sets the trainer's versions
        # True where loads come only between batches (a sampler worker's BatchingSampler): the old
        # weights are dropped before the new ones are built, so a load holds one copy, not two. A
        # load that fails then leaves no weights (the worker reports the replica failed); False
        # (default) keeps the old weights serving until the new ones are in.
        self.free_before_load = False

    def _make_path(self, cfg: Any, use_fast: bool, lazy: bool) -> None:
        if use_fast:
            self.path: Any = fast.FastPath(cfg, self.prec, self.max_context, self.max_batch, self.device)
            if not lazy:
                self._weights = self._checkpoint_weights()
            return
        from transformers import AutoModelForCausalLM

        from mixrl.sampling.builtin.generic import GenericPath

        with torch.inference_mode():  # the generic path runs the HF model's own modules: loaded now
            hf = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32)
            self.path = GenericPath(hf, self.prec)
            self._weights = self.path.build(hf.state_dict())
        del hf
        release_freed_memory()  # the HF model's pages (memory.py)

    # ------------------------------------------------------------------ weights
    @property
    def weights(self) -> Any:
        """The served weights: the last load's, else the checkpoint's (built on first use with
        ``lazy_weights``)."""
        if self._weights is None:
            self._weights = self._checkpoint_weights()
        return self._weights

    @weights.setter
    def weights(self, w: Any) -> None:
        self._weights = w

    def built_weights(self) -> Any:
        """The served weights if built (None: none yet, ``lazy_weights``), building nothing."""
        return self._weights

    def _checkpoint_weights(self) -> Any:
        from transformers import AutoModelForCausalLM

        with torch.inference_mode():
            hf = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32)
            w = self.path.build(hf.state_dict())
        del hf
        release_freed_memory()  # the HF model's pages (memory.py)
        return w

    def load_weights(self, state_dict: Mapping[str, Any], version: int) -> None:
        """Quantize the trainer's weights (HF names, any dtype) on load; swap them in whole."""
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"version must be an int >= 0, got {version!r}")
        if self.free_before_load:  # one copy of the weights at a time (see __init__)
            self._weights = None
        with torch.inference_mode():
            w = self.path.build(state_dict)
        self.weights, self.version = w, version  # a running batch keeps its own reference
        del w
        release_freed_memory()  # the previous weights' pages, unless a running batch holds them
        if self.kv_store is not None:
            self.kv_store.drop_older(version)

    def idle_kv_bytes(self) -> int:
        """Bytes of the idle KV storage the path keeps for the next batch (0: none kept)."""
        f = getattr(self.path, "idle_bytes", None)
        return int(f()) if f is not None else 0

    # --------------------------------------------------------------- generation
    def seed_for(self, r: GenerationRequest) -> int:
        """The generator seed of the next request the engine sees (every request counts)."""
        seed = r.params.seed if r.params.seed is not None else request_seed(self.seed, self._seen)
        self._seen += 1
        return seed

    def stream(self) -> Running:
        """A batch that requests join between decode steps (continuous batching), on the
        weights loaded now; see ``running``."""
        return Running(self)

    def generate_batch(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        results: list[GenerationResult | None] = [None] * len(requests)
        ok: list[tuple[int, int]] = []  # (request index, generator seed)
        for i, r in enumerate(requests):
            seed = self.seed_for(r)
            reason, msg = self._check(r)
            if reason is None:
                ok.append((i, seed))
            else:
                results[i] = self._failed(reason, msg)
        ok.sort(key=lambda t: len(requests[t[0]].prompt_ids))  # similar lengths share a batch
        for chunk in self._chunks(ok, requests):
            run = Running(self)
            run._admit([(i, requests[i], s) for i, s in chunk])  # one prefill for the chunk
            while run.rows:
                for i, res in run.step():
                    results[i] = res
        return [r for r in results if r is not None]

    def _chunks(self, ok: list[tuple[int, int]], requests: list[GenerationRequest]) -> list[list[tuple[int, int]]]:
        """Consecutive runs of ``ok`` with at most ``max_batch`` rows and ``max_batch_tokens``
        cache columns in all (rows x (longest prompt + longest output), as ``_run`` allocates)."""
        out: list[list[tuple[int, int]]] = []
        cur: list[tuple[int, int]] = []
        P = N = 0
        for item in ok:
            n = len(requests[item[0]].prompt_ids)
            p, m = max(P, n), max(N, min(requests[item[0]].params.max_new_tokens, self.max_context - n))
            over = self.max_batch_tokens is not None and (len(cur) + 1) * (p + m) > self.max_batch_tokens
            if cur and (len(cur) == self.max_batch or over):
                out.append(cur)
                cur, p, m = [], n, min(requests[item[0]].params.max_new_tokens, self.max_context - n)
            cur.append(item)
            P, N = p, m
        return out + [cur] if cur else out

    def _check(self, r: GenerationRequest) -> tuple[FinishReason | None, str]:
        n, V = len(r.prompt_ids), self.vocab
        if n == 0:
            return "error", f"request {r.request_id!r}: prompt_ids is empty"
        bad = next((t for t in r.prompt_ids if not (isinstance(t, int) and 0 <= t < V)), None)
        if bad is not None:
            return "error", f"request {r.request_id!r}: prompt_ids contains {bad!r}, outside [0, {V})"
        if n >= self.max_context:
            return "context_exceeded", (
                f"request {r.request_id!r}: prompt_ids has {n} tokens, max_context is "
                f"{self.max_context}: no room to generate"
            )
        return None, ""

    def _failed(self, reason: FinishReason, msg: str) -> GenerationResult:
        return GenerationResult(
            token_ids=[], logprobs=[], cand_offsets=[0], cand_ids=[], cand_logprobs=[],
            cand_kind="none", version=self.version, group=self.group, finish_reason=reason, error=msg,
        )
