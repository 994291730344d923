"""``mixrl bench loss`` at tiny sizes: the JSON keys, sane values, the dispatcher."""

from __future__ import annotations

import json

import torch

from mixrl.commands import main as cli
from mixrl.lab.bench import cli as bench_cli
from mixrl.lab.bench.loss import nucleus

KEYS = ("T", "V", "d", "naive_peak_mb", "chunked_peak_mb", "naive_s", "chunked_s",
        "grpo_loss_s", "sc_mis_topp_loss_s")


def test_bench_loss_json_keys(capsys):
    rc = cli.main(["bench", "loss", "--json", "--T", "48", "--V", "96", "--d", "8",
                   "--repeats", "1", "--chunk-size", "16", "--support", "8"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for k in KEYS:
        assert k in res, k
    assert (res["T"], res["V"], res["d"]) == (48, 96, 8)
    for k in KEYS[3:]:
        assert res[k] >= 0.0 and res[k] == res[k], (k, res[k])
    for k in KEYS[5:]:
        assert res[k] > 0.0, k
    assert 1.0 <= res["support_mean"] <= 96


def test_nucleus_matches_sorted_cumsum():
    torch.manual_seed(0)
    z = torch.randn(20, 50) * 3
    idx, sizes = nucleus(z, 0.9, 50)
    for r in range(20):
        p = torch.softmax(z[r], 0).sort(descending=True).values
        k = int((p.cumsum(0) < 0.9).sum()) + 1  # smallest prefix with mass >= 0.9
        assert int(sizes[r]) == k
        assert torch.equal(idx[r, :k], z[r].argsort(descending=True)[:k])


def test_bench_dispatch_missing_module(monkeypatch, capsys):
    monkeypatch.setitem(bench_cli.BENCHES, "ghost", ("mixrl.lab.bench.no_such_module", "absent"))
    import argparse

    rc = bench_cli.main(argparse.Namespace(bench="ghost", rest=[]))
    assert rc == 2
    assert "mixrl.lab.bench.no_such_module" in capsys.readouterr().err


def test_bench_without_name_explains(capsys):
    assert cli.main(["bench"]) == 2
    assert "choose a benchmark" in capsys.readouterr().err
