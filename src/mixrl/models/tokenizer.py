"""The bundled tokenizer: character level over printable ASCII, plus chat tokens.

Built with the ``tokenizers`` library (a BPE model with no merges, i.e. one
token per character) and saved in Hugging Face format (``tokenizer.json`` and
``tokenizer_config.json``), so ``transformers.AutoTokenizer.from_pretrained``
and vLLM load it like any other fast tokenizer.

Vocabulary (ids are stable; 109 in all):

- 0..8: special tokens ``<|pad|>``, ``<|unk|>``, ``<|eos|>`` and the chat
  role tokens ``<|system|>``, ``<|user|>``, ``<|assistant|>``, ``<|tool|>``,
  ``<|end|>`` and ``<|bos|>``;
- 9..12: the task tags ``<calc>``, ``</calc>``, ``<answer>``, ``</answer>``
  as single (non-special) tokens, so tool calls and answers are short and
  the tags survive ``decode(skip_special_tokens=True)``;
- then newline and the 95 printable ASCII characters.

It carries its own Jinja chat template (``CHAT_TEMPLATE``), saved with it, so
conversations are built by ``apply_chat_template`` as for any other model.

Why character level: the bundled tasks are arithmetic and short strings;
one token per character keeps the vocabulary small (a 100-token softmax
makes exact KL and full-support recording cheap) and every string of
printable ASCII encodes without loss. Characters outside the alphabet map to
``<|unk|>`` (the round trip is exact only inside the alphabet).
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|pad|>",
    "<|unk|>",
    "<|eos|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|tool|>",
    "<|end|>",
    "<|bos|>",
)
TAG_TOKENS: tuple[str, ...] = ("<calc>", "</calc>", "<answer>", "</answer>")
ALPHABET: str = "\n" + "".join(chr(c) for c in range(32, 127))  # newline + printable ASCII

assert set(string.printable) - set(ALPHABET) <= set("\t\r\x0b\x0c")


# The chat layout as a Jinja template (what ``mixrl.models.chat`` renders every turn with):
#   [<|system|>SYSTEM[\n\nTools:\n{schema}...]<|end|>] <|user|>USER<|end|> <|assistant|>REPLY<|end|>
#   <|tool|>RESULT<|end|> ... and the generation prompt <|assistant|>.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(rest=messages) -%}"
    "{%- if messages and messages[0].role == 'system' -%}"
    "<|system|>{{ messages[0].content }}"
    "{%- if tools %}{{ '\\n\\n' }}Tools:{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}{% endif -%}"
    "<|end|>{%- set ns.rest = messages[1:] -%}"
    "{%- elif tools -%}"
    "<|system|>Tools:{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}<|end|>"
    "{%- endif -%}"
    "{%- for m in ns.rest -%}"
    "{%- if m.role not in ['system', 'user', 'assistant', 'tool'] -%}"
    "{{ raise_exception('unknown role ' + m.role) }}"
    "{%- endif -%}"
    "<|{{ m.role }}|>{{ m.content }}<|end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


def vocab() -> dict[str, int]:
    """token -> id, in the fixed order documented above."""
    toks = list(SPECIAL_TOKENS) + list(TAG_TOKENS) + list(ALPHABET)
    return {t: i for i, t in enumerate(toks)}


def build_tokenizer() -> Any:
    """Return a ``transformers.PreTrainedTokenizerFast`` over the bundled vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    v = vocab()
    # BPE without merges == one token per character; unknown characters -> <|unk|>.
    # The multi-character entries are in the model vocabulary too, so that
    # registering them as added tokens below keeps their documented ids.
    tok = Tokenizer(models.BPE(vocab=dict(v), merges=[], unk_token="<|unk|>"))
    tok.decoder = decoders.Fuse()  # join characters with no separator
    # Added tokens are matched before the model runs, so "<calc>" is one token.
    tok.add_special_tokens([AddedToken(t, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in TAG_TOKENS])
    got = tok.get_vocab()
    if got != v:  # ids must be exactly the documented ones (checkpoints depend on them)
        raise RuntimeError(f"bundled tokenizer ids differ from the documented vocabulary: {got}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        unk_token="<|unk|>",
        eos_token="<|eos|>",
        bos_token="<|bos|>",
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )


def save_tokenizer(path: str | Path) -> Any:
    """Build the bundled tokenizer and save it in HF format under ``path``."""
    tok = build_tokenizer()
    tok.save_pretrained(str(path))
    return tok


def load_tokenizer(path: str | Path) -> Any:
    """Load any HF tokenizer directory (the bundled one or another)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
