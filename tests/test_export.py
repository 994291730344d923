"""Checkpoints that serve: every checkpoint holds an HF directory; `mixrl export` writes one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mixrl.train.checkpoint import list_checkpoints

torch.set_num_threads(1)


def _tiny_qwen3(path: Path) -> Path:
    from transformers import AutoModelForCausalLM

    from mixrl.models.policy import tiny_config
    from mixrl.models.tokenizer import save_tokenizer

    tok = save_tokenizer(path)
    torch.manual_seed(0)
    cfg = tiny_config(len(tok), pad_id=tok.pad_token_id, eos_id=tok.eos_token_id)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def _tiny_llama(path: Path) -> Path:
    from chat_templates import bpe_tokenizer, save_tiny_llama

    return save_tiny_llama(path, bpe_tokenizer("qwen"))


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def trained_run(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A 2-update run with a checkpoint after each update."""
    from mixrl.config import build_config
    from mixrl.runtime.run import train

    root = tmp_path_factory.mktemp(request.param)
    model = (_tiny_qwen3 if request.param == "qwen3" else _tiny_llama)(root / "model")
    cfg = build_config({
        "model": {"path": str(model)},
        "env": {"name": "calc"},
        "rollout": {"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 6, "max_total_tokens": 96},
        "fleet": {"groups": [{"name": "fp32", "profile": "fp32", "replicas": 1}]},
        "runtime": {"steps": 2, "seed": 0, "checkpoint_every": 1},
        "observe": {"run_dir": str(root / "run"), "progress": False, "tensorboard": False},
    })
    train(cfg, evaluate=False)
    return model, root / "run"


def test_every_checkpoint_holds_a_loadable_hf_directory(trained_run) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mixrl.train.checkpoint import load_checkpoint

    model_dir, run = trained_run
    ckpts = list_checkpoints(run)
    assert [p.name for p in ckpts] == ["step_000001", "step_000002"]
    for ck in ckpts:
        hf = ck / "hf"
        assert json.loads((ck / "meta.json").read_text())["dirs"] == ["hf"]
        m = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
        state = load_checkpoint(ck)["trainer"]["model"]
        for k, v in m.state_dict().items():  # exactly the trainer's weights at that step
            torch.testing.assert_close(v, state[k], rtol=0, atol=0)
        tok = AutoTokenizer.from_pretrained(str(hf))
        assert tok.chat_template == AutoTokenizer.from_pretrained(str(model_dir)).chat_template


def test_mixrl_eval_loads_a_checkpoint_directly(trained_run, capsys) -> None:
    from mixrl.commands.main import main

    _, run = trained_run
    step = list_checkpoints(run)[0]
    rc = main(["eval", str(step), "--k", "1", "--tasks", "2", "--max-new-tokens", "4", "--threads", "1", "--json"])
    res = json.loads(capsys.readouterr().out)
    assert rc == 0 and res["n_tasks"] == 2 and res["model"] == str(step / "hf")


def test_export_writes_a_model_directory(trained_run, tmp_path: Path, capsys) -> None:
    from transformers import AutoModelForCausalLM

    from mixrl.commands.main import main

    _, run = trained_run
    assert main(["export", str(run), str(tmp_path / "out")]) == 0
    assert main(["export", str(run), "--step", "1", str(tmp_path / "one")]) == 0
    capsys.readouterr()
    a = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).state_dict()
    b = AutoModelForCausalLM.from_pretrained(str(run / "checkpoints" / "step_000002" / "hf")).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "one" / "config.json").is_file()
    for argv, what in ((["--step", "7", str(tmp_path / "x")], "no complete checkpoint at that step"),
                       ([str(tmp_path / "out")], "exists and is not an empty directory")):
        assert main(["export", str(run), *argv]) == 2
        err = capsys.readouterr().err
        assert what in err and len(err.strip().splitlines()) == 1
    assert main(["export", str(tmp_path), str(tmp_path / "y")]) == 2
    assert "has no checkpoints" in capsys.readouterr().err
