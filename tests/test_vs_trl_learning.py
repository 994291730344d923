"""mixrl.lab.bench.vs_trl_learning: arguments and the summary on synthetic per-row data (no training)."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("trl")

from mixrl.lab.bench import vs_trl_learning as vs  # noqa: E402


def test_parse_args_defaults() -> None:
    a = vs.parse_args([])
    assert a.out == "docs/artifacts/real_learn/trl" and a.steps == 60 and not a.no_eval
    assert not a.model_dir.startswith(str(vs.ROOT))  # the merged model stays out of the repo
    assert vs.parse_args(["--steps", "2", "--no-eval"]).steps == 2


def _eval(rates: dict[str, int], k: int = 4) -> dict:
    return {"pass@1": sum(rates.values()) / (k * len(rates)), "k": k,
            "per_task": {r: [k, s] for r, s in rates.items()}}


def test_summary_paired_gain_matches_brute_force() -> None:
    rng = random.Random(0)
    rows = [f"heldout-{i}" for i in range(40)]
    base, mixrl, trl = ({r: rng.randint(0, 4) for r in rows} for _ in range(3))
    out = vs.summarize(_eval(base), _eval(mixrl), _eval(trl), {"extra": 1})
    assert out["rows"] == 40 and out["extra"] == 1
    for key, (x, y) in {"trl_minus_mixrl": (mixrl, trl), "mixrl_minus_base": (base, mixrl),
                        "trl_minus_base": (base, trl)}.items():
        brute = sum(float(y[r]) / 4.0 - float(x[r]) / 4.0 for r in rows) / len(rows)
        g = out[key]
        assert g["gain"] == pytest.approx(brute, abs=1e-12)
        assert g["paired_t"]["lo"] <= brute <= g["paired_t"]["hi"]
        assert g["paired_bootstrap"]["lo"] <= brute <= g["paired_bootstrap"]["hi"]
    assert out["pass@1"]["trl"] == pytest.approx(sum(trl.values()) / 160)
    assert {p["row"] for p in out["per_row"]} == set(rows)


def test_side_info_keeps_unknown_memory_null() -> None:
    info = vs.side_info({"wall_s": 1.0, "peak_rss_gb": 2.0, "version": "x", "steps": 60, "defaults": {}})
    assert info["peak_memory_gb"]["mixrl"] is None and info["peak_memory_gb"]["mixrl_reason"]
    assert info["wall_s"]["trl"] == 1.0 and info["wall_s"]["mixrl"] > 0
