"""The one trainer surface: what every backend wraps (in process, a rank, a Ray actor).

    surface = TrainerSurface(trainer, tokenizer)
    metrics = surface.step(trajectories, advantages)
    sd = surface.weights()               # the policy for the samplers (rank 0: all; other ranks: {})
    state = surface.state_dict()          # model, optimizer, version and this process's RNGs
    surface.load_state_dict(state)        # a resumed run continues with identical numbers
    surface.save_policy("out/")           # an HF directory (LoRA: merged; FSDP: gathered)
    lq = surface.probe_logprobs(prompts)  # log p(next token | prompt) over the vocabulary (fleet.check_loads)

A backend adds transport (threads, pipes, Ray calls, shared memory) around these
methods, never logic: the embedded trainer, the rank worker and the Ray actors
all call them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mixrl.records.trajectory import Trajectory
from mixrl.train.checkpoint import capture_rng, restore_rng


class TrainerSurface:
    def __init__(self, trainer: Any, tokenizer: Any) -> None:
        self.trainer = trainer  # mixrl.train.trainer.Trainer (or LoRA, or a rank's sharded one)
        self.tokenizer = tokenizer

    def step(self, trajectories: list[Trajectory], advantages: list[float]) -> dict[str, float]:
        return dict(self.trainer.step(trajectories, advantages))

    def version(self) -> int:
        return int(self.trainer.version)

    def weights(self) -> dict[str, Any]:
        return dict(self.trainer.state_dict_for_samplers())

    def weight_views(self) -> dict[str, Any]:
        """``weights()`` without the copy where the trainer can (``Trainer.sampler_views``): to be
        written out before the next ``step``."""
        views = getattr(self.trainer, "sampler_views", None)
        return dict(views() if views is not None else self.trainer.state_dict_for_samplers())

    def tensor_bytes(self) -> dict[str, int] | None:
        """The trainer's tensor bytes by kind (``Trainer.tensor_bytes``), None where it cannot say."""
        f = getattr(self.trainer, "tensor_bytes", None)
        return None if f is None else dict(f())

    def state_dict(self) -> dict[str, Any]:
        return trainer_state(self.trainer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_trainer_state(self.trainer, state)

    def save_policy(self, out_dir: str) -> None:
        save_policy(self.trainer, self.tokenizer, out_dir)

    def probe_logprobs(self, prompts: list[list[int]]) -> list[list[float]]:
        """The policy's next-token log-probabilities after each prompt (temperature 1, float32):
        what a replica that serves the current version must sample the first token from."""
        import torch

        model, device = self.trainer.model, getattr(self.trainer, "device", torch.device("cpu"))
        out = []
        with torch.no_grad():
            for ids in prompts:
                logits = model(input_ids=torch.tensor([ids], device=device)).logits[0, -1]
                out.append(logits.float().log_softmax(-1).cpu().tolist())
        return out


def trainer_state(trainer: Any) -> dict[str, Any]:

    if hasattr(trainer, "state_dict"):
        state = dict(trainer.state_dict())
    else:
        state = {
            "model": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
            "optimizer": trainer.optimizer.state_dict(),
            "version": int(trainer.version),
        }

    # the trainer's own process (a Ray actor, a rank has its own RNGs): CPU, every CUDA device, python, numpy
    state["rng"] = capture_rng()
    return state


def load_trainer_state(trainer: Any, state: dict[str, Any]) -> None:

    state = dict(state)
    rng = state.pop("rng")
    if hasattr(trainer, "load_state_dict"):
        trainer.load_state_dict(state)
    else:
        trainer.model.load_state_dict(state["model"])
        trainer.optimizer.load_state_dict(state["optimizer"])
        trainer.version = int(state["version"])

    restore_rng(rng)


def save_policy(trainer: Any, tokenizer: Any, out_dir: str) -> None:
    """The current policy as an HF directory (FP32 weights + tokenizer)."""
    export = getattr(trainer, "export", None)
    if export is not None:  # LoRA: merged model + adapter; FSDP ranks: the gathered state
        export(out_dir, tokenizer)
        return
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    trainer.model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
