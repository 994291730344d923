"""The bundled policy: config, save/reload by path, pretrain reproducibility, cache."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from mixrl.lab import pretrain
from mixrl.models.chat import ChatFormat
from mixrl.models.policy import load_policy, tiny_config
from mixrl.models.shipped import bundled_policy_path
from mixrl.models.tokenizer import build_tokenizer

MINI = pretrain.Recipe(layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64, steps=3, batch=4,
                       warmup=1, threads=1)


def test_tiny_config_and_bad_shape() -> None:
    cfg = tiny_config(109)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size, cfg.tie_word_embeddings) == (1, 32, 109, True)
    with pytest.raises(ValueError, match="hidden=30"):
        tiny_config(109, hidden=30, heads=4)


def test_demonstrations_mask_only_assistant_tokens() -> None:
    chat = ChatFormat(build_tokenizer())
    recipe = dataclasses.replace(MINI, p_calc=0.7)  # both families (the default is calc only)
    data = pretrain.demonstrations(recipe, chat, 40)
    for ids, labels in data:
        assert len(ids) == len(labels)
        text = chat.decode(ids)
        assert text.startswith("<|user|>") and ids[-1] == chat.end_of_turn_id
        supervised = [t for t, y in zip(ids, labels, strict=True) if y != -100]
        assert supervised and all(y in (-100, t) for t, y in zip(ids, labels, strict=True))
        # role tokens and tool/user turns are context only
        assert chat.tokenizer.convert_tokens_to_ids("<|tool|>") not in supervised
        assert chat.tokenizer.convert_tokens_to_ids("<|user|>") not in supervised
    fams = {chat.decode(ids).split("<|end|>")[0].startswith("<|user|>Uppercase") for ids, _ in data}
    assert fams == {True, False}  # both families
    direct = [(ids, y) for ids, y in data if "<calc>" not in chat.decode(ids)
              and not chat.decode(ids).startswith("<|user|>Uppercase")]
    assert direct  # calc answered without the tool: the guessed value is not supervised
    for _ids, y in direct:
        sup = chat.decode([t for t in y if t != -100])
        assert sup == "<answer></answer><|end|>", sup
    assert pretrain.demonstrations(recipe, chat, 40) == data  # seeded


def test_pretrain_reproducible_by_seed(tmp_path) -> None:
    m1 = pretrain.pretrain(MINI, tmp_path / "a", log=None)
    m2 = pretrain.pretrain(MINI, tmp_path / "b", log=None)
    m3 = pretrain.pretrain(dataclasses.replace(MINI, seed=1), tmp_path / "c", log=None)
    d = [pretrain.weights_digest(load_policy(tmp_path / x)[0]) for x in "abc"]
    assert d[0] == d[1] and d[0] != d[2]
    assert m1["digest"] == m2["digest"] != m3["digest"]
    meta = json.loads((tmp_path / "a" / "recipe.json").read_text())
    assert meta["recipe"]["steps"] == 3 and meta["final_loss"] > 0
    assert not list(tmp_path.glob(".*tmp*"))  # written aside, then renamed


def test_save_and_reload_by_path_gives_same_logits(tmp_path) -> None:
    pretrain.pretrain(MINI, tmp_path / "p", log=None)
    model, tok = load_policy(tmp_path / "p")
    model.save_pretrained(str(tmp_path / "q"))
    tok.save_pretrained(str(tmp_path / "q"))
    again, tok2 = load_policy(str(tmp_path / "q"))
    ids = torch.tensor([ChatFormat(tok).prompt("What is 2+2?")])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, again(ids).logits, rtol=0, atol=0)
    assert tok2.encode("12*7", add_special_tokens=False) == tok.encode("12*7", add_special_tokens=False)
    with pytest.raises(ValueError, match="does not exist"):  # ConfigError: one line, exit 2 in the CLI
        load_policy(tmp_path / "missing")


def test_bundled_path_is_cached_by_recipe_hash(tmp_path, monkeypatch) -> None:
    """ensure_bundled builds once under the cache root and then reuses it; a run only looks the
    build up (it names ``mixrl pretrain`` when there is none)."""
    from mixrl.models import shipped

    def mini(seed: int = 0) -> pretrain.Recipe:
        return dataclasses.replace(MINI, seed=seed)

    monkeypatch.setattr(pretrain, "Recipe", mini)
    monkeypatch.setattr(shipped, "Recipe", mini)
    calls = []
    real = pretrain.pretrain
    monkeypatch.setattr(pretrain, "pretrain", lambda r, out: calls.append(out) or real(r, out, log=None))
    with pytest.raises(FileNotFoundError, match="mixrl pretrain --seed 0"):
        bundled_policy_path(tmp_path)
    p = pretrain.ensure_bundled(tmp_path)
    assert p == tmp_path / f"policy-{MINI.digest()}" and (p / "config.json").exists()
    assert pretrain.ensure_bundled(tmp_path) == p and bundled_policy_path(tmp_path) == p and len(calls) == 1
    monkeypatch.setenv("MIXRL_HOME", str(tmp_path))
    model, _ = load_policy("bundled")
    assert model.config.hidden_size == 32 and len(calls) == 1


def test_cli_pretrain_writes_and_respects_force(tmp_path, capsys) -> None:
    import argparse

    p = argparse.ArgumentParser()
    pretrain.configure(p)
    out = tmp_path / "cli"
    args = p.parse_args(["--out", str(out), "--steps", "1", "--seed", "3"])
    # the full recipe with 1 step still builds the real (4-layer) model: keep it one step
    assert pretrain.main(args) == 0 and (out / "model.safetensors").exists()
    assert pretrain.main(args) == 0 and "exists" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--steps"):
        pretrain.main(p.parse_args(["--out", str(out), "--steps", "0"]))
