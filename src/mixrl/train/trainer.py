"""The trainer: loss assembly from ``mixrl.corrections``, optimizer step, versions.

One :meth:`Trainer.step` turns a batch of trajectories into one new weights
version::

    records = prepare(trajectories)                    # convert; drop + count malformed (Trajectory.screen)
    records = parallel.shard(records)                  # this process's part (train.parallel; all on one)
    p_old   = no-grad pass                             # only when epochs * minibatches > 1
    for epoch, minibatch:                              # one AdamW step per minibatch
        D = aggregation_denominator(minibatch)         # once, over the whole minibatch
        for micro-batch:                               # gradient accumulation; each holds at most
                                                       # micro_batch_tokens model inputs, padded or
                                                       # packed (mixrl.train.packing)
            h   = model.model(ids, mask).last_hidden_state[rows, t - 1]    # [N, d]
            out = chunked_logprobs(h, lm_head.weight, y, candidates)       # never [N, V]
            compute_loss(LossInputs(...), cfg, D).backward()
        clip (optim/grad_norm is the norm before clipping), AdamW
    version += 1

Because ``D`` is shared, k micro-batches give exactly the gradient of one batch.
With one epoch and one minibatch ``p_old = p_θ.detach()`` (the update starts
where the gradient is taken). Otherwise ``p_old`` is fixed by a first pass and
the loss takes the decoupled three-policy form (docs/corrections.md §1): behaviour
weights use ``p_old / q``, the objective's ratio ``p_θ / p_old``.

Precision ``bf16``: the model's parameters are cast to bfloat16 (the weights the
samplers receive); AdamW keeps float32 master copies and writes them back after
every step, so small updates are not lost to bf16 rounding. Log-probabilities
and the loss are float32 either way (see ``mixrl.models.chunked``).

Metrics are those of ``compute_loss`` over the whole batch (a detached pass
when the batch was cut into micro-batches), plus ``optim/*`` and ``train/*``
counters (``train/version`` included); the staleness of the batch is the
buffer's (``rollout/staleness_*``), the per-token split the loss's (``precision/*``, ``lag/*``). A step whose gradient norm is not finite leaves the
weights unchanged (``optim/skipped_steps``); ``version`` still advances by one
per call, so it always equals the number of completed steps.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from mixrl.config.loss import LossConfig
from mixrl.config.presets import check_updates, needs
from mixrl.corrections import LossInputs, aggregation_denominator, compute_loss
from mixrl.models.chunked import TokenLogprobs, chunked_logprobs
from mixrl.records.trajectory import Trajectory
from mixrl.train.batch import BatchStats, Record, TrainBatch, collate, prepare
from mixrl.train.packing import (
    MicroBatch,
    attn_pair_cost,
    collate_micro,
    is_flash,
    micro_batches,
    model_inputs,
)
from mixrl.train.parallel import Single
from mixrl.train.routing_replay import TrainerRouting
from mixrl.weights.accounting import tensor_bytes

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}  # fp64: references


class MalformedBatchError(RuntimeError):
    """More than half of a step's trajectories were malformed: the run cannot be trusted."""


