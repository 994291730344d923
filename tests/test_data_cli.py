"""``mixrl train`` with your data: user errors (exit 2, one line), run directories, internal errors, quiet output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from mixrl.commands.main import main

torch.set_num_threads(1)
REWARD = "import re\n\ndef exact(completions, answer, **kw):\n    return [float(bool(re.search(answer[0], c))) for c in completions]\n"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM

    from mixrl.models.policy import tiny_config
    from mixrl.models.tokenizer import save_tokenizer

    path = tmp_path_factory.mktemp("policy") / "tiny"
    tok = save_tokenizer(path)
    torch.manual_seed(0)
    cfg = tiny_config(len(tok), layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64, max_positions=256,
                      pad_id=tok.pad_token_id, eos_id=tok.eos_token_id)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def project(tmp: Path, policy: Path, rows: int = 12, extra: str = "") -> Path:
    """A user's folder: data, a reward file and a config (relative paths)."""
    (tmp / "data").mkdir(parents=True, exist_ok=True)
    for name, n in (("train", rows), ("test", 4)):
        (tmp / "data" / f"{name}.jsonl").write_text(
            "".join(json.dumps({"prompt": f"What is {i}+1?", "answer": str(i + 1)}) + "\n" for i in range(n)))
    (tmp / "reward.py").write_text(REWARD)
    (tmp / "config.toml").write_text(textwrap.dedent(f"""
        [model]
        path = "{policy}"
        [data]
        train = "data/train.jsonl"
        heldout = "data/test.jsonl"
        [reward]
        function = "reward.py:exact"
        [rollout]
        group_size = 2
        prompts_per_step = 2
        max_new_tokens = 4
        max_total_tokens = 48
        [[fleet.groups]]
        name = "fp32"
        profile = "fp32"
        [runtime]
        steps = 2
        mode = "sync"
        [runtime.eval]
        n_tasks = 2
        n = 1
        [observe]
        run_dir = "{tmp / 'run'}"
        tensorboard = false
        progress = false
        {extra}
        """))
    return tmp / "config.toml"


def one_line_error(capsys: pytest.CaptureFixture[str], *words: str) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for w in words:
        assert w in err, err
    return err


def test_dry_run_rejects_bad_envs_options_data_and_rewards(capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny: Path) -> None:
    assert main(["train", "--dry-run", "--set", "env.name=jsonl"]) == 2
    one_line_error(capsys, "env.name", "'jsonl'", "calc", "dataset")
    assert main(["train", "--dry-run", "--set", "env.options={max_turnz=1}"]) == 2
    one_line_error(capsys, "max_turnz", "max_turns")
    cfg = project(tmp_path, tiny)
    assert main(["train", str(cfg), "--dry-run", "--set", 'reward.function="reward.py:nope"']) == 2
    one_line_error(capsys, "has no function 'nope'", "exact")
    assert main(["train", str(cfg), "--dry-run", "--set", 'data.train="data/missing.jsonl"']) == 2
    one_line_error(capsys, "data/missing.jsonl")
    assert main(["train", str(cfg), "--dry-run", "--set", 'data.prompt_key="question"']) == 2
    one_line_error(capsys, "prompt_key", "question")
    assert main(["train", str(cfg), "--dry-run", "--set", 'env.options={tools=["web"]}']) == 2
    one_line_error(capsys, "tools", "web", "calc")
    assert main(["train", str(cfg), "--dry-run"]) == 0
    assert f'train = "{tmp_path / "data" / "train.jsonl"}"' in capsys.readouterr().out  # resolved next to the config


PLUGIN = '''
from mixrl.envs.base import MessageEnv, Reply

class Echo(MessageEnv):
    def __init__(self, task, chat, max_turns=2, greeting="hi"):
        super().__init__(task, chat, max_turns=max_turns)

    async def respond(self, reply):
        return Reply.end(await self.reward(reply))

class Broken(Echo):
    def __init__(self, task, chat):
        raise RuntimeError("kaboom in the environment")
'''


def _plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "site"
    pkg.mkdir()
    (pkg / "my_envs.py").write_text(PLUGIN)
    dist = pkg / "my_envs-0.1.dist-info"  # an installed distribution declaring an entry point
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-envs\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[mixrl.envs]\necho = my_envs:Echo\n")
    monkeypatch.syspath_prepend(str(pkg))


