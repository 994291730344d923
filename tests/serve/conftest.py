"""A tiny random policy with the bundled tokenizer (and its chat template) for the endpoint tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)


def save_tiny_policy(path: Path, hidden: int = 32, heads: int = 2, max_positions: int = 1024) -> Path:
    from transformers import AutoModelForCausalLM

    from mixrl.models.policy import tiny_config
    from mixrl.models.tokenizer import save_tokenizer

    tok = save_tokenizer(path)
    torch.manual_seed(0)
    cfg = tiny_config(len(tok), layers=1, hidden=hidden, heads=heads, kv_heads=1, intermediate=64,
                      max_positions=max_positions, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="package")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_policy(tmp_path_factory.mktemp("serve") / "tiny")

