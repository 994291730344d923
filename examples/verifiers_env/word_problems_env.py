"""A verifiers environment (the classic `load_environment` API): word problems, exact-match rubric.

Run by mixrl unchanged:  mixrl train examples/verifiers_env/config.toml
"""

import re
from pathlib import Path

import verifiers as vf
from datasets import load_dataset

DATA = Path(__file__).resolve().parent.parent / "word_problems" / "data"


def exact_answer(completion, answer, **kwargs) -> float:
    """1.0 when the last reply's <answer>...</answer> is the row's answer."""
    text = completion[-1]["content"] if isinstance(completion, list) else str(completion)
    found = re.search(r"<answer>(.*?)</answer>", text or "")
    return 1.0 if found and found.group(1).strip() == str(answer) else 0.0


def load_environment(num_train: int = -1, system_prompt: str | None = None) -> vf.Environment:
    ds = load_dataset("json", data_files={"train": str(DATA / "train.jsonl"), "test": str(DATA / "test.jsonl")})
    train, test = (d.rename_column("prompt", "question") for d in (ds["train"], ds["test"]))
    if num_train > 0:
        train = train.select(range(min(num_train, len(train))))
    return vf.SingleTurnEnv(dataset=train, eval_dataset=test, rubric=vf.Rubric(funcs=[exact_answer]),
                            system_prompt=system_prompt)
