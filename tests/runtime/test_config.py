"""Run config: bounds, field paths in errors, overrides, TOML round trip, CLI exit status."""

from __future__ import annotations

import tomllib

import pytest

from mixrl.commands import train as cli
from mixrl.config import ConfigError, RunConfig, build_config, derive, load_config, to_toml


def _cli(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser()
    cli.configure(p)
    return cli.main(p.parse_args(argv))


def test_demo_config_is_valid_and_round_trips() -> None:
    cfg = load_config(None)
    assert {g.profile for g in cfg.fleet.groups} >= {"b200-nvfp4", "h100-fp8", "h100-bf16", "b200-bf16"}
    again = RunConfig.model_validate(tomllib.loads(to_toml(cfg)))
    assert again == cfg


def test_nested_and_unset_fields_round_trip_through_toml() -> None:
    cfg = load_config(None, ['observe.wandb={project = "p", tags = ["a", "b"]}', "trainer.lora={rank = 4}",
                             'fleet.groups.1.overrides={compute_dtype = "bf16"}', 'rollout.overlong={type = "penalty"}',
                             'reward.functions=["a.py:f", "b:g"]', "reward.weights=[0.5, 2.0]"])
    text = to_toml(cfg)
    rollout = text.split("[rollout]", 1)[1].split("\n[", 1)[0]
    assert "null" not in text and "top_p" not in rollout  # None fields are left out
    assert RunConfig.model_validate(tomllib.loads(text)) == cfg


def test_overrides_reach_default_lists_and_parse_toml_literals() -> None:
    cfg = build_config({}, ["fleet.groups.0.max_replicas=3", "fleet.groups.0.replicas=3", "rollout.top_p=0.5",
                            "runtime.max_staleness=2", 'runtime.staleness_policy="requeue"', "rollout.top_p=null"])
    assert cfg.fleet.groups[0].replicas == 3 and cfg.runtime.max_staleness == 2
    assert cfg.rollout.top_p is None


@pytest.mark.parametrize(
    ("override", "path"),
    [
        ("rollout.group_size=1", "rollout.group_size"),
        ("optim.lr=-1", "optim.lr"),
        ('runtime.mode="sometimes"', "runtime.mode"),
        ("fleet.groups.0.replicas=9", "fleet.groups.0"),
        ("rollout.bogus=1", "rollout.bogus"),
        ('rollout.record="head:x"', "rollout.record"),
        ('fleet.autoscaler.type="magic"', "fleet.autoscaler"),
        ("runtime.eval.k=9", "runtime.eval"),
    ],
)
def test_errors_name_the_field(override: str, path: str) -> None:
    with pytest.raises(ConfigError) as e:
        build_config({}, [override])
    assert str(e.value).startswith(path)


def test_derived_values() -> None:
    cfg = build_config({}, [])
    d = derive(cfg, preset_top_p=0.9, preset_head_k=16)
    assert (d.top_p, d.record, d.max_inflight_prompts) == (0.9, "support", 16)
    d = derive(build_config({}, ["rollout.top_p=1.0", "rollout.max_inflight_prompts=3"]), 0.9, 16)
    assert (d.top_p, d.record, d.max_inflight_prompts) == (1.0, "head:16", 3)


def test_cli_exit_status_2_with_field_path(capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli(["--set", "rollout.group_size=0"]) == 2
    assert "rollout.group_size" in capsys.readouterr().err
    assert _cli(["--set", 'loss.preset="nope"']) == 2
    assert "loss.preset" in capsys.readouterr().err
    assert _cli(["--set", 'fleet.groups.2.profile="nope"']) == 2
    assert "fleet.groups.2.profile" in capsys.readouterr().err


def test_cli_dry_run_prints_resolved_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli(["--dry-run", "--set", "runtime.steps=7"]) == 0
    out = capsys.readouterr().out
    # the default preset (sc) samples the full vocabulary and records the head of q
    assert "steps = 7" in out and '"record": "head:64"' in out