def test_env_plugins_by_path_and_entry_point(capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    _plugin(tmp_path, monkeypatch)
    cfg = project(tmp_path / "p", tiny)
    for name in ("my_envs:Echo", "echo"):
        assert main(["train", str(cfg), "--dry-run", "--set", f'env.name="{name}"',
                     "--set", "env.options={greeting=\"yo\"}"]) == 0, capsys.readouterr().err
        assert main(["train", str(cfg), "--dry-run", "--set", f'env.name="{name}"',
                     "--set", "env.options={greting=1}"]) == 2
        one_line_error(capsys, "greting", "greeting", "max_turns")
    assert main(["train", str(cfg), "--dry-run", "--set", 'env.name="my_envs:Nope"']) == 2
    one_line_error(capsys, "my_envs:Nope")


def test_internal_error_prints_one_line_and_keeps_the_traceback(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                                tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _plugin(tmp_path, monkeypatch)
    cfg = project(tmp_path / "p", tiny)
    assert main(["train", str(cfg), "--no-eval", "--set", 'env.name="my_envs:Broken"']) == 1
    err = one_line_error(capsys, "internal error", "kaboom", "run.log")
    log = Path(err.rsplit("traceback in ", 1)[1].rstrip(")"))
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "kaboom in the environment" in text


def _prompts(run: Path) -> list[str]:
    return [p for ln in (run / "batches.jsonl").read_text().splitlines() for p in json.loads(ln)["prompts"]]


def test_run_directory_guard_resume_and_what_changed(capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny: Path) -> None:
    cfg = project(tmp_path, tiny)
    run = tmp_path / "run"
    assert main(["train", str(cfg), "--no-eval"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "done: 2 updates" in out and f"run directory: {run}" in out and "mixrl report" in out
    assert main(["train", str(cfg), "--no-eval"]) == 2  # a fresh run never appends to an old one
    one_line_error(capsys, "not empty", "--resume", "--overwrite")
    assert main(["train", str(cfg), "--no-eval", "--overwrite"]) == 0
    assert len(_prompts(run)) == 4  # replaced, not appended
    # resume to 4 steps: the same prompts, in the same order, as one straight 4-step run
    assert main(["train", "--resume", str(run), "--no-eval", "--set", "runtime.steps=4"]) == 0
    straight = tmp_path / "straight"
    assert main(["train", str(cfg), "--no-eval", "--set", "runtime.steps=4", "--set", f'observe.run_dir="{straight}"']) == 0
    assert _prompts(run) == _prompts(straight) and len(set(_prompts(run))) == 8
    capsys.readouterr()
    with open(tmp_path / "data" / "train.jsonl", "a") as f:  # the data changed under the run
        f.write(json.dumps({"prompt": "What is 99+1?", "answer": "100"}) + "\n")
    assert main(["train", "--resume", str(run), "--no-eval", "--set", "runtime.steps=6"]) == 2
    one_line_error(capsys, "data.train", "rows 12 -> 13")
    project(tmp_path, tiny)  # data restored
    other = tmp_path / "other_policy"
    import shutil

    shutil.copytree(tiny, other)
    from safetensors.torch import load_file, save_file

    w = load_file(str(other / "model.safetensors"))
    save_file({k: v + 1e-3 for k, v in w.items()}, str(other / "model.safetensors"))
    assert main(["train", "--resume", str(run), "--no-eval", "--set", f'model.path="{other}"']) == 2
    one_line_error(capsys, "model: weights", str(other))


def test_a_short_run_prints_only_our_lines_and_pipes_cleanly(tmp_path: Path, tiny: Path) -> None:
    cfg = project(tmp_path, tiny, extra="")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.run([sys.executable, "-m", "mixrl.commands.main", "train", str(cfg), "--set", "runtime.steps=4"],
                       capture_output=True, text=True, env=env, timeout=900)
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]
    assert p.returncode == 0, p.stderr
    ours = ("done: 4 updates", "held-out pass@1:", "run directory:", "next: mixrl report")
    assert len(lines) == len(ours) and all(ln.startswith(o) for ln, o in zip(lines, ours, strict=True)), lines
    # `mixrl train --dry-run | head -1`: the reader goes away before the output is written
    proc = subprocess.Popen([sys.executable, "-m", "mixrl.commands.main", "train", "--dry-run"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 0 and "BrokenPipe" not in err and err.strip() == "", err
