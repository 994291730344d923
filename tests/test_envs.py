"""Chat format, turn rules, the calc and reverse families, the registry."""

from __future__ import annotations

import asyncio
import random

import pytest

from mixrl.envs import calc, reverse, upper
from mixrl.envs.registry import make_env, make_task_source, register_family
from mixrl.envs.turns import TurnTracker
from mixrl.models.chat import ChatFormat
from mixrl.models.tokenizer import ALPHABET, build_tokenizer
from mixrl.records.task import Task


@pytest.fixture(scope="module")
def chat() -> ChatFormat:
    return ChatFormat(build_tokenizer())


def run(coro):
    return asyncio.run(coro)


# -- tokenizer and chat format ----------------------------------------------------------


def test_tokenizer_round_trip_and_ids(chat: ChatFormat) -> None:
    rng = random.Random(0)
    for _ in range(50):
        s = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 40)))
        ids = chat.encode(s)
        assert len(ids) == len(s)  # one token per character
        assert chat.decode(ids) == s
    assert chat.encode("<calc>1+2</calc>") == [9] + chat.encode("1+2") + [10]  # tags: one token each
    assert len(chat.tokenizer) == 109
    assert chat.decode(chat.encode("é")) == "<|unk|>"  # outside the alphabet: unknown, never raises


def test_tokenizer_saved_and_reloaded(tmp_path, chat: ChatFormat) -> None:
    from mixrl.models.tokenizer import load_tokenizer

    chat.tokenizer.save_pretrained(str(tmp_path))
    again = ChatFormat(load_tokenizer(tmp_path))
    s = "<|user|>What is 3*4?<|end|><|assistant|><calc>3*4</calc><|end|>"
    assert again.encode(s) == chat.encode(s)
    assert again.end_of_turn_id == chat.end_of_turn_id == 7


def test_chat_layout(chat: ChatFormat) -> None:
    p = chat.prompt("hi", system="sys")
    assert chat.decode(p) == "<|system|>sys<|end|><|user|>hi<|end|><|assistant|>"
    assert chat.decode(chat.tool_result("42")) == "<|tool|>42<|end|><|assistant|>"
    assert chat.decode(chat.user_turn("go")) == "<|user|>go<|end|><|assistant|>"
    assert chat.assistant("x")[-1] == chat.end_of_turn_id
    assert chat.reply_text(chat.assistant("<answer>5</answer>")) == "<answer>5</answer>"


