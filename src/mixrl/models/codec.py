"""Text <-> token ids through the Rust ``tokenizers`` backend, where that is exactly what
the HF tokenizer would compute.

``transformers``' ``encode(text, add_special_tokens=False)`` and ``decode(ids)`` on a
fast tokenizer call ``tokenizers.Tokenizer.encode_batch`` / ``decode`` inside argument
checks, a truncation/padding set-up and a ``BatchEncoding``: on the bundled tokenizer
about 50 µs of Python around 15 µs of work per encode, 17 µs around 5 µs per decode. The
endpoint encodes every new turn and decodes every reply, so that wrapper was a fifth of
its CPU per request.

``Codec`` calls the backend directly only when the HF call would reach it unchanged:

- the tokenizer is a ``TokenizersBackend`` whose ``encode``/``_encode_plus`` and
  ``decode``/``_decode`` are transformers' own (a subclass that overrides one keeps HF's
  path for that direction);
- encode: the backend has no truncation or padding configured and its
  ``encode_special_tokens`` equals the tokenizer's ``split_special_tokens`` (what HF
  would set before encoding), checked on every call;
- decode: ``clean_up_tokenization_spaces`` is off (HF would rewrite the text), checked
  on every call.

Anything else (a slow tokenizer, a custom class) goes through the HF methods.
``tests/test_codec.py`` checks both directions against HF on every test tokenizer.
"""

from __future__ import annotations

from typing import Any

# characters: a longer text is encoded by the batch call, which does not hold the interpreter
# lock (a long text tokenized in a worker thread then leaves the event loop running)
LONG_TEXT = 1 << 14


def _backend(tokenizer: Any) -> tuple[Any, bool, bool]:
    """(the Rust tokenizer or None, encode direct, decode direct)."""
    try:
        import tokenizers
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None, False, False
    b = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(tokenizer, TokenizersBackend) or not isinstance(b, tokenizers.Tokenizer):
        return None, False, False
    cls = type(tokenizer)
    enc = cls.encode is PreTrainedTokenizerBase.encode and cls._encode_plus is TokenizersBackend._encode_plus
    dec = cls.decode is PreTrainedTokenizerBase.decode and cls._decode is TokenizersBackend._decode
    return b, enc, dec


class Codec:
    """``encode(text)`` -> ids (no BOS/EOS) and ``decode(ids, skip_special)`` -> text,
    equal to the HF tokenizer's ``encode(text, add_special_tokens=False)`` and
    ``decode(ids, skip_special_tokens=skip_special)``."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._b, self._enc, self._dec = _backend(tokenizer)

    def direct(self) -> tuple[bool, bool]:
        """Whether encode and decode would go straight to the backend now."""
        return self._encode_direct(), self._decode_direct()

    def _encode_direct(self) -> bool:
        b = self._b
        return (self._enc and b.truncation is None and b.padding is None
                and b.encode_special_tokens == bool(getattr(self.tokenizer, "split_special_tokens", False)))

    def _decode_direct(self) -> bool:
        return self._dec and not getattr(self.tokenizer, "clean_up_tokenization_spaces", False)

    def encode(self, text: str) -> list[int]:
        if self._encode_direct():
            if len(text) > LONG_TEXT:  # the batch call releases the interpreter lock while it works
                return self._b.encode_batch([text], add_special_tokens=False)[0].ids
            return self._b.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        if self._decode_direct():
            return self._b.decode(list(ids), skip_special_tokens=skip_special)
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special))
