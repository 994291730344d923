"""Generate the arithmetic example: data/train.jsonl and data/test.jsonl.

    python examples/arithmetic/make_data.py      # rewrites the two files (deterministic)

Each row is a three-number mental-arithmetic question with an integer answer
and the row's skill (the pattern of its operators), for instance

    {"prompt": "What is 38*4+17?", "answer": "169", "skill": "a*b+c"}

The questions use the phrasings the bundled policy was warm-started on
("What is ...?", "Compute ....", "... = ?"): a model this small (408k
parameters) cannot read other phrasings or surrounding text at all. Three
numbers are harder for it than two (it copies them into its calculator call
less reliably and often answers without the calculator), which leaves room
for RL on this data. Train and test never share an expression.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

PHRASINGS = ("What is {e}?", "Compute {e}.", "{e} = ?")
OPS = "+-*"


def question(rng: random.Random) -> dict[str, str]:
    """One row: three numbers in 2..99, two operators of + - *, at most one *."""
    a, b, c = (rng.randint(2, 99) for _ in range(3))
    o1, o2 = rng.choice(OPS), rng.choice(OPS)
    if o1 == o2 == "*":
        o2 = rng.choice("+-")
    expr = f"{a}{o1}{b}{o2}{c}"
    value = eval(expr)  # noqa: S307 - our own digits and + - *
    return {"prompt": rng.choice(PHRASINGS).format(e=expr), "answer": str(value), "skill": f"a{o1}b{o2}c",
            "expr": expr}


def main(out: Path | None = None, n_train: int = 4000, n_test: int = 1000, seed: int = 0) -> None:
    """Write ``train.jsonl`` and ``test.jsonl`` to ``out`` (default: ``data/`` beside this file)."""
    rng = random.Random(seed)
    rows: dict[str, dict[str, str]] = {}
    while len(rows) < n_train + n_test:
        r = question(rng)
        rows.setdefault(r.pop("expr"), r)
    items = list(rows.values())
    out = Path(__file__).resolve().parent / "data" if out is None else out
    out.mkdir(exist_ok=True)
    for name, part in (("train", items[:n_train]), ("test", items[n_train:])):
        with open(out / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)
        print(f"{out / name}.jsonl: {len(part)} rows")


if __name__ == "__main__":
    main()
