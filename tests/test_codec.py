"""``Codec`` gives exactly the HF tokenizer's encode/decode, directly through the backend
only where that is the same computation, and through HF otherwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from chat_templates import bpe_tokenizer

from mixrl.models.codec import Codec
from mixrl.models.tokenizer import build_tokenizer

TEXTS = ["", " ", "What is 12*7+3?", "  two  spaces\nand a newline\t", "<|end|><|user|>forged<|assistant|>",
         "<|im_end|>\n<|im_start|>user", "<|eot_id|><|start_header_id|>", "ünïcödé ✓ 数学", "<calc>2+2</calc>",
         "a" * 300, "error: division by zero; 87."]


def _tokenizers(tmp: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    out = {"bundled": build_tokenizer(), "qwen": bpe_tokenizer("qwen"), "llama": bpe_tokenizer("llama")}
    for name in list(out):  # as a user's model directory loads it (AutoTokenizer picks the class)
        out[name].save_pretrained(str(tmp / name))
        out[f"{name}-auto"] = AutoTokenizer.from_pretrained(str(tmp / name))
    return out


def _check(tok: Any, codec: Codec) -> None:
    for text in TEXTS:
        ids = list(tok.encode(text, add_special_tokens=False))
        assert codec.encode(text) == ids, text
        for skip in (False, True):
            assert codec.decode(ids, skip) == tok.decode(ids, skip_special_tokens=skip), (text, skip)


def test_the_codec_equals_hf_on_every_test_tokenizer_and_goes_direct(tmp_path: Path) -> None:
    for name, tok in _tokenizers(tmp_path).items():
        codec = Codec(tok)
        _check(tok, codec)
        if name.startswith("bundled"):  # clean_up_tokenization_spaces off: both directions direct
            assert codec.direct() == (True, True), name
        else:
            assert codec.direct()[0], name


def test_a_configuration_hf_would_change_falls_back_to_hf() -> None:
    tok = build_tokenizer()
    codec = Codec(tok)
    tok.clean_up_tokenization_spaces = True  # HF rewrites the decoded text: decode goes through HF
    assert codec.direct() == (True, False)
    _check(tok, codec)
    tok.clean_up_tokenization_spaces = False
    tok.backend_tokenizer.enable_truncation(max_length=3)  # HF would disable it first
    assert codec.direct()[0] is False
    assert codec.encode("a" * 10) == list(tok.encode("a" * 10, add_special_tokens=False))  # 10 ids, not 3
    assert len(codec.encode("a" * 10)) == 10
    tok.split_special_tokens = True  # HF would encode "<|end|>" as characters
    assert codec.direct()[0] is False
    assert codec.encode("<|end|>") == list(tok.encode("<|end|>", add_special_tokens=False))
    assert codec.direct()[0] is True  # HF's call set the backend's mode; now the same again


def test_a_tokenizer_class_that_overrides_encoding_keeps_its_own() -> None:
    from transformers import PreTrainedTokenizerFast

    class Shouting(PreTrainedTokenizerFast):
        def _encode_plus(self, text: Any, *args: Any, **kwargs: Any) -> Any:
            return super()._encode_plus(text.upper() if isinstance(text, str) else text, *args, **kwargs)

    base = build_tokenizer()
    tok = Shouting(tokenizer_object=base.backend_tokenizer, eos_token="<|eos|>", unk_token="<|unk|>")
    codec = Codec(tok)
    assert codec.direct()[0] is False
    assert codec.encode("abc") == list(tok.encode("abc", add_special_tokens=False)) != base.encode("abc")


def test_a_slow_or_foreign_tokenizer_goes_through_its_methods() -> None:
    class Plain:  # any object with HF's two methods
        clean_up_tokenization_spaces = False

        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return [ord(c) for c in text]

        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            return "".join(map(chr, ids))

    codec = Codec(Plain())
    assert codec.direct() == (False, False)
    assert codec.encode("hé") == [104, 233] and codec.decode([104, 233]) == "hé"


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
