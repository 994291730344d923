"""The orchestrator: one training run, written once for every backend.

    trainer v0 ──publish──► weight store ──pull + quantize──► sampler replicas
        ▲                                                          │
        │ step(batch)                           sessions (asyncio) │ generate
        └──── buffer.take(B) ◄── complete groups ◄── run_episode ◄─┘

Async mode (default): sessions keep up to ``max_inflight_prompts`` prompts in
flight at all times; the trainer takes B complete groups as soon as they are
there, updates, publishes, and never waits for the replicas to load the new
version (they pull in the background; sessions in progress continue on the
new weights, each token keeping its own version). Sync mode, for comparison:
B prompts are issued, the trainer waits for all of them, updates, and the next
B prompts start only once every replica serves the new version (staleness 0).

Checkpoints (every ``checkpoint_every`` steps, at the end, and on Ctrl-C) are
taken between two updates; see ``runtime.checkpointing`` for what they hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from typing import Any

from mixrl.config.run import Derived, RunConfig
from mixrl.envs.base import Task
from mixrl.fleet.autoscaler import Autoscaler
from mixrl.fleet.fleet import Fleet, GroupSpec
from mixrl.fleet.weights import WeightStore
from mixrl.rollout.advantages import batch_advantages
from mixrl.rollout.buffer import RolloutBuffer
from mixrl.runtime import batch as batchlib
from mixrl.runtime.handles import Backend, TrainerHandle
from mixrl.runtime.sessions import Sessions, task_from_dict
from mixrl.sampling.base import SamplingParams


class _Stopped(Exception):
    """Ctrl-C arrived while waiting for a batch."""


class RunError(RuntimeError):
    """The run cannot continue (a bug in a session, no replica left)."""


class Orchestrator:
    def __init__(
        self,
        cfg: RunConfig,
        backend: Backend,
        *,
        model_path: str,
        loss_cfg: Any,
        derived: Derived,
        tokenizer: Any,
        profiles: dict[str, Any],
        sinks: Any = None,
        progress: Any = None,
        resume: dict[str, Any] | None = None,
    ):
        self.cfg, self.backend, self.model_path = cfg, backend, model_path
        self.loss_cfg, self.derived, self.tokenizer = loss_cfg, derived, tokenizer
        self.profiles, self.sinks, self.progress, self.resume = profiles, sinks, progress, resume
        self.step = 0
        self.stop_requested = False
        self.history: list[dict[str, float]] = []
        self.timers = {"wait_s": 0.0, "train_s": 0.0, "publish_s": 0.0, "elapsed_s": 0.0}
        self.samples = 0  # trajectories trained on
        self._event = asyncio.Event()
        self.trainer: TrainerHandle
        self.fleet: Fleet
        self.sessions: Sessions
        self.autoscaler: Autoscaler | None = None

    # ------------------------------------------------------------------ setup
    async def setup(self) -> None:
        from mixrl.envs.chat import ChatFormat
        from mixrl.envs.registry import make_env, make_task_source

        cfg = self.cfg
        self.trainer = await self.backend.make_trainer()
        if self.resume is not None:
            await self.trainer.load_state(self.resume["trainer"])
        specs = [
            GroupSpec(g.name, float(self.profiles[g.name].relative_throughput), g.replicas, g.min_replicas, g.max_replicas)
            for g in cfg.fleet.groups
        ]
        self.fleet = Fleet(
            specs, self.backend.make_sampler, WeightStore(put=lambda ref: ref),
            seed=cfg.runtime.seed, max_retries=cfg.runtime.max_session_retries,
        )
        version = await self.trainer.version()
        self.fleet.publish(version, await self.trainer.weights())
        await self.fleet.start()
        if cfg.fleet.autoscaler.type == "inflight":
            a = cfg.fleet.autoscaler
            self.autoscaler = Autoscaler(self.fleet, a.target, a.tolerance, a.interval_s)

        chat = ChatFormat(self.tokenizer)
        env_opts = dict(cfg.env.options)
        self.task_source = make_task_source(cfg.env.name, "train", seed=cfg.runtime.seed)
        self.buffer = RolloutBuffer(cfg.rollout.group_size, cfg.runtime.max_staleness, cfg.runtime.staleness_policy,
                                    dynamic_sampling=cfg.rollout.dynamic_sampling)
        params = SamplingParams(
            temperature=cfg.rollout.temperature, top_p=self.derived.top_p,
            max_new_tokens=cfg.rollout.max_new_tokens, record=self.derived.record,
            stop_ids=(chat.end_of_turn_id,),
        )
        self.sessions = Sessions(
            self.fleet, self.buffer, lambda task: make_env(task, chat, **env_opts), params,
            max_total_tokens=cfg.rollout.max_total_tokens, seed=cfg.runtime.seed,
            on_complete=self._on_complete,
        )
        self.cost = _cost_model(self.profiles)
        self.monitor = _monitor()
        self._screen = _screening(self.model_path, self.loss_cfg, cfg)
        if self.resume is not None:
            from mixrl.runtime.checkpointing import restore

            restore(self, self.resume)

    # ------------------------------------------------------------------ prompts
    def _on_complete(self, prompt_id: str) -> None:
        self._event.set()
        if self.cfg.runtime.mode == "async":
            self._top_up(self.derived.max_inflight_prompts)

    def _top_up(self, limit: int) -> None:
        """Issue prompts (requeued ones first) until ``limit`` are open or complete."""
        for d in self.buffer.requeued():
            self.sessions.issue(task_from_dict(d))
        while self.buffer.num_open() + self.buffer.num_complete() < limit and not self.stop_requested:
            task: Task = self.task_source.next()
            self.sessions.issue(task)

    async def _next_batch(self, version: int) -> tuple[list[Any], dict[str, float]]:
        B = self.cfg.rollout.prompts_per_step
        while True:
            self._check_sessions()
            got = self.buffer.take(B, version)
            if got is not None:
                return got
            if self.stop_requested:
                raise _Stopped
            limit = B if self.cfg.runtime.mode == "sync" else self.derived.max_inflight_prompts
            self._top_up(limit)
            self._event.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._event.wait(), timeout=1.0)

    def _check_sessions(self) -> None:
        if self.sessions.errors:
            e = self.sessions.errors[0]
            raise RunError(f"a rollout session failed: {type(e).__name__}: {e}") from e

    # ------------------------------------------------------------------ loop
    async def run(self) -> dict[str, Any]:
        """Train ``runtime.steps`` updates (or until Ctrl-C); returns a summary."""
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread
            loop.add_signal_handler(signal.SIGINT, self.request_stop)
        scaler = asyncio.ensure_future(self.autoscaler.run()) if self.autoscaler else None
        t_start = time.perf_counter() - self.timers["elapsed_s"]
        interrupted = False
        try:
            while self.step < self.cfg.runtime.steps:
                version = await self.trainer.version()
                t0 = time.perf_counter()
                try:
                    groups, bmetrics = await self._next_batch(version)
                except _Stopped:
                    interrupted = True
                    break
                t1 = time.perf_counter()
                # advantages over what the trainer will train on (malformed left out, overlong handled)
                trajs, adv, astats = batch_advantages(groups, self.loss_cfg, **self._screen)
                tmetrics = await self.trainer.step(trajs, adv)
                t2 = time.perf_counter()
                new_version = await self.trainer.version()
                self.fleet.publish(new_version, await self.trainer.weights())
                if self.cfg.runtime.mode == "sync":
                    await self.fleet.wait_synced(new_version)
                t3 = time.perf_counter()
                self.step += 1
                self.samples += len(trajs)
                self.timers["wait_s"] += t1 - t0
                self.timers["train_s"] += t2 - t1
                self.timers["publish_s"] += t3 - t2
                elapsed = time.perf_counter() - t_start
                self.timers["elapsed_s"] = elapsed
                m = self._metrics(trajs, tmetrics, bmetrics, astats, (t0, t1, t2, t3), elapsed)
                self._record(m, elapsed)
                if self.sinks is not None and hasattr(self.sinks, "batch"):
                    self.sinks.batch(self.step, version, groups)
                if self.cfg.observe.stop_on_collapse and self.monitor is not None and self.monitor.collapsed:
                    print(f"collapse flagged at step {self.monitor.first_collapse_step} "
                          "(observe.stop_on_collapse): stopping")
                    break
                ce = self.cfg.runtime.checkpoint_every
                if ce and self.step % ce == 0 and self.step < self.cfg.runtime.steps:
                    await self.checkpoint()
                if self.stop_requested:
                    interrupted = True
                    break
            await self.checkpoint()
        finally:
            if scaler is not None:
                scaler.cancel()
            await self.sessions.cancel_all()
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.remove_signal_handler(signal.SIGINT)
        return self.summary(interrupted)

    def request_stop(self) -> None:
        self.stop_requested = True
        self._event.set()

    def _metrics(
        self, trajs: list[Any], tmetrics: dict[str, float], bmetrics: dict[str, float],
        astats: dict[str, float], ts: tuple[float, float, float, float], elapsed: float,
    ) -> dict[str, float]:
        t0, t1, t2, t3 = ts
        m: dict[str, float] = {}
        m.update(tmetrics)
        m.update(bmetrics)
        m.update(astats)
        m.update(batchlib.rollout_metrics(trajs, [g.name for g in self.cfg.fleet.groups]))
        m.update(self.fleet.metrics())
        if self.cost is not None:
            m.update(self.cost.update(batchlib.tokens_by_group(trajs)))
        m["time/wait_s"] = t1 - t0
        m["time/train_s"] = t2 - t1
        m["time/publish_s"] = t3 - t2
        m["time/step_s"] = t3 - t0
        m["perf/samples_per_s"] = self.samples / max(elapsed, 1e-9)
        m["perf/trainer_idle_frac"] = self.timers["wait_s"] / max(elapsed, 1e-9)
        m["train/version"] = float(self.step)
        return m

    def _record(self, m: dict[str, float], elapsed: float) -> None:
        self.history.append(m)
        if self.sinks is not None:
            self.sinks.write(self.step, elapsed, m)
        if self.monitor is not None:
            events = self.monitor.update(self.step, m)
            if events and self.sinks is not None and hasattr(self.sinks, "events"):
                self.sinks.events(events)
        if self.progress is not None:
            self.progress.update(self.step, m, elapsed)

    async def checkpoint(self) -> None:
        from mixrl.runtime.checkpointing import save

        await save(self)

    def summary(self, interrupted: bool) -> dict[str, Any]:
        el = max(self.timers["elapsed_s"], 1e-9)
        return {
            "steps": self.step,
            "interrupted": interrupted,
            "elapsed_s": el,
            "samples": self.samples,
            "samples_per_s": self.samples / el,
            "trainer_idle_frac": self.timers["wait_s"] / el,
            "timers": dict(self.timers),
            "fleet": self.fleet.metrics(),
            "collapse": self.monitor.summary() if self.monitor is not None else None,
        }

    async def close(self) -> None:
        await self.fleet.close()
        await self.trainer.close()


def _cost_model(profiles: dict[str, Any]) -> Any:
    try:
        from mixrl.fleet.cost import CostModel
    except ImportError as e:  # optional component
        print(f"warning: cost model unavailable ({e}); cost/* metrics are skipped")
        return None
    return CostModel.from_profiles(profiles)


def _screening(model_path: str, loss_cfg: Any, cfg: RunConfig) -> dict[str, Any]:
    """Keywords of ``rollout.advantages.batch_advantages`` for this run."""
    from transformers import AutoConfig

    from mixrl.config.presets import needs
    from mixrl.runtime.trainer_state import generation_budget

    vocab = int(AutoConfig.from_pretrained(model_path).vocab_size)
    return {"vocab_size": vocab, "cand_kind": needs(loss_cfg).cand_kind,
            "overlong": cfg.rollout.overlong, "budget": generation_budget(cfg)}


def _monitor() -> Any:
    try:
        from mixrl.observe.monitor import CollapseMonitor
    except ImportError as e:
        print(f"warning: collapse monitor unavailable ({e}); collapse.jsonl is not written")
        return None
    return CollapseMonitor()
