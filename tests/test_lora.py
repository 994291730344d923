"""LoRA through peft: merged weights equal peft's merge; only adapters train and checkpoint; export.

References: peft's own ``LoraLayer.merge`` (float64) for the merged weights,
and the adapted model's logits for the exported merged model and adapter.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from test_fsdp import batch

from mixrl.config import build_config

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> str:
    from transformers import AutoModelForCausalLM

    from mixrl.models.policy import tiny_config
    from mixrl.models.tokenizer import save_tokenizer

    path = tmp_path_factory.mktemp("lora-policy")
    tok = save_tokenizer(path)
    torch.manual_seed(0)
    cfg = tiny_config(len(tok), layers=2, hidden=32, heads=2, kv_heads=1, intermediate=64,
                      pad_id=tok.pad_token_id, eos_id=tok.eos_token_id)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return str(path)


def lora_cfg(policy: str, tmp: Path) -> Any:
    return build_config({"model": {"path": policy}, "optim": {"lr": 1e-2},
                         "trainer": {"lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj"]}},
                         "observe": {"run_dir": str(tmp)}})


def randomize_b(model: Any, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1)


def test_merged_weights_equal_peft_merge_float64(policy: str, tmp_path: Path) -> None:
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM

    from mixrl.train.lora import apply_lora, merged_state_dict

    model = apply_lora(AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float64),
                       lora_cfg(policy, tmp_path).trainer.lora)
    randomize_b(model)
    ours = merged_state_dict(model.state_dict(), model.lora_scaling)
    ref = copy.deepcopy(model)
    for m in ref.modules():
        if isinstance(m, LoraLayer):
            m.merge()  # peft's in-place W += scaling * B A
    ref_sd = {k.replace(".base_layer.", "."): v for k, v in ref.state_dict().items() if ".lora_" not in k}
    plain = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float64)
    assert ours.keys() == ref_sd.keys() == plain.state_dict().keys()
    for k in ours:
        torch.testing.assert_close(ours[k], ref_sd[k], rtol=0, atol=1e-12)
    assert max(float((ours[k] - plain.state_dict()[k]).abs().max()) for k in ours) > 1e-3  # B != 0 moved W
    plain.load_state_dict(ours, strict=True)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(plain(ids).logits, model(ids).logits, rtol=0, atol=1e-10)


def test_only_adapters_train_checkpoint_and_export(policy: str, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from mixrl.config.presets import needs
    from mixrl.runtime.run import resolve_loss
    from mixrl.runtime.trainer_state import build_trainer
    from mixrl.train.lora import LoraTrainer
    from mixrl.train.surface import save_policy

    cfg = lora_cfg(policy, tmp_path)
    loss_cfg = resolve_loss(cfg)[0]
    trainer, tok = build_trainer(cfg, policy, loss_cfg)
    assert isinstance(trainer, LoraTrainer)
    frac = trainer.trainable_fraction()
    assert 0 < frac < 0.2 and all(".lora_" in n for n, p in trainer.model.named_parameters() if p.requires_grad)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    vocab = int(trainer.model.lm_head.weight.shape[0])
    for s in range(2):
        trajs, adv = batch(vocab, needs(loss_cfg).cand_kind, 8, seed=s)
        trainer.step(trajs, adv)
    after = trainer.model.state_dict()
    changed = {k for k in after if not torch.equal(after[k], before[k])}
    assert changed and all(".lora_" in k for k in changed)  # base weights untouched
    assert any(".lora_A." in k for k in changed) and any(".lora_B." in k for k in changed)

    state = trainer.state_dict()
    assert state["model"] and all(".lora_" in k for k in state["model"])  # adapter-only checkpoint
    fresh, _ = build_trainer(cfg, policy, loss_cfg)
    fresh.load_state_dict(copy.deepcopy(state))
    for k, v in fresh.model.state_dict().items():
        torch.testing.assert_close(v, after[k], rtol=0, atol=0)

    pub = trainer.state_dict_for_samplers()  # what samplers load: plain keys, merged
    plain = AutoModelForCausalLM.from_pretrained(policy)
    plain.load_state_dict(pub, strict=True)
    ids = torch.randint(0, vocab, (2, 7), generator=torch.Generator().manual_seed(3))
    trainer.model.eval()
    with torch.no_grad():
        want = trainer.model(ids).logits
        torch.testing.assert_close(plain(ids).logits, want, rtol=1e-5, atol=1e-5)

        out = tmp_path / "export"
        save_policy(trainer, tok, str(out))
        merged = AutoModelForCausalLM.from_pretrained(str(out))
        torch.testing.assert_close(merged(ids).logits, want, rtol=1e-5, atol=1e-5)
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(policy), str(out / "adapter"))
        torch.testing.assert_close(adapted(ids).logits, want, rtol=1e-5, atol=1e-5)
