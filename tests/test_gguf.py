"""GGUF checkpoints: converted once into a cached HF directory, digest recorded, logits kept.

The tests write their own tiny Llama GGUF file (``gguf_model.write_tiny_gguf``:
llama.cpp's layout, a byte-level BPE vocabulary, a ChatML template) and
compare the converted model's logits with the HF model the file was written from.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf_model import write_tiny_gguf
from tolerance import assert_close

from mixrl.config import ConfigError
from mixrl.models.gguf import cache_root, gguf_file, is_gguf_spec
from mixrl.models.loading import check_model, resolve_model

torch.set_num_threads(1)


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MIXRL_GGUF_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf"))


def _logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double()


def test_conversion_keeps_the_source_logits_tokenizer_and_template(tiny, cache: Path) -> None:
    from transformers import AutoModelForCausalLM

    src, path = tiny
    out = resolve_model(path)
    assert out.parent == cache_root() == cache
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert out.name == f"{digest[:16]}-{path.stem}"
    record = json.loads((out / "gguf_source.json").read_text())
    assert record["sha256"] == digest and record["file"] == path.name and record["tensor_types"] == {"F32": 20}
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert not hasattr(model.config, "quantization_config") and model.config.tie_word_embeddings
    ids = [1, 40, 70, 90, 120, 200, 250, 2, 259, 5]
    # F32 tensors round-trip exactly, so only the two FP32 forwards' own rounding is left
    assert_close(_logits(model, ids), _logits(src, ids), kind="f32")

    tok = check_model(path)  # the converted directory passes every check a run makes
    from mixrl.models.loading import load_tokenizer

    tok = load_tokenizer(tok)
    text = tok.apply_chat_template([{"role": "user", "content": "say the 12"}], add_generation_prompt=True,
                                   tokenize=False)
    assert text == "<|im_start|>user\nsay the 12<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text, add_special_tokens=False).input_ids
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") == 1 and tok.eos_token == "<|im_end|>"
    assert tok.decode(ids) == text  # byte-level BPE with merges: the round trip is exact
    assert {tok.convert_tokens_to_ids("Ġthe"), tok.convert_tokens_to_ids("12")} <= set(ids)  # merges applied


def test_a_run_records_the_gguf_digest(tiny, cache: Path) -> None:
    from mixrl.config import RunConfig
    from mixrl.runtime.inputs import describe_inputs, model_digest

    _, path = tiny
    out = resolve_model(path)
    cfg = RunConfig.model_validate({"model": {"path": str(path)}})
    got = describe_inputs(cfg, str(out))["model"]
    assert got["gguf"]["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert got["path"] == str(path) and got["digest"] == model_digest(out)


def test_f16_file_dequantizes_within_f16_rounding(tmp_path: Path, cache: Path) -> None:
    from transformers import AutoModelForCausalLM

    src, path = write_tiny_gguf(tmp_path, dtype="f16")
    out = resolve_model(path)
    assert json.loads((out / "gguf_source.json").read_text())["tensor_types"] == {"F16": 15, "F32": 5}
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    for name, p in src.state_dict().items():  # every matrix is its FP16 rounding exactly; norms stay F32
        assert torch.equal(model.state_dict()[name], p.half().float() if p.ndim == 2 else p), name
    ids = [1, 40, 70, 90, 120]
    gap = (_logits(model, ids) - _logits(src, ids)).abs().max().item()
    assert 0 < gap < 1e-2  # FP16 weights move the logits, a little


def test_converted_once_then_cached_and_a_changed_file_converts_again(tmp_path: Path, cache: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import mixrl.models.gguf as g

    _, path = write_tiny_gguf(tmp_path, seed=1)
    calls: list[Path] = []
    real = g._convert

    def counting(p, out, digest):
        calls.append(p)
        real(p, out, digest)

    monkeypatch.setattr(g, "_convert", counting)
    first = resolve_model(path)
    assert resolve_model(path) == first and resolve_model(tmp_path) == first  # a folder holding one file
    assert len(calls) == 1
    assert not [p for p in cache.iterdir() if p.name.startswith(".") and p.is_dir()]  # no temporary left
    (tmp_path / "other").mkdir()
    _, path2 = write_tiny_gguf(tmp_path / "other", seed=2)
    second = resolve_model(path2)
    assert second != first and len(calls) == 2


def test_package_resource(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, tiny) -> None:
    _, path = tiny
    pkg = tmp_path / "site" / "tiny_model_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('a model package is never imported')\n")
    (pkg / path.name).write_bytes(path.read_bytes())
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert gguf_file("pkg:tiny_model_pkg") == pkg / path.name
    assert gguf_file(f"pkg:tiny_model_pkg/{path.name}") == pkg / path.name
    assert resolve_model("pkg:tiny_model_pkg") == resolve_model(path)
    assert is_gguf_spec("pkg:tiny_model_pkg") and not is_gguf_spec(str(tmp_path))
    with pytest.raises(ConfigError, match=r"^model\.path: 'pkg:no_such_pkg_x': no installed package"):
        gguf_file("pkg:no_such_pkg_x")


def test_bad_files_are_one_line(tmp_path: Path, cache: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ConfigError, match=r"^model\.path: .*bad\.gguf is not a GGUF file"):
        resolve_model(bad)
    truncated = tmp_path / "trunc.gguf"
    truncated.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\x00" * 9)
    with pytest.raises(ConfigError, match=r"^model\.path: .*transformers cannot convert trunc\.gguf") as e:
        resolve_model(truncated)
    assert "\n" not in str(e.value) and not any(p.is_dir() for p in cache.iterdir())
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.gguf").write_bytes(b"GGUF")
    (empty / "b.gguf").write_bytes(b"GGUF")
    with pytest.raises(ConfigError, match="2 .gguf files"):
        resolve_model(empty)


def _cli(args: list[str], cwd: Path, cache: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, MIXRL_GGUF_CACHE=str(cache),
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1] / "src"),
                                           os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "mixrl.commands.main", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def test_train_dry_run_accepts_a_gguf_file_and_refuses_a_bad_one(tiny, tmp_path: Path) -> None:
    _, path = tiny
    ok = _cli(["train", "--set", f"model.path={path}", "--set", f'observe.run_dir="{tmp_path / "r"}"',
               "--dry-run"], tmp_path, tmp_path / "cache")
    assert ok.returncode == 0, ok.stderr[-2000:]
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    assert f"# model = {tmp_path / 'cache' / (digest + '-' + path.stem)}" in ok.stdout
    bad = tmp_path / "bad.gguf"
    bad.write_text("hello")
    r = _cli(["train", "--set", f"model.path={bad}", "--dry-run"], tmp_path, tmp_path / "cache")
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and "model.path:" in err[0] and "not a GGUF file" in err[0], r.stderr
