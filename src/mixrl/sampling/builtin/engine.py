"""The built-in sampling engine: batched, seeded, precision-emulating decoding in torch.

``BuiltinEngine`` loads any HF causal LM through ``transformers``, keeps its own
fake-quantized weights and decodes incrementally with a KV cache: one prefill
over the left-padded prompts, then one token per step for the whole batch.
Two paths (``forward=``): ``"fast"``, the hand-fused Qwen3 kernels
(``fast``/``qwen3_forward``), and ``"generic"``, the HF model's own modules with
the formats applied in place (``generic``); ``"auto"`` (default) takes the fast
path where it applies (``fast.applies``) and the generic one otherwise.
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

import time
from collections.abc import Mapping
from typing import Any

import torch

from mixrl.sampling.base import Engine, FinishReason, GenerationRequest, GenerationResult
from mixrl.sampling.builtin import fast
from mixrl.sampling.builtin.precision import from_profile
from mixrl.sampling.builtin.sample import draw, sampling_logprobs

_MASK64 = (1 << 64) - 1
SUPPORT_BUFFER_BYTES = 256 << 20  # above this, whole-vocabulary supports are listed step by step


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


class _Row:
    """Output being built for one request of a running batch."""

    __slots__ = ("req", "stops", "limit", "ids", "lps", "offs", "cids", "clps", "finish", "nonfinite", "error",
                 "stride", "routes")  # fmt: skip

    def __init__(self, req: GenerationRequest, stops: frozenset[int], limit: int) -> None:
        self.req, self.stops, self.limit = req, stops, limit
        self.ids: list[int] = []
        self.lps: list[float] = []
        self.offs: list[int] = [0]
        self.cids: list[int] = []
        self.clps: list[float] = []
        self.finish: FinishReason | None = None
        self.nonfinite = 0
        self.error = ""
        self.stride = 0  # V when this row's whole-vocabulary support goes to the batch buffer
        self.routes: list[list[list[int]]] = []  # MoE: per token [layers][k] experts

    def push(self, tok: int, lp: float) -> None:
        self.ids.append(tok)
        self.lps.append(lp)
        self.offs.append(len(self.ids) * self.stride if self.stride else len(self.cids))
        if tok in self.stops:
            self.finish = "stop"
        elif len(self.ids) >= self.limit:
            self.finish = "length"


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
        forward: ``"auto"`` | ``"fast"`` (Qwen3 only) | ``"generic"`` (see module doc);
            ``path_name`` says which one runs.

    Rows that finish are dropped from the running batch once a quarter of it has
    finished, so long tails do not pay for finished rows. ``version`` is 0 for the
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
        from transformers import AutoConfig, AutoModelForCausalLM

        if forward not in ("auto", "fast", "generic"):
            raise ValueError(f"forward must be 'auto', 'fast' or 'generic', got {forward!r}")
        cfg = AutoConfig.from_pretrained(model_path)
        from mixrl.sampling.support import check_builtin

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
        self.group = group
        self.seed = seed
        self.max_batch = max_batch
        self.eos_ids = _eos_ids(model_path, cfg) if stop_on_eos else frozenset()
        self.pad_id = 0  # any in-vocabulary id: padded columns are masked out
        self._seen = 0  # requests seen, for default per-request seeds
        with torch.inference_mode():
            hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
            if use_fast:
                self.path: Any = fast.FastPath(cfg, self.prec, self.max_context, max_batch)
            else:
                from mixrl.sampling.builtin.generic import GenericPath

                self.path = GenericPath(hf, self.prec)
            self._weights = self.path.build(hf.state_dict())
        del hf
        self.path_name = self.path.name
        self.vocab = self.path.vocab
        self._vocab_ids = list(range(self.vocab))  # the support when nothing is truncated
        self.version = 0  # the checkpoint at model_path; load_weights sets the trainer's versions

    # ------------------------------------------------------------------ weights
    def load_weights(self, state_dict: Mapping[str, Any], version: int) -> None:
        """Quantize the trainer's weights (HF names, any dtype) on load; swap them in whole."""
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"version must be an int >= 0, got {version!r}")
        with torch.inference_mode():
            w = self.path.build(state_dict)
        self._weights, self.version = w, version  # a running batch keeps its own reference

    # --------------------------------------------------------------- generation
    def generate_batch(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        results: list[GenerationResult | None] = [None] * len(requests)
        ok: list[tuple[int, int]] = []  # (request index, generator seed)
        for i, r in enumerate(requests):
            seed = r.params.seed if r.params.seed is not None else request_seed(self.seed, self._seen)
            self._seen += 1
            reason, msg = self._check(r)
            if reason is None:
                ok.append((i, seed))
            else:
                results[i] = self._failed(reason, msg)
        ok.sort(key=lambda t: len(requests[t[0]].prompt_ids))  # similar lengths share a batch
        for chunk in self._chunks(ok, requests):
            outs = self._run([requests[i] for i, _ in chunk], [s for _, s in chunk])
            for (i, _), res in zip(chunk, outs, strict=True):
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

    @torch.inference_mode()
    def _run(self, reqs: list[GenerationRequest], seeds: list[int]) -> list[GenerationResult]:
        w, version, path, prec, V = self._weights, self.version, self.path, self.prec, self.vocab
        t0 = time.perf_counter()
        B = len(reqs)
        lens = [len(r.prompt_ids) for r in reqs]
        P = max(lens)
        limits = [min(r.params.max_new_tokens, self.max_context - n) for r, n in zip(reqs, lens, strict=True)]
        N = max(limits)
        rows = [_Row(r, self.eos_ids | frozenset(r.params.stop_ids), lim) for r, lim in zip(reqs, limits, strict=True)]

        # Per-row tensors; all are sliced together when finished rows are dropped.
        L = torch.tensor(lens)  # [B] prompt lengths
        start = P - L  # [B] first real column (left padding)
        temp = torch.tensor([r.params.temperature for r in reqs], dtype=torch.float32)
        topk = torch.tensor([r.params.top_k for r in reqs])
        topp = torch.tensor([r.params.top_p for r in reqs], dtype=torch.float32)
        U = torch.stack([torch.rand(N, generator=torch.Generator().manual_seed(s), dtype=torch.float64) for s in seeds])  # [B, N]
        live = list(range(B))  # tensor row -> index into rows
        # Rows sampling from the whole vocabulary record log q of every token at every
        # step: buffered as a tensor and listed once at the end (far cheaper than per step).
        full = [i for i, r in enumerate(reqs) if r.params.record == "support" and r.params.top_k == 0 and r.params.top_p >= 1]
        buf = None
        if full and B * N * V * 4 <= SUPPORT_BUFFER_BYTES:
            buf = torch.empty(B, N, V)  # [B, N, V] by original row
            for i in full:
                rows[i].stride = V
        padded = min(lens) < P

        ids = torch.full((B, P), self.pad_id, dtype=torch.long)
        for i, r in enumerate(reqs):
            ids[i, P - lens[i] :] = torch.tensor(r.prompt_ids)
        batch, hidden = path.begin(w, ids, start, P + N)  # [B, H]
        t1 = time.perf_counter()

        for s in range(N):
            logits = path.logits(w, hidden)  # [b, V] fp32
            # counted after temperature: finite logits can still overflow at a tiny temperature
            nonfinite = (~torch.isfinite(logits / temp[:, None])).sum(dim=1)  # [b]
            any_bad = bool(nonfinite.any())
            if any_bad:
                logits = torch.where((nonfinite > 0)[:, None], 0.0, logits)  # keep the math finite
            logq, keep = sampling_logprobs(logits, temp, topk, topp)
            tok = draw(logq, U[:, s])  # [b]
            lp = logq.gather(1, tok[:, None]).squeeze(1)
            for j, n_bad in enumerate(nonfinite.tolist() if any_bad else ()):
                row = rows[live[j]]
                if n_bad and row.finish is None:  # ends here; this step's token is not emitted
                    row.finish, row.nonfinite = "numerical_error", n_bad
                    row.error = f"{n_bad} non-finite logits at generated token {s} ({prec.describe})"
            self._record(rows, live, logq, keep, buf, s)
            route = batch.routing()  # [b, layers, k]: the experts of the position that produced these logits
            if route is not None:
                for j, r in enumerate(route.tolist()):
                    if rows[live[j]].finish is None:
                        rows[live[j]].routes.append(r)
            for j, (t, v) in enumerate(zip(tok.tolist(), lp.tolist(), strict=True)):
                row = rows[live[j]]
                if row.finish is None:
                    row.push(t, v)
            done = [j for j, r in enumerate(live) if rows[r].finish is not None]
            if len(done) == len(live):
                break
            if len(done) >= max(1, len(live) // 4):  # drop finished rows: less work per step
                keep_idx = torch.tensor([j for j in range(len(live)) if rows[live[j]].finish is None])
                live = [live[j] for j in keep_idx.tolist()]
                batch.keep_rows(keep_idx)
                L, start, temp, topk, topp, U, tok = (
                    t.index_select(0, keep_idx) for t in (L, start, temp, topk, topp, U, tok)
                )
                padded = bool(start.max() > 0)
            hidden = batch.step(tok, L + s, P + s, start, padded)  # written at column P + s
        t2 = time.perf_counter()

        timings = {"prefill_s": t1 - t0, "decode_s": t2 - t1, "batch_size": float(B)}
        return [self._result(row, version, timings, buf, i) for i, row in enumerate(rows)]

    def _record(
        self, rows: list[_Row], live: list[int], logq: torch.Tensor, keep: torch.Tensor | None,
        buf: torch.Tensor | None, step: int,
    ) -> None:
        """Append this step's candidates of q to every running row (vectorized per kind)."""
        sup = [j for j, r in enumerate(live) if rows[r].finish is None and rows[r].req.params.record == "support"]
        head = [j for j, r in enumerate(live) if rows[r].finish is None and rows[r].req.params.head_k > 0]
        if buf is not None and sup:
            fast = [j for j in sup if rows[live[j]].stride]
            if fast:
                buf[torch.tensor([live[j] for j in fast]), step] = logq[torch.tensor(fast)]
                sup = [j for j in sup if not rows[live[j]].stride]
        if sup and keep is None:  # whole vocabulary: ids are 0..V-1, only the values vary
            vals = (logq if len(sup) == len(live) else logq[torch.tensor(sup)]).tolist()
            for j, v in zip(sup, vals, strict=True):
                row = rows[live[j]]
                row.cids.extend(self._vocab_ids)
                row.clps.extend(v)
        elif sup and keep is not None:
            sel = torch.tensor(sup)
            m = keep[sel]
            counts = m.sum(1).tolist()
            cols = m.nonzero()[:, 1].tolist()
            vals = logq[sel][m].tolist()
            a = 0
            for j, n in zip(sup, counts, strict=True):
                row = rows[live[j]]
                row.cids.extend(cols[a : a + n])
                row.clps.extend(vals[a : a + n])
                a += n
        if head:
            sel = torch.tensor(head)
            kmax = min(max(rows[live[j]].req.params.head_k for j in head), logq.shape[1])
            top, ix = logq[sel].topk(kmax, dim=1)  # [h, kmax] descending
            nfin = torch.isfinite(top).sum(1).tolist()  # never list tokens outside the support
            top_l, ix_l = top.tolist(), ix.tolist()
            for a, j in enumerate(head):
                row = rows[live[j]]
                n = min(row.req.params.head_k, nfin[a])
                row.cids.extend(ix_l[a][:n])
                row.clps.extend(top_l[a][:n])

    def _result(
        self, row: _Row, version: int, timings: dict[str, float], buf: torch.Tensor | None, i: int
    ) -> GenerationResult:
        kind = row.req.params.record
        cids, clps = row.cids, row.clps
        if row.stride:  # buffered whole-vocabulary support: one tolist for the whole request
            assert buf is not None
            n = len(row.ids)
            cids, clps = self._vocab_ids * n, buf[i, :n].reshape(-1).tolist()
        return GenerationResult(
            token_ids=row.ids,
            logprobs=row.lps,
            cand_offsets=row.offs,
            cand_ids=cids,
            cand_logprobs=clps,
            cand_kind="support" if kind == "support" else "head" if kind.startswith("head:") else "none",
            version=version,
            group=self.group,
            finish_reason=row.finish or "length",
            num_nonfinite=row.nonfinite,
            error=row.error,
            timings=dict(timings),
            routed_experts=row.routes[: len(row.ids)] if row.routes else None,
        )
