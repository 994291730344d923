"""Generate the word-problem data the agent examples use: data/train.jsonl and data/test.jsonl.

    python examples/word_problems/make_data.py      # rewrites the two files (deterministic)

Each row is a short arithmetic story with an integer answer, for instance

    {"prompt": "What is 23+14? Ava has 23 shells and finds 14 more. How many shells now?",
     "answer": "37", "kind": "more"}

Four kinds of story (more, away, each: a * b, each_more: a * b + c). The
question opens by naming the expression, which is how the bundled policy
(warm-started on "What is 12*7+3?") can read it (placed after the story, the
tiny policy cannot find it: held-out pass@1 0.005); the story after it is new
to the policy, which RL has to learn to ignore.
Train and test stories never share a (kind, numbers) pair.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = ["Ava", "Ben", "Cleo", "Dan", "Eli", "Fay", "Gus", "Ivy", "Jon", "Kim", "Leo", "Mia"]
ITEMS = ["apples", "pens", "shells", "cards", "coins", "books", "stamps", "beads"]
STORIES = {
    "more": ("{n} has {a} {i} and finds {b} more. How many {i} now?", "{a}+{b}"),
    "away": ("{n} has {a} {i} and gives {b} away. How many {i} are left?", "{a}-{b}"),
    "each": ("{n} buys {a} bags with {b} {i} each. How many {i} in all?", "{a}*{b}"),
    "each_more": ("{n} buys {a} bags of {b} {i} and {c} loose {i}. How many {i}?", "{a}*{b}+{c}"),
}


def story(rng: random.Random) -> dict[str, str]:
    kind = rng.choice(sorted(STORIES))
    text, expr = STORIES[kind]
    a, b, c = rng.randint(12, 99), rng.randint(2, 40), rng.randint(2, 30)
    if kind == "away":
        a, b = max(a, b + 2), min(a, b)
    if kind.startswith("each"):
        b = rng.randint(2, 9)
    e = expr.format(a=a, b=b, c=c)
    q = f"What is {e}? " + text.format(n=rng.choice(NAMES), i=rng.choice(ITEMS), a=a, b=b, c=c)
    return {"prompt": q, "answer": str(eval(e)), "kind": kind, "expr": e}  # noqa: S307 - our own digits and +-*


def main(n_train: int = 2000, n_test: int = 200, seed: int = 0) -> None:
    rng = random.Random(seed)
    rows: dict[str, dict[str, str]] = {}
    while len(rows) < n_train + n_test:
        r = story(rng)
        rows.setdefault(f"{r['kind']}:{r['expr']}", r)
    items = list(rows.values())
    out = Path(__file__).resolve().parent / "data"
    out.mkdir(exist_ok=True)
    for name, part in (("train", items[:n_train]), ("test", items[n_train:])):
        with open(out / f"{name}.jsonl", "w") as f:
            for r in part:
                f.write(json.dumps({k: r[k] for k in ("prompt", "answer", "kind")}) + "\n")
        print(f"{out / name}.jsonl: {len(part)} rows")


if __name__ == "__main__":
    main()
