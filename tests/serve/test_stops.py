"""Stop strings found incrementally equal re-decoding the growing text after every token.

The tokenizer is a byte-level BPE trained here with the ``tokenizers`` library on
text with multi-byte characters, so replies hold characters whose bytes span
several tokens and tokens that hold the end of one character and the start of
the next; the random replies are random id sequences, so some are not even
valid UTF-8.
"""

from __future__ import annotations

import random

import pytest

from mixrl.serve.stops import StopScanner, cut

CORPUS = ["héllo wörld, 日本語のテキスト ünd émojis 🙂🙃 mixed with ascii a+b=5\nc", "naïve café — déjà vu ½ ¾ ∑ ∫"]


@pytest.fixture(scope="module")
def byte_bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|end|>"])
    tok.train_from_iterator(CORPUS * 50, trainer)
    return tok


def _reference(ids: list[int], stops: list[str], decode) -> tuple[list[int], str, bool]:
    """Brute force: decode the growing text after every token; at the first that holds a stop string,
    cut at its earliest start and keep the ids up to the first whose text reaches past it."""
    for j in range(1, len(ids) + 1):
        text = decode(ids[:j])
        found = [text.find(s) for s in stops if s in text]
        if found:
            at = min(found)
            keep = next(i for i in range(1, j + 1) if len(decode(ids[:i])) > at)
            return ids[:keep], text[:at], True
    return ids, decode(ids), False


def test_incremental_stops_equal_the_brute_force_reference(byte_bpe) -> None:
    rng = random.Random(0)
    decode = lambda ids: byte_bpe.decode(ids, skip_special_tokens=True)  # noqa: E731
    vocab = byte_bpe.get_vocab_size()
    text = "".join(CORPUS)
    cases = hits = spanning = partial = 0
    for _ in range(600):
        if rng.random() < 0.7:  # a real text: stop strings that occur in it, across token boundaries
            a = rng.randrange(len(text) - 20)
            reply = text[a:a + rng.randrange(5, 60)]
            ids = byte_bpe.encode(reply).ids
        else:  # random ids: invalid UTF-8, partial characters, the special token mid-reply
            ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        full = decode(ids)
        stops = []
        for _ in range(rng.randrange(1, 5)):
            if full and rng.random() < 0.8:
                a = rng.randrange(len(full))
                stops.append(full[a:a + rng.randrange(1, 6)])
            else:
                stops.append(rng.choice(["é", "日本", "🙃", "\n", "zz", "a+b", "ö"]))
        stops = [s for s in stops if s and "\ufffd" not in s] or ["\n"]
        got, want = cut(ids, stops, decode), _reference(ids, stops, decode)
        assert got == want, (ids, stops)
        cases += 1
        hits += want[2]
        if want[2]:
            kept = decode(got[0])
            spanning += not any(kept[len(want[1]):].startswith(s) for s in stops)  # the stop ends in later tokens
            partial += kept.endswith("\ufffd")  # the kept token holds part of the stop's first character
    print(cases, hits, spanning, partial)
    assert cases == 600 and hits > 300 and spanning > 50 and partial > 5


def test_scanner_reads_each_token_once_and_searches_a_bounded_window() -> None:
    """A 2,000-token reply with the stop at its end: linear work (a counting decode)."""
    calls, chars = [0], [0]

    def decode(ids: list[int]) -> str:
        calls[0] += 1
        chars[0] += len(ids)
        return "".join(chr(97 + i % 26) if i >= 0 else "!" for i in ids)

    ids = list(range(2000)) + [-1]
    scanner = StopScanner(["!", "zzzzz", "xyzab"], decode)
    at = None
    for t in ids:
        at = scanner.feed(t)
    assert at == 2000 and scanner.kept(at) == 2001 and scanner.text()[:at] == decode(ids[:-1])
    assert calls[0] <= 2 * len(ids) + 1 and chars[0] <= 4 * len(ids)  # not the n^2/2 = 2e6 of re-decoding
    assert len(scanner.tail) == 4
