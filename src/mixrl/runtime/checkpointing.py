"""What a checkpoint holds, and how a run continues from one.

One checkpoint (written atomically by ``mixrl.train.checkpoint``) holds:

- ``trainer``: model, optimizer, version, RNG states (``runtime.trainer_state``);
- ``task_source``: the data cursor (the next prompt to issue);
- ``buffer``: complete groups not yet trained on, and the finished trajectories
  of the prompts still open (``RolloutBuffer.state_dict``);
- ``inflight``: a partial trajectory per running session, at turn granularity
  (``Sessions.partials``); resumed sessions replay it and continue;
- ``router`` RNG, cost and collapse-monitor state, step counters and timers;
- ``hf/``: the policy as an HF model directory (``save_pretrained`` weights,
  config, tokenizer with its chat template), so ``mixrl eval RUN/checkpoints/step_N``,
  transformers and vLLM load a checkpoint directly (``mixrl export`` copies one out).

Taken between two updates, in one synchronous slice of the event loop after the
trainer's state was read, so all parts describe the same instant. On resume
every open prompt restarts its missing samples (from the partial when there
is one), the cursor continues where it stopped: no prompt is skipped or
repeated.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mixrl.records.trajectory import Trajectory
from mixrl.runtime.sessions import task_from_dict
from mixrl.train.checkpoint import load_latest, save_checkpoint
from mixrl.train.export import write_hf_dir

# ``orch`` below is the run's Orchestrator, which calls these two functions (typed ``Any``: this
# module is below it and does not import it).

FORMAT = 1


async def save(orch: Any) -> Path | None:

    trainer = await orch.trainer.state()
    # -- from here on, no await until the payload is complete: one consistent instant
    orchestrator: dict[str, Any] = {
        "format": FORMAT,
        "step": orch.step,
        "config": orch.cfg.model_dump(mode="json"),
        "task_source": orch.task_source.state_dict(),
        "buffer": orch.buffer.state_dict(),
        "inflight": orch.sessions.partials(),
        "router": orch.fleet.router.state_dict(),
        "cost": orch.cost.state_dict(),
        "monitor": orch.monitor.state_dict(),
        "timers": dict(orch.timers),
        "samples": orch.samples,
    }
    # two parts: tensors (trainer) and plain data (everything the orchestrator holds)
    model = trainer.get("model") if isinstance(trainer, dict) else None
    dirs = {}
    if isinstance(model, dict) and model:
        lora = orch.cfg.trainer.lora
        scaling = lora.alpha / lora.rank if lora is not None else None
        dirs["hf"] = lambda out: write_hf_dir(out, model, orch.model_path, orch.tokenizer, scaling)
    return save_checkpoint(Path(orch.cfg.observe.run_dir), orch.step,
                           {"trainer": trainer, "orchestrator": orchestrator}, dirs=dirs)


def load(run_dir: str | Path) -> dict[str, Any] | None:
    """The newest complete checkpoint of ``run_dir`` (None if there is none)."""

    got = load_latest(Path(run_dir))
    if got is None:
        return None
    payload = dict(got["orchestrator"])
    if payload.get("format") != FORMAT:
        raise ValueError(f"checkpoint in {run_dir} has format {payload.get('format')}, expected {FORMAT}")
    payload["trainer"] = got["trainer"]
    return payload


def restore(orch: Any, payload: dict[str, Any]) -> None:
    """Restore everything but the trainer (restored first, in ``setup``) and restart sessions."""

    orch.step = int(payload["step"])
    orch.task_source.load_state_dict(payload["task_source"])
    orch.buffer.load_state_dict(payload["buffer"])
    orch.fleet.router.load_state_dict(payload["router"])
    orch.cost.load_state_dict(payload["cost"])
    orch.monitor.load_state_dict(payload["monitor"])
    orch.timers.update(payload.get("timers", {}))
    orch.samples = int(payload.get("samples", 0))
    partials: dict[str, dict[int, Trajectory]] = {}
    for _sid, d in payload.get("inflight", {}).items():
        t = Trajectory.from_dict(d)
        partials.setdefault(t.prompt_id, {})[t.sample_idx] = t
    for d in payload["buffer"]["open"]:
        orch.sessions.start_missing(task_from_dict(d["task"]), partials.get(d["prompt_id"], {}))
