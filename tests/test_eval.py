"""pass@k aggregation, and `mixrl eval` / the session runner on the real built-in engine."""

from __future__ import annotations

import argparse
import asyncio
import json
import math

import pytest

from mixrl.records.trajectory import Trajectory
from mixrl.rollout.evaluate import summarize


def _tr(pid: str, reward: float | None, status: str = "ok") -> Trajectory:
    return Trajectory(prompt_id=pid, sample_idx=0, reward=reward, status=status)


def test_summarize_hand_values() -> None:
    by_task = {
        "a": [_tr("a", 1.0), _tr("a", 0.0), _tr("a", 0.0), _tr("a", 0.0)],
        "b": [_tr("b", None, "infra_failed"), _tr("b", 0.0, "format_error"), _tr("b", 0.0), _tr("b", 1.0)],
    }
    r = summarize(by_task, 2)
    # a: n=4, c=1: pass@1 = 1/4, pass@2 = 1 - C(3,2)/C(4,2) = 1/2
    # b: infra_failed dropped -> n=3, c=1: pass@1 = 1/3, pass@2 = 1 - C(2,2)/C(3,2) = 2/3
    assert r["pass@1"] == pytest.approx((1 / 4 + 1 / 3) / 2)
    assert r["pass@2"] == pytest.approx((1 / 2 + 2 / 3) / 2)
    assert (r["n_tasks"], r["infra_failed"], r["tasks_incomplete"]) == (2, 1, 0)
    assert r["mean_reward"] == pytest.approx(2 / 7)  # infra_failed is not a reward of 0
    r4 = summarize(by_task, 4)  # b has only 3 valid samples: left out, counted
    assert (r4["n_tasks"], r4["tasks_incomplete"], r4["pass@4"]) == (1, 1, 1.0)


@pytest.fixture(scope="module")
def mini_model(tmp_path_factory):
    from mixrl.lab import pretrain

    out = tmp_path_factory.mktemp("mini") / "policy"
    recipe = pretrain.Recipe(layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64, steps=4,
                             batch=8, warmup=1, threads=1)
    pretrain.pretrain(recipe, out, log=None)
    return out


def test_session_on_builtin_engine_keeps_sampler_records(mini_model) -> None:
    """Token in, token out with the real engine: per-token q, version, group, support."""
    import torch

    from mixrl.envs.registry import make_env, make_task_source
    from mixrl.models.chat import ChatFormat
    from mixrl.models.policy import load_policy
    from mixrl.records.generation import SamplingParams
    from mixrl.rollout.session import run_episode
    from mixrl.sampling.batching import BatchingSampler
    from mixrl.sampling.factory import make_engine

    _, tok = load_policy(mini_model)
    chat = ChatFormat(tok)
    engine = make_engine(str(mini_model), "fp32", "grp", seed=0, num_threads=1)
    src = make_task_source("mix", "heldout", 0)

    async def go():
        s = BatchingSampler(engine, max_batch=8)
        try:
            return await asyncio.gather(*[
                run_episode(make_env(src[i], chat), s.generate, SamplingParams(max_new_tokens=12),
                            prompt_id=src[i].prompt_id, sample_idx=0, max_total_tokens=80)
                for i in range(4)])
        finally:
            await s.close()

    for tr in asyncio.run(go()):
        tr.validate()
        assert tr.status in ("ok", "format_error", "max_turns", "truncated")
        first_gen = tr.loss_mask.index(1)
        assert tr.tokens[first_gen - 1] == chat.assistant_header[-1]  # generation starts after the header
        gen = [i for i, m in enumerate(tr.loss_mask) if m]
        assert all(tr.versions[i] == 0 and tr.groups[i] == "grp" for i in gen)
        assert tr.cand_kind == "support" and len(tr.cand_offsets) == len(gen) + 1
        for j, i in enumerate(gen):
            a, b = tr.cand_offsets[j], tr.cand_offsets[j + 1]
            ids, lps = tr.cand_ids[a:b], tr.cand_logprobs[a:b]
            assert tr.tokens[i] in ids  # the sampled token is in q's support ...
            assert lps[ids.index(tr.tokens[i])] == pytest.approx(tr.sampler_logprobs[i], abs=1e-5)
            assert torch.logsumexp(torch.tensor(lps, dtype=torch.float64), 0).item() == pytest.approx(0, abs=1e-4)


def test_evaluate_end_to_end_and_cli_json(mini_model, capsys) -> None:
    from mixrl.rollout import evaluate as ev

    r = ev.evaluate(mini_model, k=2, n=3, n_tasks=4, seed=0, task="mix", max_new_tokens=8, num_threads=1)
    for key in ("pass@1", "pass@2", "n_tasks", "mean_reward", "per_family", "status"):
        assert key in r
    assert sum(r["status"].values()) == 4 * 3 and r["n_tasks"] + r["tasks_incomplete"] == 4
    assert set(r["per_family"]) == {"calc", "upper"} and 0.0 <= r["pass@1"] <= r["pass@2"] <= 1.0
    p = argparse.ArgumentParser()
    ev.configure(p)
    args = p.parse_args([str(mini_model), "--k", "1", "--tasks", "2", "--task", "upper", "--json",
                         "--max-new-tokens", "6", "--threads", "1"])
    assert ev.main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["n_tasks"] == 2 and not math.isnan(out["pass@1"]) and out["profile"] == "fp32"
    one = ev.evaluate(mini_model, k=1, n_tasks=3, task="calc", max_new_tokens=6, num_threads=1,
                      env_options={"max_turns": 1})
    assert one["mean_turns"] == 1.0  # env options reach make_env
    assert ev.main(p.parse_args([str(mini_model), "--k", "3", "--n", "2"])) == 2
    assert "k=3, n=2" in capsys.readouterr().err


