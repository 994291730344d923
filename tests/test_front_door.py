"""What a new user meets first: failures that are loud, one JSON object, the version, file paths as
env names, the hints after Ctrl-C and after a finished run."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from test_data_cli import one_line_error, project, tiny  # noqa: F401  (tiny: the module's fixture)

from mixrl.commands.main import main
from mixrl.rollout.failures import EpisodesFailed, check_episodes
from mixrl.system.jsonout import json_text

REWARDS = '''
import math

def raises(completions, answer, **kw):
    raise KeyError("solution")

def nan(completions, **kw):
    return [math.nan]

def none(completions, **kw):
    return [None]

def short(completions, **kw):
    return []

def verl_missing(data_source, solution_str, ground_truth, extra_info=None):
    return float(extra_info["missing_column"] == solution_str)

def later(completions, **kw):  # fine on what a dry run sends, fails on the model's own replies
    if completions[0] and "42" not in completions[0]:
        raise ZeroDivisionError("a reply the check never sent")
    return [0.0]

def sometimes(completions, prompts, **kw):  # fails on one prompt only
    if "3+1" in str(prompts[0]) and completions[0] and "42" not in completions[0]:
        raise ZeroDivisionError("row three")
    return [0.0]
'''


@pytest.fixture()
def user(tmp_path: Path, tiny: Path) -> Path:  # noqa: F811
    cfg = project(tmp_path, tiny)
    (tmp_path / "rewards.py").write_text(REWARDS)
    return cfg


@pytest.mark.parametrize(("fn", "error"), [
    ("raises", "KeyError: 'solution'"), ("nan", "returned nan"), ("none", "returned None"),
    ("short", "expected a list of 1 float, got []"), ("verl_missing", "KeyError: 'missing_column'"),
])
def test_dry_run_calls_the_reward_on_real_rows(capsys: pytest.CaptureFixture[str], user: Path, fn: str,
                                               error: str) -> None:
    assert main(["train", str(user), "--dry-run", "--set", f'reward.function="rewards.py:{fn}"']) == 2
    one_line_error(capsys, f"rewards.py:{fn}'", "train row 0", error)


def test_a_reward_that_fails_during_the_run_fails_the_run(capsys: pytest.CaptureFixture[str], user: Path) -> None:
    run = user.parent / "run"
    assert main(["train", str(user), "--no-eval", "--set", 'reward.function="rewards.py:later"']) == 2
    err = one_line_error(capsys, "rewards.py:later'", "failed on row", "ZeroDivisionError: a reply the check never sent",
                         "update 1", 'reward.on_error = "skip"', str(run / "run.log"))
    assert "done:" not in capsys.readouterr().out and "Traceback" not in err
    assert "Traceback (most recent call last)" in (run / "run.log").read_text()
    # "skip": the failed episodes are left out and counted, unless no episode of a batch has a reward
    assert main(["train", str(user), "--no-eval", "--overwrite", "--set", 'reward.function="rewards.py:later"',
                 "--set", 'reward.on_error="skip"']) == 2
    one_line_error(capsys, "no episode of the batch of update 1 has a reward", "reward_failed 4 of 4",
                   "nothing to learn")
    assert main(["train", str(user), "--no-eval", "--overwrite", "--set", 'reward.function="rewards.py:sometimes"',
                 "--set", 'reward.on_error="skip"', "--set", "runtime.steps=6"]) == 0, capsys.readouterr().err
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and sum(r.get("rollout/unrewarded", 0) for r in rows) >= 1


class _T:
    def __init__(self, status: str, error: str = "") -> None:
        self.status, self.info = status, ({"error": error} if error else {})


def test_which_batches_end_the_run() -> None:
    ok, rf = _T("ok"), _T("reward_failed", "reward function 'r.py:f' failed on row 3: KeyError: 'x'")
    check_episodes([ok, _T("format_error"), _T("truncated")], "fail", "b")
    check_episodes([ok, rf], "skip", "b")  # skipped and counted
    with pytest.raises(EpisodesFailed, match="row 3: KeyError") as e:
        check_episodes([ok, rf], "fail", "b")
    assert e.value.user
    with pytest.raises(EpisodesFailed, match=r"agent_failed 2 of 2.*\(2x\): boom") as e:
        check_episodes([_T("agent_failed", "boom")] * 2, "skip", "b")
    assert e.value.user
    with pytest.raises(EpisodesFailed, match="infra_failed 3 of 3") as e:  # the host's: its own status
        check_episodes([_T("infra_failed", "sampler finish_reason=error")] * 3, "fail", "b")
    assert not e.value.user
    with pytest.raises(EpisodesFailed) as e:
        check_episodes([_T("infra_failed", "env.step raised KeyError: 'q'")] * 2, "fail", "b")
    assert e.value.user  # the environment's code, not the host


def test_json_is_one_strict_object_and_errors_go_to_stderr(user: Path, tmp_path: Path) -> None:
    assert json.loads(json_text({"a": math.nan, "b": [math.inf, 1.5], "c": {"d": -math.inf}})) == {
        "a": None, "b": [None, 1.5], "c": {"d": None}}
    cmd = [sys.executable, "-m", "mixrl.commands.main"]
    p = subprocess.run([*cmd, "train", str(user), "--json", "--set", "observe.progress=true"],
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout, parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))
    assert out["steps"] == 2 and out["eval"]["metric"] == "pass@1" and "next" in out
    run = tmp_path / "run"
    e = subprocess.run([*cmd, "eval", str(run / "policy"), "--k", "1", "--n", "1", "--tasks", "2", "--json"],
                       capture_output=True, text=True, timeout=600)
    assert e.returncode == 0, e.stderr
    assert json.loads(e.stdout)["k"] == 1
    for argv in (["eval", str(tmp_path / "nowhere")], ["report", str(tmp_path / "nowhere")]):
        bad = subprocess.run([*cmd, *argv], capture_output=True, text=True, timeout=300)
        assert bad.returncode == 2 and bad.stdout == "" and len(bad.stderr.strip().splitlines()) == 1, bad


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.metadata

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"mixrl {importlib.metadata.version('mixrl')}"


ENV = '''
from mixrl.envs.base import MessageEnv, Reply

class Echo(MessageEnv):
    async def respond(self, reply):
        return Reply.end(await self.reward(reply))
'''


def test_a_file_as_env_name(capsys: pytest.CaptureFixture[str], user: Path) -> None:
    (user.parent / "my_env.py").write_text(ENV)
    assert main(["train", str(user), "--dry-run", "--set", 'env.name="my_env.py"']) == 2
    one_line_error(capsys, "env.name", "is a file", "my_env.py:Echo")  # names the class to write
    assert main(["train", str(user), "--dry-run", "--set", 'env.name="nowhere.py"']) == 2
    one_line_error(capsys, "nowhere.py", "not found")
    assert main(["train", str(user), "--dry-run", "--set", 'env.name="my_env.py:Nope"']) == 2
    one_line_error(capsys, "my_env.py:Nope", "has no 'Nope'")
    assert main(["train", str(user), "--no-eval", "--set", 'env.name="my_env.py:Echo"']) == 0, capsys.readouterr().err


def test_hints_after_an_interrupted_and_a_finished_run(capsys: pytest.CaptureFixture[str], user: Path) -> None:
    from mixrl.commands.train import format_summary, run_summary
    from mixrl.config import load_config

    run = user.parent / "run"
    cfg = load_config(user)
    cut = run_summary({"steps": 1, "interrupted": True}, cfg)
    assert cut["next"] == [f"mixrl train --resume {run}", f"mixrl report {run}"]  # no policy to evaluate yet
    assert "continue with --resume" in format_summary(cut)
    assert main(["train", str(user), "--no-eval"]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", str(run)]) == 0  # finished: says so, does no work
    out = capsys.readouterr().out
    assert out.startswith(f"the run in {run} is finished: 2 of 2 updates; nothing to do")
    assert f"mixrl train --resume {run} --set runtime.steps=4" in out and f"mixrl eval {run / 'policy'}" in out
    assert not (run / "eval.json").exists()
    assert main(["train", "--resume", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["finished"] is True
