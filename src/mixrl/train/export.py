"""``mixrl export RUN [--step N] OUT``: a checkpoint of a run as a Hugging Face model directory.

    mixrl export runs/demo out/policy             # the newest checkpoint
    mixrl export runs/demo --step 120 out/step120  # checkpoints/step_000120

OUT then loads with ``transformers.AutoModelForCausalLM.from_pretrained``,
vLLM and ``mixrl eval OUT``. Every checkpoint already holds that directory
(``checkpoints/step_N/hf``): export copies it. A checkpoint written before
checkpoints carried it is converted from its trainer state, with the
architecture and tokenizer of the model the run started from.

Bad input (no checkpoint, a step that is not there, OUT not empty) is one
line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from mixrl.models.loading import load_tokenizer, resolve_model
from mixrl.records.run_dir import RunDir
from mixrl.train.checkpoint import list_checkpoints, load_checkpoint


class ExportError(ValueError):
    """What the user named cannot be exported."""


def find_checkpoint(run: str | Path, step: int | None = None) -> Path:
    """The checkpoint directory of ``run`` at ``step`` (the newest when None)."""

    run = Path(run)
    if (run / "meta.json").is_file() and step is None:  # RUN is a checkpoint itself
        return run
    found = list_checkpoints(run)
    if not found:
        raise ExportError(f"{str(run)!r} has no checkpoints (expected {run}/checkpoints/step_*)")
    if step is None:
        return found[-1]
    want = RunDir(run).checkpoint(step)
    if want not in found:
        steps = ", ".join(str(int(p.name[5:])) for p in found)
        raise ExportError(f"--step {step}: {str(run)!r} has no complete checkpoint at that step (it has: {steps})")
    return want


def export(run: str | Path, out: str | Path, step: int | None = None) -> Path:
    """Write the checkpoint's HF directory to ``out`` (written aside, then renamed)."""
    ckpt = find_checkpoint(run, step)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{str(out)!r} exists and is not an empty directory")
    tmp = out.parent / f".{out.name}.export-tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        if (ckpt / "hf" / "config.json").is_file():
            shutil.copytree(ckpt / "hf", tmp)
        else:
            _convert(ckpt, tmp)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def write_hf_dir(out: Path, state_dict: dict[str, Any], model_path: str, tokenizer: Any,
                 lora_scaling: float | None = None) -> None:
    """``state_dict`` as an HF model directory: the architecture of ``model_path``, its weights
    through ``save_pretrained`` (tied weights handled as transformers does), the tokenizer.
    A LoRA trainer's state holds the adapters only: they are merged onto ``model_path``'s
    weights (``W + lora_scaling * B A``)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if any(".lora_" in k for k in state_dict):
        from mixrl.train.lora import merged_state_dict

        if lora_scaling is None:
            raise ValueError("a LoRA state needs lora_scaling (trainer.lora.alpha / rank) to be merged")
        base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).state_dict()
        layered = {k.replace(".weight", ".base_layer.weight") if k.replace(".weight", ".lora_A.default.weight")
                   in state_dict else k: v for k, v in base.items()}
        state_dict = merged_state_dict({**layered, **state_dict}, lora_scaling)
    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):  # no allocation: the tensors are assigned from the state dict
        model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(state_dict, strict=True, assign=True)
    model.tie_weights()
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


def _convert(ckpt: Path, tmp: Path) -> None:
    """An older checkpoint (no ``hf/``): trainer state + the run's starting model."""

    run_dir = ckpt.parent.parent
    try:
        model_path = json.loads(RunDir(run_dir).derived.read_text())["model_path"]
    except (OSError, KeyError, ValueError):
        raise ExportError(f"{str(ckpt)!r} has no hf/ directory and its run has no derived.json "
                          "naming the model it started from") from None
    model_path = str(resolve_model(model_path))
    state = load_checkpoint(ckpt)["trainer"]
    write_hf_dir(tmp, state["model"], model_path, load_tokenizer(model_path))


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="a run directory (or one checkpoint directory)")
    parser.add_argument("out", help="output directory (must not exist, or be empty)")
    parser.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest)")


def main(args: argparse.Namespace) -> int:
    try:
        out = export(args.run, args.out, args.step)
    except (ExportError, ValueError) as e:
        print(f"mixrl export: {e}", file=sys.stderr)
        return 2
    print(f"exported {find_checkpoint(args.run, args.step)} -> {out}")
    return 0
