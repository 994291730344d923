"""Multi-turn arithmetic with a calculator tool (family ``"calc"``).

A task asks for the value of an integer expression (``What is 12*7+3?``).
The model may call the calculator any number of times and then answers:

    user:      What is 12*7+3?
    assistant: <calc>12*7+3</calc>          # tool call (the first one in a reply is run)
    tool:      87                            # or "error: ..." for a bad call
    assistant: <answer>87</answer>           # final answer: episode ends

Rules (the shared ones are in ``envs/turns.py``):

- a reply with ``<answer>X</answer>`` ends the episode, status ``ok``, reward 1
  if X is the integer value of the expression, else 0 (an unparsable X is
  simply wrong);
- a reply with ``<calc>EXPR</calc>`` gets the value as tool output; an
  unparsable or failing expression (division by zero, too large, garbage, an
  unclosed tag) gets ``error: <reason>`` as tool output and counts as a
  malformed call;
- a reply with neither gets a user reminder of the format; three such replies
  in a row end with ``format_error`` (reward 0); ``max_turns`` replies without
  an answer end with ``max_turns`` (reward 0); the runner ends an episode
  over its token budget with ``truncated``.

Nothing the model writes raises: the evaluator works on exact rationals with
bounds on length, depth and magnitude. Train and held-out tasks are disjoint
by construction: the split of an expression is a hash of its text.
"""

from __future__ import annotations

import hashlib
import random
import re
from fractions import Fraction

from mixrl.envs.base import Env, StepResult
from mixrl.envs.turns import TurnTracker
from mixrl.models.chat import ChatFormat
from mixrl.records.task import Task

MAX_EXPR_CHARS = 64
MAX_DEPTH = 16
MAX_ABS = 10**15
NUDGE = "Reply with <calc>EXPR</calc> or <answer>N</answer>."
TEMPLATES = ("What is {e}?", "Compute {e}.", "{e} = ?")
_CALL = re.compile(r"<calc>(.*?)</calc>", re.S)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


class CalcError(ValueError):
    """A bad expression; the message is what the tool answers."""


def evaluate_expr(expr: str) -> Fraction:
    """Value of ``expr`` (integers, ``+ - * /``, parentheses, unary minus).

    Exact rational arithmetic; raises ``CalcError`` with a short reason for
    anything else (too long, bad character, division by zero, |value| > 1e15).
    """
    if len(expr) > MAX_EXPR_CHARS:
        raise CalcError(f"expression longer than {MAX_EXPR_CHARS} characters")
    toks = re.findall(r"\d+|[-+*/()]|\S", expr)
    for t in toks:
        if not (t.isdigit() and t.isascii()) and t not in "+-*/()":
            raise CalcError(f"unexpected character {t!r}")
    pos = 0

    def peek() -> str:
        return toks[pos] if pos < len(toks) else ""

    def take() -> str:
        nonlocal pos
        pos += 1
        return toks[pos - 1]

    def bound(v: Fraction) -> Fraction:
        if abs(v) > MAX_ABS:
            raise CalcError("number too large")
        return v

    def expr_(d: int) -> Fraction:  # expr := term (('+'|'-') term)*
        v = term(d)
        while peek() in ("+", "-"):
            v = bound(v + term(d) if take() == "+" else v - term(d))
        return v

    def term(d: int) -> Fraction:  # term := unary (('*'|'/') unary)*
        v = unary(d)
        while peek() in ("*", "/"):
            if take() == "*":
                v = bound(v * unary(d))
            else:
                r = unary(d)
                if r == 0:
                    raise CalcError("division by zero")
                v = bound(v / r)
        return v

    def unary(d: int) -> Fraction:  # unary := '-' unary | atom
        if d > MAX_DEPTH:
            raise CalcError("expression nested too deeply")
        if peek() == "-":
            take()
            return -unary(d + 1)
        return atom(d)

    def atom(d: int) -> Fraction:  # atom := INT | '(' expr ')'
        t = take() if pos < len(toks) else ""
        if t.isdigit():
            if len(t) > 15:
                raise CalcError("number too large")
            return Fraction(int(t))
        if t == "(":
            v = expr_(d + 1)
            if (take() if pos < len(toks) else "") != ")":
                raise CalcError("missing )")
            return v
        raise CalcError("unexpected end" if not t else f"unexpected {t!r}")

    if not toks:
        raise CalcError("empty expression")
    val = expr_(0)
    if pos != len(toks):
        raise CalcError(f"unexpected {toks[pos]!r}")
    return val


def format_value(v: Fraction) -> str:
    return str(v.numerator) if v.denominator == 1 else f"{v.numerator}/{v.denominator}"


def split_of(key: str) -> str:
    """``"heldout"`` for one key in five (a stable hash), else ``"train"``."""
    return "heldout" if hashlib.sha256(key.encode()).digest()[0] % 5 == 0 else "train"


def random_expr(rng: random.Random) -> str:
    """Two or three operands in 2..99 with ``+ - *``, at most one ``*``."""
    n = rng.choice((2, 2, 3))
    nums = [rng.randint(2, 99) for _ in range(n)]
    ops = [rng.choice("+-*") for _ in range(n - 1)]
    if ops.count("*") > 1:
        ops[rng.randrange(n - 1)] = rng.choice("+-")
    return "".join(f"{a}{o}" for a, o in zip(nums, ops, strict=False)) + str(nums[-1])