class Trainer:
    def __init__(
        self,
        model: Any,  # HF causal LM with .model (decoder) and .lm_head (plain linear)
        loss_cfg: LossConfig,
        *,
        lr: float,
        weight_decay: float = 0.0,
        grad_clip: float = 1.0,
        precision: str = "fp32",
        epochs: int = 1,
        minibatches: int = 1,
        temperature: float = 1.0,
        micro_batch_size: int | None = None,  # trajectories per forward/backward; None = all
        micro_batch_tokens: int | None = None,  # model-input tokens per forward/backward; None = all
        forward_micro_batch_tokens: int | None = None,  # the same for the no-grad p_old pass; None = as above
        packing: bool = False,  # several trajectories per row (mixrl.train.packing) instead of padding
        share_prefix: bool = True,  # packed: samples of one prompt share its tokens (mixrl.train.prefix)
        chunk_size: int = 1024,
        pad_id: int = 0,
        seed: int = 0,
        max_malformed_frac: float | None = None,  # a step dropping more as malformed raises; None = never
        gen_budget: int | None = None,  # generation budget per trajectory, for seq_mean_token_sum_norm
        lr_schedule: Callable[[int], float] | None = None,  # lr multiplier per update (train.schedule)
        device: str | torch.device | None = None,  # None: where the parameters already are
        parallel: Single | None = None,  # how the step is split over processes (train.parallel); None: one
    ) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision {precision!r} is not one of {tuple(PRECISIONS)}")
        for name, v, lo in (("lr", lr, 0.0), ("grad_clip", grad_clip, 0.0), ("temperature", temperature, 0.0)):
            if not (math.isfinite(v) and v > lo):
                raise ValueError(f"{name} must be a finite number > {lo}, got {v}")
        if not (math.isfinite(weight_decay) and weight_decay >= 0):
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        if minibatches < 1 or (micro_batch_size is not None and micro_batch_size < 1):
            raise ValueError(f"minibatches={minibatches} and micro_batch_size={micro_batch_size} must be >= 1")
        for name, b in (("micro_batch_tokens", micro_batch_tokens), ("forward_micro_batch_tokens", forward_micro_batch_tokens)):
            if b is not None and b < 1:
                raise ValueError(f"{name} must be >= 1, got {b}")
        if packing and micro_batch_size is not None:
            raise ValueError("micro_batch_size counts padded rows; with packing bound micro-batches by micro_batch_tokens")
        check_updates(loss_cfg, epochs, minibatches)
        self.model, self.loss_cfg = model, loss_cfg
        self.epochs, self.minibatches, self.temperature = epochs, minibatches, temperature
        self.micro_batch_size, self.chunk_size, self.pad_id, self.seed = micro_batch_size, chunk_size, pad_id, seed
        self.grad_clip, self.precision = grad_clip, precision
        self.micro_batch_tokens, self.packing = micro_batch_tokens, packing
        self.forward_micro_batch_tokens = forward_micro_batch_tokens or micro_batch_tokens
        self.attn_cost = attn_pair_cost(getattr(model, "config", None))  # packed row length: padding vs masked attention
        self.attn_impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
        self.max_malformed_frac, self.gen_budget = max_malformed_frac, gen_budget
        self.lr_schedule, self.base_lr = lr_schedule, lr
        self.cand_kind = needs(loss_cfg).cand_kind  # candidates of q the loss needs
        self.routing = TrainerRouting(model, loss_cfg.routing_replay)  # MoE: replay, routing mismatch
        # a shared prefix needs a 4D mask (no varlen kernel), and MoE routing records address one
        # model-input cell per generated token, which a shared prefix would merge
        self.share_prefix = (share_prefix and packing and not is_flash(self.attn_impl)
                             and self.attn_impl != "flex_attention" and not self.routing.rr.active)
        self.version = 0
        self.grad_bytes = 0  # the last update's gradients, measured before they are freed
        self.parallel = parallel or Single()
        # onto the device first: the optimizer (and its fused kernel choice) is built from these tensors
        model.to(device=torch.device(device) if device is not None else None, dtype=PRECISIONS[precision])
        model.train()
        self.params = [p for p in model.parameters() if p.requires_grad]  # tied weights once
        # bf16/fp16: AdamW updates float32 master copies (a 16-bit weight cannot absorb lr * 1e-3
        # steps). fp16 has no loss scaling: an overflowing step is skipped (optim/skipped_steps).
        self.master = [p.detach().float().clone() for p in self.params] if precision in ("bf16", "fp16") else None
        opt_params = self.master if self.master is not None else self.params
        # one fused kernel over all parameters instead of ~10 ops per tensor: the same AdamW update
        # (rounding aside); plain tensors only (FSDP2's DTensor shards take the per-tensor path)
        self.fused = bool(opt_params) and all(type(p.data) is torch.Tensor and p.device.type in ("cpu", "cuda")
                                              for p in opt_params)
        self.optimizer = torch.optim.AdamW(opt_params, lr=lr, weight_decay=weight_decay,
                                           fused=True if self.fused else None)
        self.device = self.params[0].device if self.params else torch.device("cpu")
        # loss.ref_kl: a frozen copy of the initial policy (docs/corrections.md section 13)
        self.ref_model = copy.deepcopy(model).requires_grad_(False) if loss_cfg.ref_kl is not None else None

    # ------------------------------------------------------------------ forward

    def _forward(self, tb: TrainBatch, records: list[Record] | None = None) -> TokenLogprobs:
        kw = model_inputs(tb, self.attn_impl, dtype=PRECISIONS[self.precision])  # padded or packed rows
        with self.routing.context(self.model, records, tb, kw["input_ids"].shape):  # MoE routers only
            out = self.model.model(**kw)
        h = out.last_hidden_state[tb.hidden_rows, tb.pred_cols]  # [N, d]
        head = self.model.lm_head
        kind = self.cand_kind
        return chunked_logprobs(
            h, head.weight, tb.targets, bias=head.bias, temperature=tb.temperature, cand_kind=kind,
            cand_offsets=tb.cand_offsets if kind != "none" else None,
            cand_ids=tb.cand_ids if kind != "none" else None,
            replay=self.loss_cfg.support_replay, chunk_size=self.chunk_size)

    def _inputs(self, tb: TrainBatch, lp: Tensor, clp: Tensor, ent: Tensor | None,
                old: Tensor, cold: Tensor, names: list[str], ref: Tensor | None = None) -> LossInputs:
        kind, n = self.cand_kind, lp.shape[0]
        return LossInputs(
            trainer_logprobs=lp, old_logprobs=old, sampler_logprobs=tb.sampler_logprobs,
            advantages=tb.advantages, loss_mask=torch.ones(n, dtype=torch.bool, device=lp.device),
            seq_ids=tb.seq_ids,
            num_seqs=tb.num_seqs, cand_kind=kind,
            cand_offsets=tb.cand_offsets if kind != "none" else None,
            cand_trainer_logprobs=clp if kind != "none" else None,
            cand_old_logprobs=cold if kind != "none" else None,
            cand_sampler_logprobs=tb.cand_logprobs if kind != "none" else None,
            entropy=ent, group_ids=tb.group_ids, group_names=names,
            # trainer version the update starts from − token version: 0 = precision only
            staleness=torch.where(tb.versions >= 0, self.version - tb.versions, -1), ref_logprobs=ref)

    def _ref_logprobs(self, tb: TrainBatch) -> Tensor | None:
        """log p_ref(y_t) of the frozen initial policy (loss.ref_kl), by the same forward pass."""
        if self.ref_model is None:
            return None
        live, self.model = self.model, self.ref_model
        try:
            with torch.no_grad():
                return self._forward(tb).logprobs
        finally:
            self.model = live

    def _micro(self, records: list[Record], budget: int | None = None) -> list[MicroBatch]:
        """Micro-batches of at most ``budget`` model-input tokens (default micro_batch_tokens)."""
        return micro_batches(records, budget or self.micro_batch_tokens, packed=self.packing,
                             one_row=is_flash(self.attn_impl), max_seqs=self.micro_batch_size,
                             attn_cost=self.attn_cost, share_prefix=self.share_prefix)

    @staticmethod
    def _store(records: list[Record], out: TokenLogprobs, *fields: str) -> None:
        """Write detached per-record slices of ``out`` onto ``records``."""
        n = [int(r.gen_pos.numel()) for r in records]
        k = [int(r.cand_ids.numel()) for r in records]
        lp, ent = out.logprobs.detach().split(n), out.entropy.detach().split(n)
        clp = out.cand_logprobs.detach().split(k) if out.cand_logprobs.numel() else [torch.zeros(0)] * len(records)
        for r, a, c, e in zip(records, lp, clp, ent, strict=True):
            for f in fields:
                setattr(r, f, {"old_logprobs": a, "trainer_logprobs": a, "cand_old_logprobs": c,
                               "cand_trainer_logprobs": c, "entropy": e}[f])

    # ------------------------------------------------------------------ step

    def denominator(self, records: list[Record], mode: str, G: int | None, max_len: int | None) -> float:
        """The aggregation denominator D of the whole (mini)batch: a sum over its records."""
        max_len = max_len if max_len is not None else self.gen_budget  # D = S · budget = prompts · G · budget
        if mode == "seq_mean_token_sum_norm" and max_len is None:  # no budget given: documented fallback
            max_len = int(self.parallel.all_max(max((int(r.gen_pos.numel()) for r in records), default=0)))
        d = 0.0
        if records:
            seq_ids = torch.cat([torch.full((int(r.gen_pos.numel()),), i) for i, r in enumerate(records)])
            d = aggregation_denominator(mode, torch.ones(seq_ids.shape[0], dtype=torch.bool), seq_ids,
                                        len(records), G=G, max_len=max_len)
        return self.parallel.all_sum(d)

    def _accumulate(self, mini: list[Record], denom: float, decoupled: bool, first: bool,
                    names: list[str]) -> tuple[float, dict[str, float], int]:
        """Backward over ``mini`` in micro-batches with the shared ``denom``; grads accumulate."""
        loss_sum, n_micro = 0.0, 0
        metrics: dict[str, float] = {}
        micros = self._micro(mini)
        for micro in micros:
            mb = micro.records
            tb = collate_micro(micro, self.pad_id).to(self.device)
            out = self.parallel.forward(self._forward, tb, mb)
            old = tb.old_logprobs if decoupled else out.logprobs.detach()
            cold = tb.cand_old_logprobs if decoupled else out.cand_logprobs.detach()
            assert old is not None and cold is not None
            inp = self._inputs(tb, out.logprobs, out.cand_logprobs, out.entropy, old, cold, names,
                               ref=self._ref_logprobs(tb))
            loss, metrics = compute_loss(inp, self.loss_cfg, denom)
            loss.backward()
            loss_sum, n_micro = loss_sum + float(loss.detach()), n_micro + 1
            if first:  # detached values of the first pass, for whole-batch metrics
                self._store(mb, out, "trainer_logprobs", "cand_trainer_logprobs", "entropy")
                if not decoupled:
                    self._store(mb, out, "old_logprobs", "cand_old_logprobs")
        self.parallel.pad(len(micros))
        return loss_sum, metrics, n_micro

    def backward(self, trajectories: Sequence[Trajectory], advantages: Sequence[float | Sequence[float]] | Tensor,
                 *, denom_mode: str | None = None, G: int | None = None, max_len: int | None = None,
                 strict: bool = False) -> dict[str, float]:
        """The one-pass gradient of the whole batch, left in ``param.grad``; no optimizer step.

        For checks and diagnostics (gradient references, accumulation tests); ``step``
        is the training entry point.
        """
        records, stats = self._prepare(trajectories, advantages, strict)
        if not records:
            return {}
        records = self.parallel.shard(records)
        denom = self.denominator(records, denom_mode or self.loss_cfg.aggregation, G, max_len)
        loss, metrics, n_micro = self._accumulate(records, denom, False, True, stats.group_names)
        if n_micro > 1:
            metrics = self._batch_metrics(records, stats, denom_mode or self.loss_cfg.aggregation, G, max_len)
        return {**metrics, "loss": loss}

    def _prepare(self, trajectories: Sequence[Trajectory], advantages: Any, strict: bool) -> tuple[list[Record], BatchStats]:
        vocab = int(self.model.lm_head.weight.shape[0])
        records, stats = prepare(trajectories, advantages, vocab_size=vocab, cand_kind=self.cand_kind,
                                 temperature=self.temperature, strict=strict)
        self.routing.attach(records, trajectories)
        return records, stats

    def step(
        self,
        trajectories: Sequence[Trajectory],
        advantages: Sequence[float | Sequence[float]] | Tensor,  # [S], or per generated token
        *,
        denom_mode: str | None = None,  # default: loss_cfg.aggregation
        G: int | None = None,  # group size, checked by seq_mean_token_sum_norm
        max_len: int | None = None,  # generation budget for seq_mean_token_sum_norm
        strict: bool = False,  # raise on a malformed trajectory instead of dropping it
    ) -> dict[str, float]:
        """One optimizer update (or ``epochs * minibatches`` of them); returns the metrics."""
        t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        mode = denom_mode or self.loss_cfg.aggregation
        batch, stats = self._prepare(trajectories, advantages, strict)
        records = self.parallel.shard(batch)  # this process's part (all of it on one process)
        frac = self.max_malformed_frac
        if frac is not None and stats.dropped_malformed > frac * len(trajectories):  # else a silent no-op
            raise MalformedBatchError(
                f"{stats.dropped_malformed} of {len(trajectories)} trajectories of step {self.version + 1} "
                f"are malformed (first: {stats.errors[0]})")
        if self.lr_schedule is not None:  # the multiplier depends only on the version: resumable
            for group in self.optimizer.param_groups:
                group["lr"] = self.base_lr * self.lr_schedule(self.version)
        for p in self.params:  # gradients left by backward() must not leak into the update
            p.grad = None
        metrics: dict[str, float] = {}
        norms: list[float] = []
        if records:
            decoupled = self.epochs * self.minibatches > 1
            if decoupled:  # p_old fixed at θ_old for every epoch and minibatch
                with torch.no_grad():
                    micros = self._micro(records, self.forward_micro_batch_tokens)
                    for micro in micros:
                        tb = collate_micro(micro, self.pad_id).to(self.device)
                        out = self.parallel.forward(self._forward, tb, micro.records)
                        self._store(micro.records, out, "old_logprobs", "cand_old_logprobs")
                    self.parallel.pad(len(micros))
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.version)
            loss0, n_micro = 0.0, 0
            for epoch in range(self.epochs):
                order = torch.randperm(len(records), generator=gen).tolist() if decoupled else range(len(records))
                shuffled = [records[i] for i in order]
                size = math.ceil(len(shuffled) / self.minibatches)
                n_mini = math.ceil(len(shuffled) / size)
                for m0 in range(0, len(shuffled), size):
                    mini = shuffled[m0:m0 + size]
                    denom = self.denominator(mini, mode, G, max_len)
                    loss, mb_metrics, k = self._accumulate(mini, denom, decoupled, epoch == 0, stats.group_names)
                    if epoch == 0:
                        loss0, n_micro, metrics = loss0 + loss, n_micro + k, mb_metrics
                    norms.append(self._optimizer_step())
            if n_micro > 1:  # exact whole-batch metrics from the detached epoch-0 values
                metrics = self._batch_metrics(records, stats, mode, G, max_len)
            metrics["loss"] = loss0 / n_mini  # mean over the epoch-0 minibatches
        self.version += 1
        skipped = sum(not math.isfinite(x) for x in norms)
        metrics.update(self._counters(batch, stats, norms, skipped, time.perf_counter() - t0))
        # CPU of the thread that ran the update: with one torch thread (runtime.torch_threads = 1)
        # the whole update, and wall / CPU above 1 means it waited for a core or the interpreter
        # lock; with more, torch's intra-op worker threads are not in it. The process's CPU over
        # the update counts those workers, and also whatever other threads of the process ran
        # meanwhile (an orchestrator's event loop): the two bound the update's CPU from both sides
        metrics["perf/train_step_cpu_s"] = time.thread_time() - c0
        metrics["perf/train_step_process_cpu_s"] = time.process_time() - p0
        metrics.update(self.routing.metrics(stats.group_names))
        return self.parallel.reduce(metrics)

    def _batch_metrics(self, records: list[Record], stats: BatchStats, mode: str,
                       G: int | None, max_len: int | None) -> dict[str, float]:
        tb = collate(records, self.pad_id).to(self.device)
        assert tb.trainer_logprobs is not None and tb.old_logprobs is not None
        assert tb.cand_trainer_logprobs is not None and tb.cand_old_logprobs is not None
        with torch.no_grad():
            inp = self._inputs(tb, tb.trainer_logprobs, tb.cand_trainer_logprobs, tb.entropy,
                               tb.old_logprobs, tb.cand_old_logprobs, stats.group_names,
                               ref=self._ref_logprobs(tb))
            return compute_loss(inp, self.loss_cfg, self.denominator(records, mode, G, max_len))[1]

    def _optimizer_step(self) -> float:
        """Clip and step; returns the global gradient norm before clipping."""
        if self.master is not None:
            for m, p in zip(self.master, self.params, strict=True):
                m.grad = p.grad.float() if p.grad is not None else torch.zeros_like(m)
        opt_params = self.master if self.master is not None else self.params
        self.grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in [*self.params, *(self.master or [])]
                              if p.grad is not None)  # held for the update's backward passes (tensor_bytes)
        norm = float(torch.nn.utils.clip_grad_norm_(opt_params, self.grad_clip, foreach=True if self.fused else None))
        if math.isfinite(norm):  # a non-finite gradient would poison AdamW's moments for good
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.params:
            p.grad = None
        if self.master is not None:
            with torch.no_grad():
                for m, p in zip(self.master, self.params, strict=True):
                    p.copy_(m)
        return norm

    def _counters(self, records: list[Record], stats: BatchStats, norms: list[float],
                  skipped: int, seconds: float) -> dict[str, float]:
        out = {
            "optim/grad_norm": sum(norms) / len(norms) if norms else 0.0,
            "optim/lr": float(self.optimizer.param_groups[0]["lr"]),
            "optim/steps": float(len(norms)),
            "optim/skipped_steps": float(skipped),
            "train/version": float(self.version),
            "train/trajectories": float(len(records)),
            "train/tokens": float(sum(int(r.gen_pos.numel()) for r in records)),
            "train/dropped_malformed": float(stats.dropped_malformed),
            "train/dropped_infra": float(stats.dropped_infra),
            "train/dropped_empty": float(stats.dropped_empty),
            "train/nonfinite_sampler": float(stats.nonfinite_sampler),
            "perf/train_step_s": seconds,
        }
        return out

    # ------------------------------------------------------------------ weights and state

    def tensor_bytes(self) -> dict[str, int]:
        """Bytes the trainer's tensors hold, each storage once (``weights.accounting``): the model's
        parameters and buffers, the gradients of the last update (freed after each optimizer
        step), the optimizer's state, the float32 master copies and the frozen reference model."""
        def owned(*objs: Any) -> int:
            return tensor_bytes(*objs)["owned"]

        model = [t.detach() for t in (*self.model.parameters(), *self.model.buffers())]
        return {"params": owned(model), "grads_in_step": self.grad_bytes,
                "optimizer": owned(list(self.optimizer.state.values())),
                "master": owned([m.detach() for m in self.master or []]),
                "ref_model": 0 if self.ref_model is None else owned(
                    [t.detach() for t in (*self.ref_model.parameters(), *self.ref_model.buffers())])}

    def state_dict_for_samplers(self) -> dict[str, Tensor]:
        """Copies of the current weights on the CPU, in the trainer's precision (immutable)."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def sampler_views(self) -> dict[str, Tensor]:
        """What ``state_dict_for_samplers`` copies, as views of the trainer's own tensors where
        they are CPU tensors already (no copy): valid until the next update changes them in
        place, so a caller writes them out before it lets one run (the embedded trainer writes
        them into shared memory under the lock its updates take)."""
        if self.device.type != "cpu":
            return self.state_dict_for_samplers()
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "master": None if self.master is None else [m.detach().clone() for m in self.master],
                "version": self.version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.master is not None:
            if state.get("master") is None:
                raise ValueError(f"checkpoint has no float32 master weights but precision is {self.precision}")
            with torch.no_grad():
                for m, saved in zip(self.master, state["master"], strict=True):
                    m.copy_(saved)
        self.version = int(state["version"])
