"""The real-model example's paired held-out gain: its statistics against brute force, and the
committed artifact recomputed from the committed per-row evaluations."""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("paired_gain", ROOT / "examples/real_model/paired_gain.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_statistics_against_brute_force():
    pg = _module()
    base = {f"r{i}": float(v) for i, v in enumerate([0, 0, 1, 1, 0, 0, 1, 0, 0, 0, 1, 0])}
    final = {f"r{i}": float(v) for i, v in enumerate([1, 0, 1, 0, 1, 1, 1, 0, 1, 0, 1, 1])}
    out = pg.paired_gain(base, final, draws=4000)
    d = [final[r] - base[r] for r in base]
    n = len(d)
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    assert out["gain"] == pytest.approx(mean, abs=1e-12)
    half = 2.200985160082949 * sd / math.sqrt(n)  # t_{0.975, 11}
    assert out["paired_t"]["lo"] == pytest.approx(mean - half, abs=1e-9)
    assert out["paired_t"]["hi"] == pytest.approx(mean + half, abs=1e-9)
    up, down = out["discordant"]["trained_only"], out["discordant"]["base_only"]
    assert (up, down) == (5, 1)
    # McNemar exact: two-sided binomial p of 5 of 6 discordant rows under p = 1/2, by enumeration
    m = up + down
    probs = [math.comb(m, k) / 2**m for k in range(m + 1)]
    p = sum(q for q in probs if q <= probs[up] * (1 + 1e-9))
    assert out["mcnemar_exact_p"] == pytest.approx(p, abs=1e-12)
    # the bootstrap interval brackets the estimate and lies within the range of possible means
    lo, hi = out["paired_bootstrap"]["lo"], out["paired_bootstrap"]["hi"]
    assert min(d) <= lo < mean < hi <= max(d)
    # with every row agreeing there is nothing to bootstrap: a zero-width interval at the gain
    same = pg.paired_gain(base, base, draws=100)
    assert same["gain"] == 0 and same["paired_bootstrap"]["lo"] == same["paired_bootstrap"]["hi"] == 0
    assert same["mcnemar_exact_p"] == 1.0
    with pytest.raises(ValueError, match="same held-out rows"):
        pg.paired_gain(base, dict(itertools.islice(final.items(), 5)))


def test_committed_artifact_is_recomputed_from_the_committed_evaluations():
    pg = _module()
    art = ROOT / "docs/artifacts"
    base = json.loads((art / "eval_real_base.json").read_text())
    final = json.loads((art / "eval_real_final.json").read_text())
    got = pg.paired_gain(pg.per_row(base), pg.per_row(final))
    kept = json.loads((art / "real_model_paired.json").read_text())
    for key in ("rows", "gain", "paired_t", "paired_bootstrap", "discordant", "mcnemar_exact_p", "per_row"):
        assert got[key] == kept[key], key
    assert got["base_pass@1"] == base["result"]["pass@1"] and got["final_pass@1"] == final["result"]["pass@1"]
