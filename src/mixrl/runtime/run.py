"""One training run from a validated config: resolve, build, train, evaluate.

    resolve_loss(cfg)     preset + overrides -> LossConfig (checked against the optimizer)
    train(cfg, ...)       run dir, backend, orchestrator, final checkpoint, held-out eval

The run directory receives ``config.toml`` (the resolved config), ``derived.json``,
``inputs.json`` (the model and data a ``--resume`` must find unchanged),
``run.log`` (warnings, reward-function tracebacks, internal errors),
``metrics.jsonl``, TensorBoard events under ``tb/`` (and W&B / trackio when
configured), ``collapse.jsonl``, ``episodes.jsonl`` (a few decoded sample
episodes), checkpoints, the final policy under ``policy/``, ``eval.json`` and
``summary.json``.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from mixrl.config import ConfigError, Derived, RunConfig, derive, format_errors, to_toml
from mixrl.config.loss import LossConfig
from mixrl.config.presets import check_run, get_preset
from mixrl.envs.family import Active
from mixrl.envs.registry import activate
from mixrl.models.loading import check_model, load_tokenizer
from mixrl.records.run_dir import RunDir
from mixrl.rollout.evaluate import evaluate
from mixrl.runtime.backends.embedded import EmbeddedBackend
from mixrl.runtime.checkpointing import load
from mixrl.runtime.episodes import reply_spans
from mixrl.runtime.inputs import check_unchanged, describe_inputs
from mixrl.runtime.orchestrator import Orchestrator
from mixrl.runtime.progress import ProgressBar
from mixrl.sampling.profiles import get_profile, with_overrides
from mixrl.sampling.support import check_fleet
from mixrl.system.files import atomic_write, atomic_write_json
from mixrl.system.heap import settled_heap
from mixrl.system.quiet import quiet_loaded, silence_libraries
from mixrl.telemetry.sinks import Sinks


def resolve_loss(cfg: RunConfig) -> tuple[Any, Derived]:
    """The loss config (preset + overrides) and the derived sampling values."""
    from pydantic import ValidationError


    try:
        preset = get_preset(cfg.loss.preset)
    except ValueError as e:
        raise ConfigError(f"loss.preset: {e}") from None
    loss = preset.loss
    if cfg.loss.overrides:
        try:
            loss = LossConfig.model_validate({**loss.model_dump(), **cfg.loss.overrides})
        except ValidationError as e:
            lines = format_errors(e).replace("<root>: Value error, ", "").splitlines()
            raise ConfigError("\n".join("loss.overrides." + line if not line.startswith("loss.") else line
                                        for line in lines)) from None
    derived = derive(cfg, preset.sampler_top_p, preset.head_k)
    try:  # the guard rails: one table of what each loss needs (config.presets.needs)
        check_run(loss, preset=cfg.loss.preset, top_p=derived.top_p, record=derived.record,
                  epochs=cfg.optim.epochs, minibatches=cfg.optim.minibatches)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return loss, derived


def group_profiles(cfg: RunConfig) -> dict[str, Any]:
    """Each fleet group's precision profile with its overrides applied; a bad one is a ``ConfigError``."""

    out = {}
    for i, g in enumerate(cfg.fleet.groups):
        try:
            prof = get_profile(g.profile)
        except (KeyError, ValueError) as e:
            raise ConfigError(f"fleet.groups.{i}.profile: {e}") from None
        try:
            out[g.name] = with_overrides(prof, **g.overrides) if g.overrides else prof
        except (ValueError, TypeError) as e:
            raise ConfigError(f"fleet.groups.{i}.overrides: {e}") from None
    return out


def make_backend(cfg: RunConfig, model_path: str, loss_cfg: Any) -> Any:
    """The backend that makes the run's handles: Ray, or the embedded one."""
    if cfg.runtime.backend == "ray":
        from mixrl.runtime.backends.ray_backend import RayBackend

        return RayBackend(cfg, model_path, loss_cfg)

    return EmbeddedBackend(cfg, model_path, loss_cfg)


