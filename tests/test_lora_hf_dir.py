"""A LoRA run's checkpoint HF directory: the adapters merged onto the base weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf_model import write_tiny_gguf

from mixrl.train.export import write_hf_dir


def test_adapter_only_state_is_merged_onto_the_base(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mixrl.models.loading import resolve_model

    monkeypatch.setenv("MIXRL_GGUF_CACHE", str(tmp_path / "cache"))
    _, path = write_tiny_gguf(tmp_path)
    base = resolve_model(path)
    src = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).state_dict()
    gen = torch.Generator().manual_seed(0)
    sd = {}
    for i in range(2):
        for name in ("q_proj", "v_proj"):
            w = src[f"model.layers.{i}.self_attn.{name}.weight"]
            sd[f"model.layers.{i}.self_attn.{name}.lora_A.default.weight"] = torch.randn(4, w.shape[1], generator=gen)
            sd[f"model.layers.{i}.self_attn.{name}.lora_B.default.weight"] = torch.randn(w.shape[0], 4, generator=gen)
    write_hf_dir(tmp_path / "hf", sd, str(base), AutoTokenizer.from_pretrained(str(base)), lora_scaling=2.0)
    got = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).state_dict()
    for k, v in src.items():  # float64 reference of W + 2 B A; untouched weights stay as they were
        a, b = k.replace(".weight", ".lora_A.default.weight"), k.replace(".weight", ".lora_B.default.weight")
        want = v.double() + 2.0 * sd[b].double() @ sd[a].double() if a in sd else v.double()
        torch.testing.assert_close(got[k].double(), want, rtol=2e-6, atol=2e-5, msg=k)
    with pytest.raises(ValueError, match="lora_scaling"):
        write_hf_dir(tmp_path / "hf2", sd, str(base), AutoTokenizer.from_pretrained(str(base)))
