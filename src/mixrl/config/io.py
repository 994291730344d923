"""Reading and writing a run's configuration: TOML files, ``--set`` overrides, errors.

A run is described by a TOML file plus ``--set key.path=value`` overrides
(``fleet.groups.0.replicas=2``; ``null`` sets a field to None). Invalid values
raise ``ConfigError`` with one line per field path, which the CLI prints before
exiting with status 2. ``to_toml`` writes the resolved configuration (what
``--dry-run`` prints and the run directory keeps) with ``tomli_w``; ``resolve_paths``
makes its data and reward files absolute, relative to the config's folder.
"""

from __future__ import annotations

import copy
import tomllib
from pathlib import Path
from typing import Any

import tomli_w
from pydantic import ValidationError

from mixrl.config.schema import RunConfig


class ConfigError(ValueError):
    """A configuration error; ``str(e)`` names the field path(s)."""


def parse_value(text: str) -> Any:
    """A ``--set`` value: a TOML literal (1, 0.5, true, "x", [1, 2]) or a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_override(tree: dict[str, Any], assignment: str, defaults: dict[str, Any] | None = None) -> None:
    """Apply ``key.path=value`` to a nested dict.

    List elements are addressed by index (``fleet.groups.0.replicas=2``). A section
    missing from ``tree`` is copied from ``defaults`` (the default config) first, so
    overrides also reach into default lists. ``null`` sets a field to None.
    """
    if "=" not in assignment:
        raise ConfigError(f"--set expects key.path=value, got {assignment!r}")
    key, text = assignment.split("=", 1)
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise ConfigError(f"--set has an empty key in {assignment!r}")
    value = None if text.strip() == "null" else parse_value(text.strip())
    node: Any = tree
    dnode: Any = defaults
    for i, part in enumerate(parts):
        where = ".".join(parts[: i + 1])
        last = i == len(parts) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"{where}: no list element {part!r} (the list has {len(node)})")
            idx = int(part)
            if last:
                node[idx] = value
                return
            node = node[idx]
            dnode = dnode[idx] if isinstance(dnode, list) and idx < len(dnode) else None
            continue
        if not isinstance(node, dict):
            raise ConfigError(f"{'.'.join(parts[:i])}: is a value, not a section")
        if last:
            node[part] = value
            return
        dchild = dnode.get(part) if isinstance(dnode, dict) else None
        if part not in node:
            node[part] = copy.deepcopy(dchild) if isinstance(dchild, dict | list) else {}
        node, dnode = node[part], dchild


def format_errors(err: ValidationError) -> str:
    """A pydantic validation error as one line per field: ``dotted.path: message (got value)``."""
    lines = []
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"]) or "<root>"
        got = f" (got {e['input']!r})" if "input" in e and not isinstance(e["input"], dict) else ""
        lines.append(f"{path}: {e['msg']}{got}")
    return "\n".join(lines)


def build_config(tree: dict[str, Any], overrides: list[str] = ()) -> RunConfig:  # type: ignore[assignment]
    """Validate a raw dict after applying overrides; raise ``ConfigError`` naming the fields."""
    tree = copy.deepcopy(tree)
    defaults = RunConfig().model_dump(mode="json")
    defaults["env"].pop("name")  # --set env.options=... must not pin env.name (it follows [data])
    for o in overrides:
        apply_override(tree, o, defaults)
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(format_errors(e)) from None


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:  # type: ignore[assignment]
    """Read a TOML file (None = the bundled demo) and apply ``--set`` overrides."""
    p = Path(path) if path is not None else demo_config_path()
    try:
        tree = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {p}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: invalid TOML: {e}") from None
    return build_config(tree, list(overrides))


def demo_config_path() -> Path:
    """The bundled demo configuration (``mixrl/configs/demo.toml``)."""
    return Path(__file__).resolve().parent.parent / "configs" / "demo.toml"


def to_toml(cfg: RunConfig) -> str:
    """The resolved config as TOML; fields set to None are left out (TOML has no null)."""
    return tomli_w.dumps(_without_none(cfg.model_dump(mode="json")))


def _without_none(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _without_none(v) for k, v in x.items() if v is not None}
    if isinstance(x, list):
        return [_without_none(v) for v in x]
    return x


def _resolve_path(value: str, base: Path | None) -> str:
    """A path relative to the config's folder if it exists there, else as given (cwd or hub id)."""
    p = Path(value).expanduser()
    if p.is_absolute():
        return value
    if base is not None and (base / p).exists():
        return str((base / p).resolve())
    return str(p.resolve()) if p.exists() else value


def resolve_paths(cfg: Any, base: Path | None) -> None:
    """Make ``data.*`` paths and reward files absolute (the saved config then works from anywhere)."""
    for key in ("train", "heldout"):
        v = getattr(cfg.data, key)
        if v is not None:
            setattr(cfg.data, key, _resolve_path(v, base))

    def fn(spec: str) -> str:
        mod, sep, name = spec.rpartition(":")
        return f"{_resolve_path(mod, base)}:{name}" if sep and mod.endswith(".py") else spec

    if cfg.env.name.startswith("openai_agent:"):  # openai_agent:PATH.py:FUNCTION
        cfg.env.name = "openai_agent:" + fn(cfg.env.name[len("openai_agent:"):])
    elif ":" not in cfg.env.name and cfg.env.name.endswith(".py"):  # a file: refused with its classes named
        cfg.env.name = _resolve_path(cfg.env.name, base)
    elif not cfg.env.name.startswith(("verifiers:", "openai_agent:")):  # PATH.py:Class, an Env in a file
        cfg.env.name = fn(cfg.env.name)
    if cfg.env.name.startswith("verifiers:") and cfg.env.name.endswith(".py"):  # verifiers:PATH.py
        cfg.env.name = "verifiers:" + _resolve_path(cfg.env.name[len("verifiers:"):], base)
    if cfg.reward.function is not None:
        cfg.reward.function = fn(cfg.reward.function)
    if cfg.reward.functions:
        cfg.reward.functions = [fn(s) for s in cfg.reward.functions]
