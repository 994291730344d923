"""A running batch of the built-in engine: rows decode together, new rows join between steps.

``Running`` is ``BuiltinEngine``'s decode loop: ``generate_batch`` runs one per
chunk of requests, ``BuiltinEngine.stream`` opens one that requests keep joining
(continuous batching, driven by ``BatchingSampler``). Each ``step`` samples one
token for every row from the hidden state of its last column, records it, and
feeds the tokens through the model. Between steps:

- a row that finished leaves at once: ``step`` returns its result; the rows are
  dropped from the tensors once a quarter of the batch has finished (a long tail
  does not pay for finished rows), or before new rows join;
- ``fill`` admits the requests queued by ``add`` that fit (``max_batch`` rows,
  ``max_batch_tokens``): their prompts are prefilled together (``path.begin``),
  left-padded to end at the batch's current column, and absorbed into the batch's
  KV cache (``batch.absorb``); when they are longer than the columns so far, the
  old rows' columns move right (more leading padding, masked). Leading columns
  that are padding for every row are trimmed when rows leave;
- KV reuse (``prefix_cache``, ``engine.prefix_reuse``): rows admitted together with the same
  prompt are prefilled once, a session's kept columns are copied in rather than computed,
  and a row that finishes with a stop or its length leaves its columns to its session.

Guarantees, as for one batch: a request draws its uniforms from its own generator
(``params.seed``, else ``request_seed(engine seed, j)`` for the j-th request the
engine saw, counted in ``add`` order), so its tokens do not depend on when it
joined or with whom; attention never mixes rows, so its log q differs across
batch compositions by kernel rounding only; every token comes from the weights
the batch opened with (``w``, ``version``): once the engine has loaded others,
``add`` raises (``BatchingSampler`` lets the batch drain first).

Example (``max_batch`` 4): steps 0-2 decode [a, b]; ``add([c])``, ``fill()``: c's
5-token prompt is prefilled, a and b shift 2 columns right, step 3 samples for
[a, b, c]; b finishes at step 5 and that step returns b's result.
"""

from __future__ import annotations

import collections
import time
from typing import Any

import torch

from mixrl.records.generation import FinishReason, GenerationRequest, GenerationResult, parse_record
from mixrl.sampling.builtin import prefix_cache
from mixrl.sampling.builtin.sample import draw, sampling_logprobs

SUPPORT_BUFFER_BYTES = 256 << 20  # above this, whole-vocabulary supports are listed step by step


def support_buffer_bytes() -> int:
    return SUPPORT_BUFFER_BYTES


class _Row:
    """Output being built for one request of a running batch."""

    __slots__ = ("key", "req", "stops", "limit", "ids", "lps", "offs", "cids", "clps", "finish", "nonfinite",
                 "error", "stride", "routes", "buf", "bi", "cohort", "kv")  # fmt: skip

    def __init__(self, key: Any, req: GenerationRequest, stops: frozenset[int], limit: int) -> None:
        self.key, self.req, self.stops, self.limit = key, req, stops, limit
        self.ids: list[int] = []
        self.lps: list[float] = []
        self.offs: list[int] = [0]
        self.cids: list[int] = []
        self.clps: list[float] = []
        self.finish: FinishReason | None = None
        self.nonfinite = 0
        self.error = ""
        self.stride = 0  # V when this row's whole-vocabulary support goes to a buffer
        self.buf: torch.Tensor | None = None  # [rows, N, V] of its cohort; row ``bi``
        self.bi = 0
        self.routes: list[list[list[int]]] = []  # MoE: per token [layers][k] experts
        self.cohort: dict[str, float] = {}  # timings of the prefill it joined with
        self.kv: dict[str, float] = {}  # its prompt's KV: prefilled, reused (prefix_cache), evictions

    def push(self, tok: int, lp: float) -> None:
        self.ids.append(tok)
        self.lps.append(lp)
        self.offs.append(len(self.ids) * self.stride if self.stride else len(self.cids))
        if tok in self.stops:
            self.finish = "stop"
        elif len(self.ids) >= self.limit:
            self.finish = "length"


