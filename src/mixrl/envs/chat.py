"""The chat format: how turns become token ids (and nothing is re-tokenized).

With a tokenizer that has the role tokens (the bundled one,
``mixrl.models.tokenizer``), a conversation is

    [<|system|> SYSTEM <|end|>] <|user|> USER <|end|> <|assistant|>   <- prompt()
    REPLY <|end|>                                                      <- generated
    <|tool|> RESULT <|end|> <|assistant|>                              <- tool_result()
    REPLY <|end|>                                                      <- generated
    <|user|> TEXT <|end|> <|assistant|>                                <- user_turn()

so an assistant turn stops at ``end_of_turn_id`` (``<|end|>``), and every
piece an environment appends already ends with the next assistant header:
the runner only ever concatenates ids.

With any other Hugging Face tokenizer (no role tokens) the same layout is
written with plain-text markers (``"\\n<|user|>\\n"`` ...), encoded as text,
and an assistant turn ends with the tokenizer's EOS (``end_of_turn_id ==
eos_id``). Text markers may tokenize differently at a boundary than inside a
longer string; that does not matter here because pieces are encoded once and
concatenated as ids, never decoded and re-encoded.

``ChatFormat`` never raises on odd text: characters outside the vocabulary
become the tokenizer's unknown token.
"""

from __future__ import annotations

from typing import Any

ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>")


class ChatFormat:
    """Chat layout over a tokenizer (bundled role tokens or plain-text markers).

    Attributes:
        tokenizer: the wrapped HF tokenizer.
        native: True when the tokenizer has the role tokens as single ids.
        end_of_turn_id: id that ends an assistant turn (stop id for sampling).
        eos_id: the tokenizer's end-of-sequence id.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        unk = getattr(tokenizer, "unk_token_id", None)
        ids = {}
        for t in ROLE_TOKENS:
            i = tokenizer.convert_tokens_to_ids(t)
            ids[t] = i if isinstance(i, int) and i != unk else None
        self.native = all(v is not None for v in ids.values())
        eos = tokenizer.eos_token_id
        if eos is None and not self.native:
            raise ValueError(
                "ChatFormat: tokenizer has neither the role tokens "
                f"{ROLE_TOKENS} nor an eos_token_id; cannot mark the end of a turn"
            )
        self.eos_id: int = int(eos) if eos is not None else int(ids["<|end|>"])  # type: ignore[arg-type]
        if self.native:
            self._role = {k: [int(v)] for k, v in ids.items()}  # type: ignore[arg-type]
            self.end_of_turn_id: int = int(ids["<|end|>"])  # type: ignore[arg-type]
        else:
            # Plain-text markers; a turn ends with EOS so sampling stops there.
            self._role = {
                t: self.encode(f"\n{t}\n") for t in ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")
            }
            self._role["<|end|>"] = [self.eos_id]
            self.end_of_turn_id = self.eos_id

    # -- text <-> ids -----------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without BOS/EOS."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        """Text of ``ids`` (role tokens kept unless ``skip_special``)."""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special))

    # -- turns ------------------------------------------------------------------------
    def _turn(self, role: str, text: str) -> list[int]:
        return self._role[role] + self.encode(text) + self._role["<|end|>"]

    @property
    def assistant_header(self) -> list[int]:
        return list(self._role["<|assistant|>"])

    def prompt(self, user: str, system: str | None = None) -> list[int]:
        """The initial tokens: optional system turn, the user turn, the assistant header."""
        ids = self._turn("<|system|>", system) if system else []
        return ids + self._turn("<|user|>", user) + self.assistant_header

    def tool_result(self, text: str) -> list[int]:
        """A tool turn followed by the next assistant header; the output is untrusted text
        (``envs/untrusted.py``: a tool that prints ``<|end|>`` cannot end the turn)."""
        from mixrl.envs.untrusted import encode_untrusted

        body = encode_untrusted(self.tokenizer, text)
        return self._role["<|tool|>"] + body + self._role["<|end|>"] + self.assistant_header

    def user_turn(self, text: str) -> list[int]:
        """A user turn followed by the next assistant header."""
        return self._turn("<|user|>", text) + self.assistant_header

    def assistant(self, text: str) -> list[int]:
        """A whole assistant reply (text + end of turn): what a demonstration writes."""
        return self.encode(text) + [self.end_of_turn_id]

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Ids that end an assistant turn: the end-of-turn id (and EOS if different)."""
        return tuple(dict.fromkeys((self.end_of_turn_id, self.eos_id)))

    def reply_text(self, generated: list[int]) -> str:
        """Text of a generated turn without its trailing stop id (special tokens dropped)."""
        ids = list(generated)
        while ids and ids[-1] in self.stop_ids:
            ids.pop()
        return self.decode(ids, skip_special=True)