def make_task(seed: int, split: str, index: int) -> Task:
    """Task ``index`` of ``split``: deterministic in (seed, split, index)."""
    rng = random.Random(f"calc/{seed}/{split}/{index}")
    while True:  # rejection keeps the splits disjoint (one in five is held out)
        e = random_expr(rng)
        if split_of(e) == split:
            break
    q = rng.choice(TEMPLATES).format(e=e)
    data = {"question": q, "expr": e, "answer": int(evaluate_expr(e))}
    return Task(prompt_id=f"calc/{split}/s{seed}/{index}", family="calc", split=split, data=data)


def parse_int(text: str) -> int | None:
    t = text.strip()
    if not re.fullmatch(r"[-+]?\d{1,18}", t):
        return None
    return int(t)


class CalcEnv(Env):
    """One calc episode; see the module docstring for the rules."""

    def __init__(self, task: Task, chat: ChatFormat, max_turns: int = 4, max_no_tool: int = 3) -> None:
        self.task = task
        self.chat = chat
        self.tracker = TurnTracker(max_turns, max_no_tool)
        self.stop_ids = chat.stop_ids

    async def reset(self) -> list[int]:
        self.tracker = TurnTracker(self.tracker.max_turns, self.tracker.max_no_tool)
        return self.chat.prompt(self.task.data["question"])

    async def step(self, generated: list[int], finish_reason: str) -> StepResult:
        # A turn cut at the length limit gets its end-of-turn token from us (loss_mask 0).
        close = [] if generated and generated[-1] in self.stop_ids else [self.chat.end_of_turn_id]
        text = self.chat.reply_text(generated)
        m = _ANSWER.search(text)
        if m is not None:
            got = parse_int(m.group(1))
            ok = got is not None and got == self.task.data["answer"]
            return StepResult(close, True, 1.0 if ok else 0.0, "ok", info={"answer": m.group(1)[:32]})
        call = _CALL.search(text)
        if call is not None:
            try:
                out, malformed = format_value(evaluate_expr(call.group(1))), False
            except CalcError as e:
                out, malformed = f"error: {e}", True
            reply = self.chat.tool_result(out)
        elif "<calc>" in text or "<answer>" in text:
            tag = "calc" if "<calc>" in text else "answer"
            out, malformed, reply = "", True, self.chat.tool_result(f"error: missing </{tag}>")
        else:
            malformed, reply = False, self.chat.user_turn(NUDGE)
        had_call = call is not None or malformed
        status = self.tracker.on_reply(had_call, malformed)
        if status is not None:
            return StepResult(close, True, 0.0, status, malformed=malformed)
        return StepResult(close + reply, False, malformed=malformed)


def demo_turns(task: Task, rng: random.Random, style: str) -> list[tuple[str, str]]:
    """A demonstration transcript as (role, text) turns after the prompt.

    Roles: ``assistant`` (a reply), ``assistant_guess`` (a reply whose answer
    value is not to be imitated), ``tool`` (tool output), ``user`` (reminder).
    Styles: ``tool`` (call, then answer), ``two_step`` (two calls for three
    operands), ``direct`` (answers at once, right only by luck for a small
    model), ``typo`` (a mistyped call, answers the wrong result), ``recover``
    (a reply without a call, the reminder, then the tool path).
    """
    e, ans = task.data["expr"], task.data["answer"]
    call = [("assistant", f"<calc>{e}</calc>"), ("tool", str(ans))]
    final = [("assistant", f"<answer>{ans}</answer>")]
    if style == "tool":
        return call + final
    if style == "two_step":
        parts = re.findall(r"\d+|[-+*]", e)
        if len(parts) < 5:
            return call + final
        i = 1 if parts[1] == "*" or parts[3] != "*" else 3  # do the product first
        first = "".join(parts[i - 1 : i + 2])
        v = format_value(evaluate_expr(first))
        rest = "".join(parts[: i - 1] + [v] + parts[i + 2 :])
        return [("assistant", f"<calc>{first}</calc>"), ("tool", v), ("assistant", f"<calc>{rest}</calc>"),
                ("tool", str(ans))] + final
    if style == "direct":
        # Answering without the tool. The value is marked as a guess: the warm
        # start learns *when* such replies happen, not digits it cannot compute.
        return [("assistant_guess", f"<answer>{ans}</answer>")]
    if style == "typo":
        bad = list(e)
        j = rng.choice([k for k, c in enumerate(bad) if c.isdigit()])
        bad[j] = str(rng.randint(0, 9))
        b = "".join(bad)
        v = format_value(evaluate_expr(b))
        return [("assistant", f"<calc>{b}</calc>"), ("tool", v), ("assistant", f"<answer>{v}</answer>")]
    if style == "recover":
        return [("assistant", "Let me think."), ("user", NUDGE)] + call + final
    raise ValueError(f"calc.demo_turns: unknown style {style!r}")