def test_eval_is_deterministic_given_the_seed(tmp_path) -> None:
    """Each request carries its own seed (seed, task, sample, turn): the numbers do not depend on
    how requests are batched or scheduled; another seed gives other samples."""
    import torch
    from transformers import AutoModelForCausalLM

    from mixrl.models.policy import tiny_config
    from mixrl.models.tokenizer import save_tokenizer
    from mixrl.rollout.evaluate import evaluate

    torch.manual_seed(0)
    tok = save_tokenizer(tmp_path)
    AutoModelForCausalLM.from_config(tiny_config(len(tok), pad_id=tok.pad_token_id,
                                                 eos_id=tok.eos_token_id)).save_pretrained(tmp_path)
    kw = dict(k=2, n=3, n_tasks=6, max_new_tokens=6, max_total_tokens=64, num_threads=1)
    keys = ("pass@1", "pass@2", "mean_reward", "status", "mean_turns", "mean_generated")
    a = evaluate(tmp_path, seed=5, max_batch=1, **kw)
    b = evaluate(tmp_path, seed=5, max_batch=16, **kw)
    c = evaluate(tmp_path, seed=6, max_batch=16, **kw)
    assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
    assert a["mean_generated"] != c["mean_generated"] or a["status"] != c["status"]


def test_evaluation_keeps_the_reasons_of_samples_without_reward(mini_model, monkeypatch, caplog) -> None:
    from mixrl.rollout import evaluate as ev
    from mixrl.rollout.failures import EpisodesFailed
    from mixrl.sampling.batching import BatchingSampler

    real = BatchingSampler.generate

    async def second_sample_gone(self, request):  # type: ignore[no-untyped-def]
        if request.request_id.split("/")[-2] == "1":  # prompt_id/sample/turn
            raise ConnectionError("replica gone")
        return await real(self, request)

    monkeypatch.setattr(BatchingSampler, "generate", second_sample_gone)
    with caplog.at_level("WARNING", logger="mixrl.rollout.evaluate"):
        r = ev.evaluate(mini_model, k=1, n=2, n_tasks=3, seed=0, max_new_tokens=4, num_threads=1)
    assert r["status"]["infra_failed"] == 3 and sum(r["status"].values()) == 6 and r["n_tasks"] == 3
    assert r["errors"] == {"generate raised ConnectionError: replica gone": 3}
    assert "3 of 6 samples have no reward" in caplog.text and "replica gone" in caplog.text

    async def gone(self, request):  # type: ignore[no-untyped-def]
        raise ConnectionError("replica gone")

    monkeypatch.setattr(BatchingSampler, "generate", gone)
    with pytest.raises(EpisodesFailed, match=r"infra_failed 6 of 6.*replica gone") as e:  # nothing measured: no score
        ev.evaluate(mini_model, k=1, n=2, n_tasks=3, seed=0, max_new_tokens=4, num_threads=1)
    assert not e.value.user  # the host's failure, not the user's code


def test_eval_samples_inside_the_nucleus_it_is_given(tmp_path, capsys, monkeypatch) -> None:
    """``top_p`` reaches every request the engine samples (the engine's own top-p sampling is
    tested in test_engine.py), the result records it, and a bad value exits 2."""
    import torch
    from transformers import AutoModelForCausalLM

    from mixrl.models.policy import tiny_config
    from mixrl.models.tokenizer import save_tokenizer
    from mixrl.rollout import evaluate as ev
    from mixrl.sampling.batching import BatchingSampler

    torch.manual_seed(0)
    tok = save_tokenizer(tmp_path)
    AutoModelForCausalLM.from_config(tiny_config(len(tok), pad_id=tok.pad_token_id,
                                                 eos_id=tok.eos_token_id)).save_pretrained(tmp_path)
    seen, real = [], BatchingSampler.generate

    async def spy(self, req):
        seen.append(req.params.top_p)
        return await real(self, req)

    monkeypatch.setattr(BatchingSampler, "generate", spy)
    kw = dict(k=2, n=3, n_tasks=4, max_new_tokens=6, max_total_tokens=64, num_threads=1)
    full = ev.evaluate(tmp_path, seed=5, **kw)
    assert set(seen) == {1.0} and full["top_p"] == 1.0
    seen.clear()
    nucleus = ev.evaluate(tmp_path, seed=5, top_p=0.9, **kw)
    assert len(seen) >= 12 and set(seen) == {0.9} and nucleus["top_p"] == 0.9
    p = argparse.ArgumentParser()
    ev.configure(p)
    assert ev.main(p.parse_args([str(tmp_path), "--k", "1", "--tasks", "1", "--top-p", "0"])) == 2
    assert "top_p must be in (0, 1]" in capsys.readouterr().err
