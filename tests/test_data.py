"""mixrl.data: every input form through HF datasets, epochs, the cursor across a resume."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mixrl.config import build_config
from mixrl.data import DataError, DatasetSource, load_rows, open_split

ROWS = [{"prompt": f"What is {i}+1?", "answer": str(i + 1), "level": i % 3} for i in range(10)]


def _jsonl(path: Path, rows: list[dict[str, Any]] = ROWS) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_every_form_reads_the_same_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets
    import huggingface_hub.constants

    ds = datasets.Dataset.from_list(ROWS)
    (tmp_path / "d.json").write_text(json.dumps(ROWS))
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.to_csv(str(tmp_path / "d.csv"), index=False)
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": ds, "test": ds.select(range(3))}).save_to_disk(str(tmp_path / "saved_dict"))
    # a hub dataset as `hf download --repo-type dataset user/toy` leaves it in the hub cache
    repo = tmp_path / "hub" / "datasets--user--toy"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    snap = repo / "snapshots" / ("0" * 40) / "data"
    snap.mkdir(parents=True)
    _jsonl(snap / "train.jsonl")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))

    forms = [str(_jsonl(tmp_path / "d.jsonl")), str(tmp_path / "d.json"), str(tmp_path / "d.parquet"),
             str(tmp_path / "d.csv"), str(tmp_path / "saved"), str(tmp_path / "saved_dict"), "user/toy"]
    for spec in forms:
        rows = load_rows(spec)
        assert [r["prompt"] for r in rows] == [r["prompt"] for r in ROWS], spec
        assert [str(r["answer"]) for r in rows] == [r["answer"] for r in ROWS], spec
    assert len(load_rows(str(tmp_path / "saved_dict"), split="test")) == 3
    with pytest.raises(DataError, match="no split 'dev'"):
        load_rows(str(tmp_path / "saved_dict"), split="dev")
    with pytest.raises(DataError, match="not a dataset in the local Hugging Face cache"):
        load_rows("user/not-cached")  # offline: fails at once, never downloads
    with pytest.raises(DataError, match="no such file"):
        load_rows("missing/train.jsonl")


def test_epochs_shuffle_per_epoch_and_cover_every_row(tmp_path: Path) -> None:
    rows = load_rows(str(_jsonl(tmp_path / "t.jsonl")))
    src = DatasetSource(rows, "train", seed=3, family="dataset")
    seen = [src.next() for _ in range(30)]  # three epochs
    epochs = [[t.data["_row"] for t in seen[i * 10:(i + 1) * 10]] for i in range(3)]
    assert all(sorted(e) == list(range(10)) for e in epochs)  # each epoch visits every row once
    assert epochs[0] != epochs[1] != epochs[2]  # a new order each epoch
    assert len({t.prompt_id for t in seen}) == 30  # unique across epochs
    again = DatasetSource(rows, "train", seed=3, family="dataset")
    assert [again.next().data["_row"] for _ in range(30)] == sum(epochs, [])  # seeded
    other = DatasetSource(rows, "train", seed=4, family="dataset")
    assert [other.next().data["_row"] for _ in range(10)] != epochs[0]
    t = seen[0]
    assert t.data["answer"] == ROWS[t.data["_row"]]["answer"] and t.data["level"] == ROWS[t.data["_row"]]["level"]


def test_cursor_resume_neither_skips_nor_repeats(tmp_path: Path) -> None:
    rows = load_rows(str(_jsonl(tmp_path / "t.jsonl")))
    straight = DatasetSource(rows, "train", seed=0, family="dataset")
    want = [straight.next().prompt_id for _ in range(25)]
    first = DatasetSource(rows, "train", seed=0, family="dataset", digest="x")
    got = [first.next().prompt_id for _ in range(13)]
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
    second = DatasetSource(rows, "train", seed=0, family="dataset", digest="x")
    second.load_state_dict(state)
    got += [second.next().prompt_id for _ in range(12)]
    assert got == want
    changed = DatasetSource(rows.select(range(9)), "train", seed=0, family="dataset", digest="y")
    with pytest.raises(DataError, match="dataset changed"):
        changed.load_state_dict(state)


def test_heldout_fraction_is_a_stable_disjoint_split(tmp_path: Path) -> None:
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(40)]
    cfg = build_config({"data": {"train": str(_jsonl(tmp_path / "t.jsonl", rows)), "heldout_fraction": 0.25}})
    tr = open_split(cfg.data, "train", 0, "dataset", split_seed=7)
    ho = open_split(cfg.data, "heldout", 99, "dataset", split_seed=7)
    a = {tr[i].data["prompt"] for i in range(len(tr))}
    b = {ho[i].data["prompt"] for i in range(len(ho))}
    assert len(b) == 10 and len(a) == 30 and not a & b
    again = open_split(cfg.data, "heldout", 5, "dataset", split_seed=7)  # the eval seed does not move it
    assert {again[i].data["prompt"] for i in range(len(again))} == b


def test_prompt_column_checks(tmp_path: Path) -> None:
    rows = load_rows(str(_jsonl(tmp_path / "t.jsonl")))
    with pytest.raises(DataError, match="prompt_key: column 'question'"):
        DatasetSource(rows, "train", 0, family="dataset", prompt_key="question")
    chat = [{"prompt": [{"role": "user", "content": "hi"}], "answer": "x"}]
    src = DatasetSource(load_rows(str(_jsonl(tmp_path / "c.jsonl", chat))), "heldout", 0, family="dataset")
    assert src[0].data["prompt"][0]["content"] == "hi"
    bad = DatasetSource(load_rows(str(_jsonl(tmp_path / "b.jsonl", [{"prompt": "", "answer": "x"}]))),
                        "heldout", 0, family="dataset")
    with pytest.raises(DataError, match="non-empty string"):
        bad[0]
