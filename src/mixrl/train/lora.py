"""LoRA through peft: only the adapters train and checkpoint; samplers get merged weights.

Each target linear layer ``W x`` becomes (Hu et al. 2021, arXiv 2106.09685, eq. 3)::

    h = W x + (alpha / r) · B A x        A [r, d_in], B [d_out, r]; B = 0 at start, so h = W x

``apply_lora`` injects the adapters into the HF model in place
(``peft.inject_adapter_in_model``: the trainer keeps reading ``model.model`` and
``model.lm_head``), freezing every base weight. What leaves the trainer:

- samplers: ``merged_state_dict`` folds ``W + (alpha / r) B A`` into the base
  key names, so every engine loads (and quantizes) plain weights as usual;
- checkpoints: the adapters and their AdamW state only (``LoraTrainer.state_dict``);
- export (``LoraTrainer.export``): the merged HF model, plus the adapter in
  peft's format under ``adapter/`` (loadable with ``PeftModel.from_pretrained``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mixrl.train.trainer import Trainer

ADAPTER = "default"  # peft's adapter name


def apply_lora(model: Any, cfg: Any) -> Any:
    """Inject adapters (``cfg``: ``LoraConfig`` of the run config) into ``model``; returns it."""
    from peft import LoraConfig, inject_adapter_in_model

    pcfg = LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                      target_modules=list(cfg.target_modules), bias="none")
    try:
        inject_adapter_in_model(pcfg, model)
    except ValueError as e:  # peft: no module matched target_modules
        raise ValueError(f"trainer.lora.target_modules={list(cfg.target_modules)}: {e}") from None
    model.__dict__["lora_scaling"] = cfg.alpha / cfg.rank  # plain attribute, not a module/buffer
    model.__dict__["lora_peft_config"] = pcfg
    return model


def is_lora(model: Any) -> bool:
    return "lora_scaling" in getattr(model, "__dict__", {})


def merged_state_dict(sd: dict[str, Tensor], scaling: float) -> dict[str, Tensor]:
    """Base key names with ``W + scaling · B A`` folded in (at least float32 math, the base dtype out)."""
    out: dict[str, Tensor] = {}
    for k, v in sd.items():
        if ".lora_" in k:
            continue
        if ".base_layer." not in k:
            out[k] = v
            continue
        prefix, name = k.split(".base_layer.", 1)
        if name == "weight":
            acc = torch.promote_types(v.dtype, torch.float32)  # never below float32 (bf16 bases)
            a = sd[f"{prefix}.lora_A.{ADAPTER}.weight"].to(acc)  # [r, d_in]
            b = sd[f"{prefix}.lora_B.{ADAPTER}.weight"].to(acc)  # [d_out, r]
            v = (v.to(acc) + scaling * (b @ a)).to(v.dtype)
        out[f"{prefix}.{name}"] = v
    return out


def publishable(model: Any, sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """What the samplers load: ``sd`` itself, or merged when ``model`` has adapters."""
    return merged_state_dict(sd, model.lora_scaling) if is_lora(model) and sd else sd


def adapter_state(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in sd.items() if ".lora_" in k}


def save_adapter(model: Any, sd: dict[str, Tensor], out_dir: str | Path) -> None:
    """The adapter in peft's on-disk format (``adapter_config.json`` + safetensors)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {"base_model.model." + k.replace(f".{ADAPTER}.", "."): v.detach().cpu().contiguous()
               for k, v in sd.items() if ".lora_" in k}
    save_file(tensors, str(out / "adapter_model.safetensors"))
    model.lora_peft_config.save_pretrained(str(out))


def export_merged(model: Any, sd: dict[str, Tensor], tokenizer: Any, out_dir: str | Path) -> None:
    """The merged HF model in ``out_dir`` and, with adapters, the adapter in ``out_dir/adapter``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), state_dict=publishable(model, sd))
    tokenizer.save_pretrained(str(out))
    if is_lora(model):
        save_adapter(model, sd, out / "adapter")


class LoraTrainer(Trainer):
    """A ``Trainer`` whose model carries adapters: merged weights out, adapter-only checkpoints."""

    def state_dict_for_samplers(self) -> dict[str, Tensor]:
        return publishable(self.model, super().state_dict_for_samplers())

    def sampler_views(self) -> dict[str, Tensor]:  # the merged weights are new tensors; the rest views
        return publishable(self.model, super().sampler_views())

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["model"] = adapter_state(state["model"])
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        got = self.model.load_state_dict(state["model"], strict=False)
        missing = [k for k in got.missing_keys if ".lora_" in k]
        if got.unexpected_keys or missing:
            raise ValueError(f"LoRA checkpoint does not match trainer.lora: missing {missing[:3]}, "
                             f"unexpected {got.unexpected_keys[:3]}")
        self.optimizer.load_state_dict(state["optimizer"])
        if self.master is not None:
            with torch.no_grad():
                for m, saved in zip(self.master, state["master"], strict=True):
                    m.copy_(saved)
        self.version = int(state["version"])

    def export(self, out_dir: str, tokenizer: Any) -> None:
        sd = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
        export_merged(self.model, sd, tokenizer, out_dir)

    def trainable_fraction(self) -> float:
        total = sum(p.numel() for p in self.model.parameters())
        return sum(p.numel() for p in self.params) / max(total, 1)
