"""Typed configuration (pydantic v2; imports neither torch nor Ray).

- ``mixrl.config.schema``: the whole run (``RunConfig``) and its derived values.
- ``mixrl.config.io``: TOML loading and writing, ``--set`` overrides, field-path
  error messages (``ConfigError``).
- ``mixrl.config.loss`` / ``mixrl.config.presets``: the loss and its named presets.

The names below are the public API: ``from mixrl.config import RunConfig, load_config``.
"""

from mixrl.config.io import (
    ConfigError,
    apply_override,
    build_config,
    demo_config_path,
    format_errors,
    load_config,
    resolve_paths,
    to_toml,
)
from mixrl.config.schema import (
    DataConfig,
    Derived,
    EnvConfig,
    EvalConfig,
    FixedScaling,
    FleetConfig,
    GroupConfig,
    InflightScaling,
    LoraConfig,
    LossSection,
    ModelConfig,
    ObserveConfig,
    OptimConfig,
    OverlongFilter,
    OverlongPenalty,
    RayConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    RuntimeConfig,
    TrainerConfig,
    derive,
)

__all__ = [
    "ConfigError", "DataConfig", "Derived", "EnvConfig", "EvalConfig", "FixedScaling", "FleetConfig", "GroupConfig",
    "InflightScaling", "LoraConfig", "LossSection", "ModelConfig", "ObserveConfig", "OptimConfig", "OverlongFilter", "OverlongPenalty", "RayConfig", "RewardConfig",
    "RolloutConfig", "RunConfig", "RuntimeConfig", "TrainerConfig", "apply_override", "build_config",
    "demo_config_path", "derive", "format_errors", "load_config", "resolve_paths", "to_toml",
]
