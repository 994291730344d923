"""``mixrl bench serve --hostile``: every attacker gets its answer, no session leaks, the
figures are those of the rounds run."""

from __future__ import annotations

import argparse
import json

import pytest


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    from mixrl.lab.bench import serve

    parser = argparse.ArgumentParser()
    serve.configure(parser)
    code = serve.main(parser.parse_args(list(argv)))
    r = capsys.readouterr()
    return code, r.out if code == 0 else r.err  # the result on stdout, a usage error on stderr


def test_hostile_round_reports_latency_rss_and_no_leaked_session(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _run(capsys, "--hostile", "--sessions", "3", "--turns", "2", "--max-tokens", "4",
                     "--long-model", "none", "--hostile-rounds", "1", "--attack-seconds", "2", "--json")
    assert code == 0
    res = json.loads(out)
    assert {k: res[k]["requests"] for k in ("quiet", "long_replies", "hostile")} == {
        "quiet": 6, "long_replies": 6, "hostile": 6}
    assert res["p99_hostile_over_quiet"] == round(res["hostile"]["p99_ms"] / res["quiet"]["p99_ms"], 3)
    # the warm-up's named conversations are kept; nothing else is
    assert res["leaked_sessions"] == 0 and res["sessions_kept"] == 3
    att = res["attackers"]
    assert att.get("slow_body:abandoned", 0) + att.get("slow_body:closed", 0) == 16 and att["bytes_sent"] > 0
    for kind in ("past_context", "one_mib_text", "empty_stop", "bad_n", "bad_role", "not_json"):
        assert att.get(f"{kind}:400", 0) >= 1, kind  # refused, never a 500
    assert not any(k.endswith(":500") or k.endswith(":503") for k in att)
    for m in ("rss", "anon"):
        assert res[f"{m}_before_mb"] > 0 and abs(
            res[f"{m}_after_over_before"] - res[f"{m}_after_mb"] / res[f"{m}_before_mb"]) < 2e-3
    assert res["anon_before_mb"] <= res["rss_before_mb"] and res["anon_peak_mb"] > 0
    # each attack beside the normal client: its figures, every normal request answered
    from mixrl.lab.bench.serve_attacks import ATTACKS

    attacks = res["attacks"]
    for name in ATTACKS:
        a = attacks[name]
        assert a["normal_failed"] == 0 and a["normal_requests"] > 0, name
        assert a["p99_over_quiet"] == round(a["attack_p99_ms"] / a["quiet_p99_ms"], 3)
        assert a["fds_leaked"] == max(0, a["fds_after"] - a["fds_before"]) and a["rss_before_mb"] > 0
    assert attacks["failing_3mb"]["attackers"] == {f"{k}_3mb:400": 10 for k in ("arguments", "content", "name", "tools")}
    assert any(k.startswith("idle_sockets:503") for k in attacks["idle_sockets"]["attackers"])
    assert any(k.startswith("heavy:") for k in attacks["fairness"]["attackers"])


def test_hostile_flags_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _run(capsys, "--hostile", "--hostile-rounds", "0")
    assert code == 2 and "--hostile-rounds must be >= 1" in out
