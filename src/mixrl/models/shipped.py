"""Where the bundled policy is: the copy shipped in the package (``mixrl/models/bundled/``)
when it is the recipe's, else a build in the cache (``$MIXRL_HOME/policy-<digest>``, made by
``mixrl pretrain``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from mixrl.models.recipe import Recipe

BUNDLED = "bundled"


def mixrl_home(data_dir: str | Path | None = None) -> Path:
    """Cache root: ``data_dir`` if given, else ``$MIXRL_HOME``, else ``~/.cache/mixrl``."""
    if data_dir is not None:
        return Path(data_dir)
    return Path(os.environ.get("MIXRL_HOME", Path.home() / ".cache" / "mixrl"))


SHIPPED = Path(__file__).resolve().parent / "bundled"  # the shipped policy's files


def shipped_recipe() -> dict[str, Any] | None:
    """``recipe.json`` of the policy shipped in the package (None if it is absent)."""
    import json

    meta = SHIPPED / "recipe.json"
    if not (meta.is_file() and (SHIPPED / "model.safetensors").is_file()):
        return None
    return dict(json.loads(meta.read_text()))


def cached_policy_path(data_dir: str | Path | None = None, seed: int = 0) -> Path:
    """Where a build of the bundled recipe for ``seed`` lives in the cache."""
    return mixrl_home(data_dir) / f"policy-{Recipe(seed=seed).digest()}"


def bundled_policy_path(data_dir: str | Path | None = None, seed: int = 0) -> Path:
    """Directory of the bundled policy for ``seed``: the shipped copy when it is that
    recipe's, else a cached build; ``FileNotFoundError`` naming ``mixrl pretrain`` when
    neither exists (a run never trains the policy behind the user's back)."""
    shipped = shipped_recipe()
    if shipped is not None and shipped.get("digest") == Recipe(seed=seed).digest():
        return SHIPPED
    out = cached_policy_path(data_dir, seed)
    if not (out / "recipe.json").exists():
        raise FileNotFoundError(f"the bundled policy for seed {seed} is not built: run `mixrl pretrain --seed {seed}`"
                                f" (it builds {out})")
    return out
