"""Generate the real-model example's data: data/train.jsonl and data/test.jsonl.

    python examples/real_model/make_data.py      # rewrites the two files (deterministic)

Each row is a one-step arithmetic question, its integer answer and its skill:

    {"prompt": "What is 7 + 5? Give the final answer as a number.", "answer": "12", "skill": "a+b"}

The skills are chosen so that SmolLM2-135M-Instruct (the pretrained model of
this example) solves some but not all of them at the start: it adds and
multiplies small numbers about one time in five at temperature 1 (it
answers at length and often wrongly), so its held-out pass@1 starts in
[0.1, 0.6] and RL has room to move it. Train and test never share a question.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SUFFIX = " Give the final answer as a number."
N = range(1, 13)  # operands 1..12: the school tables


def questions() -> list[dict[str, str]]:
    """Every question: a + b, a - b (b < a) and a * b (2..12) over the operands, 331 in all."""
    out = []
    for a in N:
        for b in N:
            out.append({"e": f"{a} + {b}", "answer": str(a + b), "skill": "a+b"})
            if b < a:
                out.append({"e": f"{a} - {b}", "answer": str(a - b), "skill": "a-b"})
            if a > 1 and b > 1:
                out.append({"e": f"{a} * {b}", "answer": str(a * b), "skill": "a*b"})
    return [{"prompt": f"What is {q.pop('e')}?{SUFFIX}", **q} for q in out]


def main(out: Path | None = None, n_test: int = 150, seed: int = 0) -> None:
    """Write ``train.jsonl`` (the rest) and ``test.jsonl`` (``n_test`` rows) to ``out``."""
    items = questions()
    random.Random(seed).shuffle(items)
    items = items[n_test:] + items[:n_test]
    n_train = len(items) - n_test
    out = Path(__file__).resolve().parent / "data" if out is None else out
    out.mkdir(exist_ok=True)
    for name, part in (("train", items[:n_train]), ("test", items[n_train:])):
        with open(out / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)
        print(f"{out / name}.jsonl: {len(part)} rows")


if __name__ == "__main__":
    main()