class Running:
    def __init__(self, engine: Any) -> None:
        self.e = engine
        self.w, self.version = engine.weights, engine.version
        self.pending: collections.deque[tuple[Any, GenerationRequest, int]] = collections.deque()
        self.rows: list[_Row] = []  # tensor row j -> its output
        self.batch: Any = None
        self.hidden: torch.Tensor | None = None  # [b, H] at each row's last column
        self.col = 0  # the next column written
        self.cohorts = 0  # prefills run (groups of rows that joined together)
        self.t: dict[str, torch.Tensor] = {}  # per-row tensors, sliced together

    @property
    def idle(self) -> bool:
        return not self.rows and not self.pending

    def add(self, items: list[tuple[Any, GenerationRequest]]) -> list[tuple[Any, GenerationResult]]:
        """Queue requests (``key``: the caller's handle); bad ones fail here, at once."""
        e = self.e
        if e.weights is not self.w:
            raise RuntimeError(f"this batch decodes version {self.version}; the engine has loaded {e.version}")
        failed = []
        for key, r in items:
            seed = e.seed_for(r)
            reason, msg = e._check(r)
            if reason is None:
                self.pending.append((key, r, seed))
            else:
                failed.append((key, e._failed(reason, msg)))
        return failed

    def _need(self, r: GenerationRequest) -> int:
        return min(r.params.max_new_tokens, self.e.max_context - len(r.prompt_ids))

    @torch.inference_mode()
    def fill(self, max_rows: int | None = None) -> int:
        """Admit the queued requests that fit (at most ``max_rows`` rows in all, and the
        engine's ``max_batch`` and ``max_batch_tokens``); returns how many joined."""
        if not self.pending:
            return 0
        e = self.e
        if self.rows and any(r.finish is not None for r in self.rows):
            self._drop()
        if self.batch is not None and not self.batch.can_absorb:
            return 0
        b = len(self.rows)
        left = [row.limit - len(row.ids) for row in self.rows]
        need, P, take = max(left, default=0), 0, []
        cap = e.max_batch if max_rows is None else min(max_rows, e.max_batch)
        while self.pending and b + len(take) < cap:
            r = self.pending[0][1]
            n_need, n_P = max(need, self._need(r)), max(P, len(r.prompt_ids))
            cols = max(self.col, n_P) + n_need
            if (b or take) and e.max_batch_tokens is not None and (b + len(take) + 1) * cols > e.max_batch_tokens:
                break
            take.append(self.pending.popleft())
            need, P = n_need, n_P
        if take:
            self._admit(take)
        return len(take)

    @torch.inference_mode()
    def _admit(self, take: list[tuple[Any, GenerationRequest, int]]) -> None:
        e, V = self.e, self.e.vocab
        t0 = time.perf_counter()
        reqs = [r for _, r, _ in take]
        lens = [len(r.prompt_ids) for r in reqs]
        P = max(lens)
        limits = [self._need(r) for r in reqs]
        N = max(limits)
        rows = [_Row(k, r, e.eos_ids | frozenset(r.params.stop_ids), lim) for (k, r, _), lim in zip(take, limits, strict=True)]
        # rows sampling from the whole vocabulary record log q of every token at every step:
        # buffered as a tensor and listed once at the end (far cheaper than per step)
        full = [row for row in rows if row.req.params.record == "support" and row.req.params.top_k == 0
                and row.req.params.top_p >= 1]  # fmt: skip
        held = sum(x.numel() * 4 for x in {id(row.buf): row.buf for row in self.rows if row.buf is not None}.values())
        if full and held + len(full) * N * V * 4 <= support_buffer_bytes():
            buf = torch.empty(len(full), N, V)
            for i, row in enumerate(full):
                row.stride, row.buf, row.bi = V, buf, i
        ids = torch.full((len(reqs), P), e.pad_id, dtype=torch.long)
        for i, r in enumerate(reqs):
            ids[i, P - lens[i] :] = torch.tensor(r.prompt_ids)
        L = torch.tensor(lens)
        start = P - L
        # KV reuse (prefix_cache): identical prompts prefilled once, a session's kept columns copied
        pl = prefix_cache.plan(e.kv_store, reqs, self.version) if e.prefix_reuse else None
        if pl is not None:
            for row, st in zip(rows, pl.stats, strict=True):
                row.kv = st
            if pl.rows is not None:
                ids, start_u = ids[pl.uniq], start[pl.uniq]
            else:
                start_u = start
            reuse = {"prefix": pl.prefix, "rows": pl.rows}
        else:
            start_u, reuse = start, {}
            for row, n in zip(rows, lens, strict=True):
                row.kv = {"prefill_tokens": float(n), "reused_tokens": 0.0, "kv_evictions": 0.0}
        new = {
            "L": L,
            "start": start,
            "temp": torch.tensor([r.params.temperature for r in reqs], dtype=torch.float32),
            "topk": torch.tensor([r.params.top_k for r in reqs]),
            "topp": torch.tensor([r.params.top_p for r in reqs], dtype=torch.float32),
            "U": torch.stack([torch.rand(N, generator=torch.Generator().manual_seed(s), dtype=torch.float64)
                              for _, _, s in take]),  # fmt: skip
        }
        if self.batch is None:  # the first rows: the batch is their prefill
            self.batch, self.hidden = e.path.begin(self.w, ids, start_u, P + N, **reuse)
            self.col, self.t = P, new
        else:
            need = max([N] + [row.limit - len(row.ids) for row in self.rows])
            other, hidden = e.path.begin(self.w, ids, start_u, P, **reuse)
            shift = self.batch.absorb(other, self.col, need, e.max_batch)
            self.col += shift
            t = self.t
            t["start"] = t["start"] + shift
            new["start"] = new["start"] + (self.col - P)
            W = max(t["U"].shape[1], N)
            t["U"], new["U"] = (torch.nn.functional.pad(u, (0, W - u.shape[1])) for u in (t["U"], new["U"]))
            self.t = {k: torch.cat([t[k], new[k]]) for k in t}
            self.hidden = torch.cat([self.hidden, hidden])
        cohort = {"prefill_s": time.perf_counter() - t0, "t1": time.perf_counter(),
                  "batch_size": float(len(self.rows) + len(rows)), "joined": float(len(rows))}  # fmt: skip
        for row in rows:
            row.cohort = cohort
        self.rows += rows
        self.cohorts += 1

    def _drop(self, extra: tuple[torch.Tensor, ...] = ()) -> tuple[torch.Tensor, ...]:
        """Drop finished rows (and the leading columns only they used); ``extra`` per-row
        tensors come back sliced alike."""
        keep = [j for j, row in enumerate(self.rows) if row.finish is None]
        idx = torch.tensor(keep, dtype=torch.long)
        self.rows = [self.rows[j] for j in keep]
        self.batch.keep_rows(idx)
        self.t = {k: v.index_select(0, idx) for k, v in self.t.items()}
        assert self.hidden is not None
        self.hidden = self.hidden.index_select(0, idx.to(self.hidden.device))
        lo = int(self.t["start"].min()) if keep else 0
        lo = self.batch.trim(lo) if lo > 0 else 0
        if lo:
            self.t["start"] = self.t["start"] - lo
            self.col -= lo
        return tuple(x.index_select(0, idx) for x in extra)

    @torch.inference_mode()
    def step(self) -> list[tuple[Any, GenerationResult]]:
        """One token for every row; the results of the rows that finished."""
        e, t, rows = self.e, self.t, self.rows
        live = [row.finish is None for row in rows]
        logits = e.path.logits(self.w, self.hidden)  # [b, V] fp32
        temp = t["temp"]
        # counted after temperature: finite logits can still overflow at a tiny temperature
        nonfinite = (~torch.isfinite(logits / temp[:, None])).sum(dim=1)  # [b]
        any_bad = bool(nonfinite.any())
        if any_bad:
            logits = torch.where((nonfinite > 0)[:, None], 0.0, logits)  # keep the math finite
        logq, keep = sampling_logprobs(logits, temp, t["topk"], t["topp"])
        gen = torch.tensor([len(row.ids) for row in rows])
        U = t["U"]
        tok = draw(logq, U.gather(1, gen.clamp(max=U.shape[1] - 1)[:, None]).squeeze(1))  # [b]
        lp = logq.gather(1, tok[:, None]).squeeze(1)
        for j, n_bad in enumerate(nonfinite.tolist() if any_bad else ()):
            row = rows[j]
            if n_bad and row.finish is None:  # ends here; this step's token is not emitted
                row.finish, row.nonfinite = "numerical_error", n_bad
                row.error = f"{n_bad} non-finite logits at generated token {len(row.ids)} ({e.prec.describe})"
        self._record(logq, keep)
        route = self.batch.routing()  # [b, layers, k]: the experts of the position that produced these logits
        if route is not None:
            for row, r in zip(rows, route.tolist(), strict=True):
                if row.finish is None:
                    row.routes.append(r)
        out = []
        for j, (row, tk, v, was) in enumerate(zip(rows, tok.tolist(), lp.tolist(), live, strict=True)):
            if row.finish is None:
                row.push(tk, v)
            if was and row.finish is not None:  # finished this step (a stop, the limit, a non-finite logit)
                if row.req.session and e.kv_store is not None and row.finish in ("stop", "length"):
                    self._keep(j, row)
                out.append((row.key, self._result(row)))
        done = sum(row.finish is not None for row in rows)
        if done == len(rows):
            self.rows, self.batch, self.hidden, self.t = [], None, None, {}
            return out
        if done >= max(1, len(rows) // 4):
            tok, gen = self._drop((tok, gen))
        t = self.t
        pos = (t["L"] + gen).clamp(max=e.max_context - 1)  # finished rows: any valid position
        start = t["start"]
        self.hidden = self.batch.step(tok, pos, self.col, start, bool(start.max() > 0))  # written at column col
        self.col += 1
        return out

    def _keep(self, j: int, row: _Row) -> None:
        """Keep row ``j``'s columns for its session's next request (``prefix_cache``): its prompt
        and every generated token but the last (sampled, never fed)."""
        c0 = int(self.t["start"][j])
        tokens = row.req.prompt_ids + row.ids[:-1]
        if self.col - c0 != len(tokens):  # not the columns this row wrote: keep nothing
            return
        entry = prefix_cache.Entry(tokens, self.batch.row_kv(j, c0, self.col), self.version)
        if row.kv.get("reused_stale_tokens"):
            entry.version -= int(row.kv["reused_stale_versions"])
        row.kv["kv_evictions"] = float(self.e.kv_store.put(row.req.session, entry))

    def _record(self, logq: torch.Tensor, keep: torch.Tensor | None) -> None:
        """Append this step's candidates of q to every running row (vectorized per kind)."""
        rows = self.rows
        sup = [j for j, r in enumerate(rows) if r.finish is None and r.req.params.record == "support"]
        head = [j for j, r in enumerate(rows) if r.finish is None and r.req.params.head_k > 0]
        if sup and any(rows[j].stride for j in sup):
            bufs: dict[int, tuple[torch.Tensor, list[int], list[int], list[int]]] = {}
            for j in sup:
                row = rows[j]
                if row.stride:
                    assert row.buf is not None
                    entry = bufs.setdefault(id(row.buf), (row.buf, [], [], []))
                    entry[1].append(row.bi)
                    entry[2].append(len(row.ids))
                    entry[3].append(j)
            for buf, bi, steps, js in bufs.values():
                buf[torch.tensor(bi), torch.tensor(steps)] = logq[torch.tensor(js)]
            sup = [j for j in sup if not rows[j].stride]
        if sup and keep is None:  # whole vocabulary: ids are 0..V-1, only the values vary
            vals = (logq if len(sup) == len(rows) else logq[torch.tensor(sup)]).tolist()
            for j, v in zip(sup, vals, strict=True):
                rows[j].cids.extend(self.e._vocab_ids)
                rows[j].clps.extend(v)
        elif sup and keep is not None:
            sel = torch.tensor(sup)
            m = keep[sel]
            counts = m.sum(1).tolist()
            cols = m.nonzero()[:, 1].tolist()
            vals = logq[sel][m].tolist()
            a = 0
            for j, n in zip(sup, counts, strict=True):
                rows[j].cids.extend(cols[a : a + n])
                rows[j].clps.extend(vals[a : a + n])
                a += n
        if head:
            sel = torch.tensor(head)
            kmax = min(max(rows[j].req.params.head_k for j in head), logq.shape[1])
            top, ix = logq[sel].topk(kmax, dim=1)  # [h, kmax] descending
            nfin = torch.isfinite(top).sum(1).tolist()  # never list tokens outside the support
            top_l, ix_l = top.tolist(), ix.tolist()
            for a, j in enumerate(head):
                n = min(rows[j].req.params.head_k, nfin[a])
                rows[j].cids.extend(ix_l[a][:n])
                rows[j].clps.extend(top_l[a][:n])

    def _result(self, row: _Row) -> GenerationResult:
        kind = row.req.params.record
        cids, clps = row.cids, row.clps
        if row.stride:  # buffered whole-vocabulary support: one tolist for the whole request
            assert row.buf is not None
            n = len(row.ids)
            cids, clps = self.e._vocab_ids * n, row.buf[row.bi, :n].reshape(-1).tolist()
            row.buf = None
        c = row.cohort
        # batch_size: rows decoding once it joined; joined: rows prefilled with it
        timings = {"prefill_s": c["prefill_s"], "decode_s": time.perf_counter() - c["t1"],
                   "batch_size": c["batch_size"], "joined": c["joined"], **row.kv}  # fmt: skip
        return GenerationResult(
            token_ids=row.ids,
            logprobs=row.lps,
            cand_offsets=row.offs,
            cand_ids=cids,
            cand_logprobs=clps,
            cand_kind=parse_record(kind)[0],
            version=self.version,
            group=self.e.group,
            finish_reason=row.finish or "length",
            num_nonfinite=row.nonfinite,
            error=row.error,
            timings=timings,
            routed_experts=row.routes[: len(row.ids)] if row.routes else None,
        )
