"""Model loading: local directories, hub ids from a local HF cache, what is missing, one line."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from chat_templates import QWEN, bpe_tokenizer, save_tiny_llama
from hf_cache import hf_cache_layout

from mixrl.config import ConfigError
from mixrl.models.loading import check_model, load_tokenizer, resolve_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("llama") / "tiny-llama", bpe_tokenizer("llama"))


def _hf_cache(root: Path, repo: str, src: Path) -> Path:
    return hf_cache_layout(root / "hub", repo, src)


def test_local_dir_and_hub_id_from_the_local_cache(llama_dir: Path, tmp_path: Path, monkeypatch) -> None:
    assert resolve_model(llama_dir) == llama_dir
    assert check_model(str(llama_dir)) == llama_dir
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    snap = _hf_cache(tmp_path / "hf", "tiny-org/tiny-llama", llama_dir)
    assert resolve_model("tiny-org/tiny-llama") == snap
    assert check_model("tiny-org/tiny-llama") == snap
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(snap))  # what the run then loads
    with pytest.raises(ConfigError, match=r"model.path: 'tiny-org/absent' is neither a local directory nor a hub id "
                                          r"in the local Hugging Face cache .*hf download tiny-org/absent"):
        resolve_model("tiny-org/absent")


def test_what_is_missing_is_named_in_one_line(llama_dir: Path, tmp_path: Path) -> None:
    def broken(name: str) -> Path:
        d = tmp_path / name
        shutil.copytree(llama_dir, d)
        return d

    cases = []
    d = broken("noweights")
    (d / "model.safetensors").unlink()
    cases.append((d, "no weights"))
    d = broken("truncated")
    (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:100])
    cases.append((d, "not a readable safetensors file"))
    d = broken("notok")
    for f in d.glob("tokenizer*"):
        f.unlink()
    cases.append((d, "no loadable tokenizer"))
    d = broken("noconfig")
    (d / "config.json").unlink()
    cases.append((d, "without config.json"))
    d = broken("badconfig")
    (d / "config.json").write_text('{"model_type": "no-such-arch"}')
    cases.append((d, "config.json cannot be read"))
    cases.append((tmp_path / "nowhere", "does not exist"))
    for path, what in cases:
        with pytest.raises(ConfigError) as e:
            check_model(str(path))
        msg = str(e.value)
        assert msg.startswith("model.path: ") and what in msg and "\n" not in msg, msg


def test_template_and_eos(tmp_path: Path) -> None:
    d = save_tiny_llama(tmp_path / "notemplate", bpe_tokenizer("qwen", template=False))
    with pytest.raises(ConfigError, match=r"no chat template; give one with --set model.chat_template=PATH"):
        check_model(str(d))
    tpl = tmp_path / "qwen.jinja"
    tpl.write_text(QWEN)
    assert check_model(str(d), chat_template=str(tpl)) == d
    assert load_tokenizer(d, tpl).chat_template == QWEN
    with pytest.raises(ConfigError, match="model.chat_template: .* is not a file"):
        check_model(str(d), chat_template=str(tmp_path / "none.jinja"))
    d2 = save_tiny_llama(tmp_path / "noeos", bpe_tokenizer("qwen", eos=False))
    with pytest.raises(ConfigError, match="the tokenizer has no EOS token"):
        check_model(str(d2))


def test_cli_refuses_a_missing_model_with_status_2_and_no_run_dir(tmp_path: Path, capsys) -> None:
    from mixrl.commands.main import main

    run_dir = tmp_path / "run"
    for extra in ([], ["--dry-run"]):
        rc = main(["train", "--set", f"model.path={tmp_path / 'missing-model'}",
                   "--set", f'observe.run_dir="{run_dir}"', *extra])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and len(err.splitlines()) == 1 and "model.path:" in err and "does not exist" in err, err
        assert not run_dir.exists()


def test_dry_run_names_the_resolved_model(llama_dir: Path, tmp_path: Path, capsys) -> None:
    from mixrl.commands.main import main

    rc = main(["train", "--set", f"model.path={llama_dir}", "--set", f'observe.run_dir="{tmp_path / "r"}"',
               "--dry-run"])
    assert rc == 0 and f"# model = {llama_dir}" in capsys.readouterr().out