def test_chat_tokenizer_without_template_is_refused() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from mixrl.models.chat import ChatTemplateError

    v = {chr(i): i - 32 for i in range(32, 127)} | {"\n": 95, "[UNK]": 96, "</s>": 97}
    t = Tokenizer(models.WordLevel(v, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    t.decoder = decoders.Fuse()
    with pytest.raises(ChatTemplateError, match="model.chat_template"):
        ChatFormat(PreTrainedTokenizerFast(tokenizer_object=t, eos_token="</s>", unk_token="[UNK]"))


# -- turn rules ----------------------------------------------------------------------------


def test_turn_tracker_paths() -> None:
    t = TurnTracker(max_turns=10)
    assert t.on_reply(False) is None and t.on_reply(False) is None
    assert t.on_reply(False) == "format_error"
    t = TurnTracker(max_turns=10)
    assert [t.on_reply(False), t.on_reply(True, True), t.on_reply(False), t.on_reply(False)] == [None] * 4
    assert t.num_malformed == 1 and t.no_tool_streak == 2
    t = TurnTracker(max_turns=3)
    assert [t.on_reply(True), t.on_reply(True), t.on_reply(True)] == [None, None, "max_turns"]
    t = TurnTracker(max_turns=3)  # both at once: format_error wins
    assert [t.on_reply(False), t.on_reply(False), t.on_reply(False)] == [None, None, "format_error"]
    with pytest.raises(ValueError, match="max_turns"):
        TurnTracker(0)


# -- calc -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "expr,value",
    [("12*7+3", "87"), ("2-(3*4)", "-10"), ("-5--5", "0"), ("7/2", "7/2"), (" 1 + 2 ", "3"), ("(((4)))", "4")],
)
def test_calc_evaluator(expr: str, value: str) -> None:
    assert calc.format_value(calc.evaluate_expr(expr)) == value


@pytest.mark.parametrize(
    "expr,reason",
    [("1/0", "division by zero"), ("((1)", "missing )"), ("1+", "unexpected end"), ("", "empty"),
     ("é+1", "unexpected character"), ("9" * 16, "too large"), ("99999999*99999999", "too large"),
     ("(" * 20 + "1" + ")" * 20, "too deeply"), ("1" * 70, "longer than"), ("2**3", "unexpected"),
     ("1 2", "unexpected"), ("<|end|>", "unexpected character"), ("１２", "unexpected character")],
)
def test_calc_evaluator_rejects_bad_input(expr: str, reason: str) -> None:
    with pytest.raises(calc.CalcError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        calc.evaluate_expr(expr)


def _task(expr: str = "12*7+3") -> Task:
    return Task("t0", "calc", "train", {"question": f"What is {expr}?", "expr": expr,
                                         "answer": int(calc.evaluate_expr(expr))})


def _step(env, chat: ChatFormat, text: str, stop: bool = True):
    ids = chat.encode(text) + ([chat.end_of_turn_id] if stop else [])
    return run(env.step(ids, "stop" if stop else "length"))


def test_calc_correct_episode(chat: ChatFormat) -> None:
    env = calc.CalcEnv(_task(), chat)
    assert chat.decode(run(env.reset())) == "<|user|>What is 12*7+3?<|end|><|assistant|>"
    s = _step(env, chat, "<calc>12*7+3</calc>")
    assert not s.done and not s.malformed
    assert chat.decode(s.tokens) == "<|tool|>87<|end|><|assistant|>"
    s = _step(env, chat, "<answer>87</answer>")
    assert (s.done, s.reward, s.status, s.tokens) == (True, 1.0, "ok", [])


def test_calc_wrong_and_unparsable_answers_are_zero(chat: ChatFormat) -> None:
    for ans in ("86", "eighty", "", "87.0", "9" * 40):
        env = calc.CalcEnv(_task(), chat)
        run(env.reset())
        s = _step(env, chat, f"<answer>{ans}</answer>")
        assert (s.done, s.reward, s.status) == (True, 0.0, "ok")


def test_calc_malformed_calls_get_error_output(chat: ChatFormat) -> None:
    env = calc.CalcEnv(_task(), chat, max_turns=20)
    run(env.reset())
    for text, msg in [("<calc>1/0</calc>", "division by zero"), ("<calc>12*", "missing </calc>"),
                      ("<calc>abc</calc>", "unexpected character"), ("<answer>5", "missing </answer>"),
                      ("<calc>99999999*99999999</calc>", "too large")]:
        s = _step(env, chat, text)
        assert not s.done and s.malformed
        assert chat.decode(s.tokens).startswith("<|tool|>error: ") and msg in chat.decode(s.tokens)
    assert env.tracker.num_malformed == 5


def test_calc_format_error_after_three_replies_without_call(chat: ChatFormat) -> None:
    env = calc.CalcEnv(_task(), chat)
    run(env.reset())
    s1, s2 = _step(env, chat, "hmm"), _step(env, chat, "<|pad|>zz")
    assert not s1.done and not s2.done and chat.decode(s1.tokens).startswith("<|user|>Reply with")
    s3 = _step(env, chat, "")
    assert (s3.done, s3.reward, s3.status) == (True, 0.0, "format_error")


def test_calc_max_turns(chat: ChatFormat) -> None:
    env = calc.CalcEnv(_task(), chat, max_turns=2)
    run(env.reset())
    assert not _step(env, chat, "<calc>1+1</calc>").done
    s = _step(env, chat, "<calc>2+2</calc>")
    assert (s.done, s.reward, s.status) == (True, 0.0, "max_turns")


def test_calc_length_cut_turn_is_closed_by_env(chat: ChatFormat) -> None:
    env = calc.CalcEnv(_task(), chat)
    run(env.reset())
    s = _step(env, chat, "<calc>12*7+3</calc> and more", stop=False)
    assert s.tokens[0] == chat.end_of_turn_id and chat.decode(s.tokens[1:]).startswith("<|tool|>87")


def test_garbage_never_raises(chat: ChatFormat) -> None:
    rng = random.Random(1)
    vocab = list(range(len(chat.tokenizer)))
    for i in range(300):
        fam = [calc.CalcEnv(_task(), chat, max_turns=3), reverse.ReverseEnv(reverse.make_task(0, "train", i), chat),
               upper.UpperEnv(upper.make_task(0, "train", i), chat)]
        env = fam[i % 3]
        run(env.reset())
        for _ in range(4):
            ids = [rng.choice(vocab) for _ in range(rng.randint(0, 30))]
            if rng.random() < 0.5:  # splice in tags so parsers see odd structure too
                ids = chat.encode(rng.choice(["<calc>", "<answer>", "</calc>", "(", "/0"])) + ids
            s = run(env.step(ids, rng.choice(["stop", "length"])))
            assert s.status in ("", "ok", "format_error", "max_turns")
            if s.done:
                assert s.reward in (0.0, 1.0)
                break


def test_task_generators_are_seeded_and_splits_disjoint() -> None:
    for fam, key in (("calc", "expr"), ("reverse", "word"), ("upper", "word")):
        tr = make_task_source(fam, "train", seed=3)
        ho = make_task_source(fam, "heldout", seed=3)
        train_keys = {tr[i].data[key] for i in range(3000)}
        held_keys = {ho[i].data[key] for i in range(len(ho))}
        assert not train_keys & held_keys
        assert len(held_keys) > 150  # mostly distinct
        assert tr[17] == make_task_source(fam, "train", seed=3)[17]
        assert tr[17] != make_task_source(fam, "train", seed=4)[17]
        assert {t.split for t in (tr[0], ho[0])} == {"train", "heldout"}
    t = make_task_source("calc", "heldout", 0)[5]
    assert t.data["answer"] == int(calc.evaluate_expr(t.data["expr"])) and t.data["expr"] in t.data["question"]


def test_task_source_cursor_save_restore() -> None:
    a = make_task_source("mix", "train", seed=0)
    first = [a.next() for _ in range(5)]
    assert [t.family for t in first] == ["calc", "upper", "calc", "upper", "calc"]
    state = a.state_dict()
    nxt = [a.next() for _ in range(3)]
    b = make_task_source("mix", "train", seed=0)
    b.load_state_dict(state)
    assert [b.next() for _ in range(3)] == nxt
    with pytest.raises(ValueError, match="seed"):
        make_task_source("mix", "train", seed=1).load_state_dict(state)
    ho = make_task_source("calc", "heldout", 0, size=3)
    assert len(list(ho)) == 3 and len(list(ho)) == 0  # finite, and the cursor advanced
    with pytest.raises(ValueError, match="unknown task family 'nope'"):
        make_task_source("nope", "train")
    with pytest.raises(ValueError, match="split"):
        make_task_source("calc", "test")


def test_registry_make_env_and_hook(chat: ChatFormat) -> None:
    t = make_task_source("calc", "train", 0)[0]
    env = make_env(t, chat, max_turns=7, unrelated_key=1)
    assert isinstance(env, calc.CalcEnv) and env.tracker.max_turns == 7
    assert isinstance(make_env(make_task_source("reverse", "train", 0)[0], chat, max_turns=7), reverse.ReverseEnv)

    def mk(seed: int, split: str, i: int) -> Task:
        return Task(f"echo/{split}/{i}", "echo", split, {"question": "q", "word": "x", "answer": "x"})

    register_family("echo", mk, reverse.ReverseEnv, heldout_size=4)
    assert len(make_task_source("echo", "heldout", 0)) == 4
    assert isinstance(make_env(make_task_source("echo", "train", 0)[1], chat), reverse.ReverseEnv)


def test_reverse_env(chat: ChatFormat) -> None:
    t = reverse.make_task(0, "train", 0)
    env = reverse.ReverseEnv(t, chat)
    run(env.reset())
    s = _step(env, chat, f"<answer>{t.data['answer']}</answer>")
    assert (s.done, s.reward, s.status) == (True, 1.0, "ok")
    s = _step(env, chat, f"<answer>{t.data['word']}x</answer>")
    assert (s.done, s.reward, s.status) == (True, 0.0, "ok")
    s = _step(env, chat, t.data["answer"])
    assert (s.done, s.reward, s.status) == (True, 0.0, "format_error")


def test_upper_env(chat: ChatFormat) -> None:
    t = upper.make_task(0, "heldout", 3)
    assert t.data["answer"] == t.data["word"].upper() and t.split == "heldout"
    env = upper.UpperEnv(t, chat)
    assert chat.decode(run(env.reset())) == f"<|user|>Uppercase: {t.data['word']}<|end|><|assistant|>"
    s = _step(env, chat, f"<answer>{t.data['answer']}</answer>")
    assert (s.done, s.reward, s.status) == (True, 1.0, "ok")
    s = _step(env, chat, f"<answer>{t.data['word']}</answer>")
    assert (s.done, s.reward, s.status) == (True, 0.0, "ok")
    s = _step(env, chat, f"<answer>{t.data['answer']}", stop=False)
    assert (s.done, s.reward, s.status, s.tokens) == (True, 0.0, "format_error", [chat.end_of_turn_id])
    demo = upper.demo_turns(t, random.Random(0), "slip")[0][1]
    assert demo != f"<answer>{t.data['answer']}</answer>" and demo.upper() == f"<answer>{t.data['answer']}</answer>".upper()


def test_demonstrations_follow_the_env(chat: ChatFormat) -> None:
    """Replaying a correct demo through the env gives exactly its tokens and reward 1."""
    rng = random.Random(0)
    for i in range(40):
        t = calc.make_task(0, "train", i)
        for style in ("tool", "two_step", "recover"):
            env = calc.CalcEnv(t, chat)
            toks = run(env.reset())
            turns = calc.demo_turns(t, rng, style)
            for role, text in turns:
                if role != "assistant":
                    continue
                s = run(env.step(chat.assistant(text), "stop"))
                if s.done:
                    assert (s.reward, s.status) == (1.0, "ok")
                else:
                    nxt = turns[turns.index((role, text)) + 1]
                    assert chat.decode(s.tokens) == chat.decode(
                        chat.tool_result(nxt[1]) if nxt[0] == "tool" else chat.user_turn(nxt[1]))
            assert s.done
            del toks
