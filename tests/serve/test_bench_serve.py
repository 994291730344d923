"""``mixrl bench serve``: interleaved arms, medians from every round, the same tokens in every arm."""

from __future__ import annotations

import argparse
import json
import statistics

import pytest


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    from mixrl.lab.bench import serve

    parser = argparse.ArgumentParser()
    serve.configure(parser)
    code = serve.main(parser.parse_args(list(argv)))
    r = capsys.readouterr()
    return code, r.out if code == 0 else r.err  # the result on stdout, a usage error on stderr


@pytest.mark.parametrize("workers", ["process", "thread"])
def test_arms_interleave_and_the_ratio_is_of_the_medians(capsys: pytest.CaptureFixture[str], workers: str) -> None:
    code, out = _run(capsys, "--sessions", "3", "--turns", "2", "--max-tokens", "4", "--long-model", "none",
                     "--repeats", "2", "--workers", workers, "--json")
    assert code == 0
    res = json.loads(out)
    assert res["workers"] == workers
    runs = res["runs"]
    assert {k: len(v) for k, v in runs.items()} == {"direct": 2, "endpoint": 2, "openai_client": 2}
    # seeded requests: every arm and round generated the same tokens, through one server session each
    assert res["same_tokens"] and len({r["generated_tokens"] for rs in runs.values() for r in rs}) == 1
    assert all(r["history_rewrites"] == 0 for r in runs["endpoint"] + runs["openai_client"])
    med = {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in runs.items()}
    assert res["endpoint_over_direct"] == round(med["endpoint"] / med["direct"], 3)
    assert res["pair_ratios"] == [round(e["tokens_per_s"] / d["tokens_per_s"], 3)
                                  for d, e in zip(runs["direct"], runs["endpoint"], strict=True)]
    assert res["pair_ratio_median"] == statistics.median(res["pair_ratios"])
    assert res["pair_ratio_ci95"] is None  # 2 rounds cannot give a 95% interval of their median
    assert res["direct"]["tokens_per_s_range"] == sorted(r["tokens_per_s"] for r in runs["direct"])
    # the headline load is a lean HTTP client; the openai client's figures are reported beside it
    assert res["client"].split()[0] in ("aiohttp", "httpx") and res["client"].endswith("separate process")
    assert res["openai_client"]["client"].startswith("openai ")
    assert res["openai_client"]["client_cpu_ms_per_request"] > 0 and res["client_cpu_ms_per_request"] > 0
    # the server's CPU over the timed load only: 6 requests per round, each engine step counted
    assert all(0 < r["serve_cpu_s"] < r["process_cpu_s"] for r in runs["endpoint"])
    assert all(r["engine_steps"] > 0 and r["engine_batches"] > 0 for rs in runs.values() for r in rs)
    if workers == "process":  # the engine's CPU is the worker's, apart from this process's
        assert all(r["engine_cpu_s"] > 0 for rs in runs.values() for r in rs)
        assert res["engine_cpu_over_direct"] == round(res["endpoint"]["engine_cpu_s"] / res["direct"]["engine_cpu_s"], 3)
    else:
        assert res["engine_cpu_over_direct"] is None and "engine_cpu_s" not in runs["direct"][0]
    assert len(res["load_avg_1m"]) == 2


def test_bad_repeats_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _run(capsys, "--repeats", "0", "--long-model", "none")
    assert code == 2 and "--repeats must be >= 1" in out
    code, out = _run(capsys, "--long-repeats", "0")
    assert code == 2 and "--long-repeats must be >= 1" in out