class _RunSinks:
    """metrics.jsonl + TensorBoard (+ W&B / trackio) + collapse events + sample episodes."""

    def __init__(self, cfg: RunConfig, run_dir: Path, tokenizer: Any = None):

        o = cfg.observe
        self._s = Sinks(run_dir, o.tensorboard, wandb=o.wandb, trackio=o.trackio, config=cfg.model_dump(mode="json"))
        self._events = RunDir(run_dir).collapse
        self._batches = open(RunDir(run_dir).batches, "a", buffering=1)  # noqa: SIM115
        self._episodes = run_dir / "episodes.jsonl"
        self._tok, self._steps = tokenizer, cfg.runtime.steps

    def batch(self, step: int, version: int, groups: list[list[Any]]) -> None:
        """Audit trail: which samples each update trained on (one line per step)."""
        rec = {"step": step, "trainer_version": version,
               "prompts": [g[0].prompt_id for g in groups],
               "samples": [[t.sample_idx for t in g] for g in groups],
               "status": [[t.status for t in g] for g in groups]}
        self._batches.write(json.dumps(rec) + "\n")
        if self._tok is not None and step in {1, max(1, self._steps // 2), self._steps}:
            self._sample_episodes(step, groups)

    def _sample_episodes(self, step: int, groups: list[list[Any]]) -> None:
        """Two decoded episodes (first and best of the first group) for the report."""
        g = groups[0]
        best = max(g, key=lambda t: -1.0 if t.reward is None else float(t.reward))
        with open(self._episodes, "a") as f:
            for t in [g[0]] + ([best] if best is not g[0] else []):
                f.write(json.dumps(episode_record(step, t, self._tok), default=float) + "\n")

    def write(self, step: int, t: float, m: dict[str, Any]) -> None:
        self._s.write(step, t, m)

    def events(self, evs: list[dict[str, Any]]) -> None:
        with open(self._events, "a") as f:
            for e in evs:
                f.write(json.dumps(e, default=float) + "\n")

    def close(self) -> None:
        self._s.close()
        self._batches.close()


def episode_record(step: int, t: Any, tokenizer: Any) -> dict[str, Any]:
    """One trajectory as text: prompt, the rest of the episode (replies and tool output), reward."""
    first = t.loss_mask.index(1) if 1 in t.loss_mask else len(t.tokens)
    dec = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    return {"step": step, "prompt_id": t.prompt_id, "prompt": dec(t.tokens[:first]),
            "completion": dec(t.tokens[first:]), "reward": t.reward, "status": t.status,
            "turns": t.turns, "group": (t.groups[first] if first < len(t.groups) else ""),
            "replies": _replies(t, dec)}


def _replies(t: Any, dec: Any) -> list[dict[str, Any]]:
    """Per assistant reply (one cell per turn in the report's timeline): length, text, group."""

    return [{"tokens": b - a, "text": dec(t.tokens[a:b])[:120], "group": t.groups[a],
             "version": t.versions[a]} for a, b in reply_spans(t)]


def start_log(run_dir: Path) -> Path:
    """Route the ``mixrl`` loggers (and warnings) to ``run_dir/run.log``."""
    import logging

    path = RunDir(run_dir).log
    root = logging.getLogger("mixrl")
    for h in list(root.handlers):
        if getattr(h, "_mixrl_run_log", False):
            root.removeHandler(h)
            h.close()
    h = logging.FileHandler(path)
    h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    h._mixrl_run_log = True  # type: ignore[attr-defined]
    root.addHandler(h)
    root.setLevel(logging.INFO)
    root.propagate = False
    return path


def _truncate_jsonl(path: Path, last_step: int) -> None:
    """Keep the records of steps <= ``last_step`` (a resumed run redoes the later ones)."""
    if not path.exists():
        return
    keep = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= last_step]
    atomic_write(path, "".join(x + "\n" for x in keep))


def train(
    cfg: RunConfig,
    *,
    resume: bool = False,
    evaluate: bool | None = None,
    progress: bool | None = None,
    hook: Any = None,
) -> dict[str, Any]:
    """Run (or continue, with ``resume``) the training ``cfg`` describes; returns the summary.

    ``hook(orch)`` is awaited after setup (tests use it to inject faults).
    """
    import torch


    silence_libraries()
    torch.set_num_threads(cfg.runtime.torch_threads)
    run_dir = Path(cfg.observe.run_dir)
    payload = load(run_dir) if resume else None
    if resume and payload is None:
        raise FileNotFoundError(f"--resume: no checkpoint in {run_dir}")
    model_path, loss_cfg, derived, active = prepare_run_dir(cfg, run_dir, payload)
    profiles = group_profiles(cfg)
    quiet_loaded()
    tokenizer = load_tokenizer(model_path, cfg.model.chat_template)
    bar = ProgressBar(cfg.runtime.steps, payload["step"] if payload else 0, cfg.observe.progress if progress is None else progress)
    sinks = _RunSinks(cfg, run_dir, tokenizer)

    async def main() -> dict[str, Any]:
        backend = make_backend(cfg, model_path, loss_cfg)
        await backend.start()
        orch = Orchestrator(
            cfg, backend, model_path=model_path, loss_cfg=loss_cfg, derived=derived,
            tokenizer=tokenizer, profiles=profiles, sinks=sinks, progress=bar, resume=payload, active=active,
        )
        try:
            await orch.setup()
            if hook is not None:
                await hook(orch)
            with settled_heap():  # start-up is over: full collections no longer walk its heap
                summary = await orch.run()
            if not summary["interrupted"]:
                await orch.trainer.save_policy(str(run_dir / "policy"))
            summary["orchestrator"] = orch
            return summary
        finally:
            if hasattr(orch, "fleet"):
                await orch.close()
            await backend.shutdown()

    t0 = time.perf_counter()
    try:
        summary = asyncio.run(main())
    finally:
        bar.close()
        sinks.close()
    orch = summary.pop("orchestrator")
    summary["wall_s"] = time.perf_counter() - t0
    summary["history"] = orch.history
    return conclude(cfg, summary, model_path, run_dir, evaluate, active)


def prepare_run_dir(cfg: RunConfig, run_dir: Path, payload: dict[str, Any] | None) -> tuple[str, Any, Derived, Active]:
    """Check the model, fleet and (on resume) the inputs, then write the run directory's
    config files; returns (model path, loss config, derived values, the run's env inputs)."""

    active = activate(cfg)  # the dataset, reward functions and env options the sources and envs use
    model_path = str(check_model(cfg.model.path, cfg.model.chat_template))  # ConfigError before any run dir
    # an architecture an engine cannot run: refused now
    check_fleet(model_path, group_profiles(cfg), routing_replay=resolve_loss(cfg)[0].routing_replay)
    inputs = describe_inputs(cfg, model_path)
    if payload is not None:
        check_unchanged(run_dir, inputs)
    run_dir.mkdir(parents=True, exist_ok=True)
    if not RunDir(run_dir).marker.exists():  # this directory is a run's from now on (--overwrite may replace it)
        atomic_write_json(RunDir(run_dir).marker, {"created_by": "mixrl train", "unix_time": time.time()})
    start_log(run_dir)
    if payload is not None:
        for path in (RunDir(run_dir).metrics, RunDir(run_dir).batches):
            _truncate_jsonl(path, int(payload["step"]))
    loss_cfg, derived = resolve_loss(cfg)
    RunDir(run_dir).config.write_text(to_toml(cfg) + "\n")
    atomic_write_json(RunDir(run_dir).derived, {**derived.__dict__, "model_path": model_path}, indent=2)
    atomic_write_json(RunDir(run_dir).inputs, inputs, indent=2)
    return model_path, loss_cfg, derived, active


def conclude(cfg: RunConfig, summary: dict[str, Any], model_path: str, run_dir: Path,
             evaluate: bool | None, active: Active | None = None) -> dict[str, Any]:
    """The held-out evaluation (unless off, interrupted or without held-out data) and ``summary.json``."""
    do_eval = cfg.runtime.eval.enabled if evaluate is None else evaluate
    if do_eval and cfg.data.train is not None and not (cfg.data.heldout or cfg.data.heldout_fraction):
        do_eval = False
        summary["eval_skipped"] = "no held-out data (set data.heldout or data.heldout_fraction)"
    if do_eval and not summary["interrupted"]:
        summary["eval"] = run_eval(cfg, model_path, str(run_dir / "policy"), active)
        atomic_write_json(RunDir(run_dir).eval, summary["eval"], indent=2)
    RunDir(run_dir).summary.write_text(
        json.dumps({k: v for k, v in summary.items() if k != "history"}, indent=2, default=float) + "\n"
    )
    return summary


def run_eval(cfg: RunConfig, base_path: str, final_path: str, active: Active | None = None) -> dict[str, Any]:
    """pass@k on the held-out split, of the starting and the final policy."""

    e = cfg.runtime.eval
    n_tasks = e.n_tasks
    if cfg.data.train is not None:  # a dataset's held-out split may be smaller than n_tasks
        from mixrl.envs.registry import make_task_source

        n_tasks = min(n_tasks, len(make_task_source(cfg.env.name, "heldout", e.seed, active=active)))
    out: dict[str, Any] = {"task": cfg.env.name, "k": e.k, "n": e.n, "n_tasks": n_tasks, "seed": e.seed,
                           "top_p": e.top_p}
    kw = dict(k=e.k, n=e.n, n_tasks=n_tasks, seed=e.seed, task=cfg.env.name,
              max_total_tokens=cfg.rollout.max_total_tokens, max_new_tokens=cfg.rollout.max_new_tokens,
              temperature=cfg.rollout.temperature, top_p=e.top_p, env_options=dict(cfg.env.options),
              chat_template=cfg.model.chat_template, active=active)
    t0 = time.perf_counter()
    out["final"] = evaluate(final_path, **kw)
    if e.base:
        out["base"] = evaluate(base_path, **kw)
        out["gain"] = out["final"][f"pass@{e.k}"] - out["base"][f"pass@{e.k}"]
    out["eval_s"] = time.perf_counter() - t0
    return out

