"""``mixrl bench moe``: the JSON fields, measured on a small run (the goal itself is the bench's)."""

from __future__ import annotations

import json

from mixrl.lab.bench import moe
from mixrl.lab.bench.cli import BENCHES


def test_bench_moe_json(capsys):
    import argparse

    assert "moe" in BENCHES
    parser = argparse.ArgumentParser()
    moe.configure(parser)
    args = parser.parse_args(["--json", "--prompts", "4", "--new-tokens", "6", "--experts", "4"])
    assert moe.main(args) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out) >= {"routing_diff_frac", "kl_no_replay", "kl_replay", "tokens"}
    assert out["tokens"] == 24 and 0.0 <= out["routing_diff_frac"] <= 1.0
    assert out["kl_no_replay"] >= 0.0 and out["kl_replay"] >= 0.0
    if out["routing_diff_frac"] == 0.0:  # same experts everywhere: replay changes nothing
        assert abs(out["kl_replay"] - out["kl_no_replay"]) < 1e-9
