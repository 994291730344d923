"""The bundled small policy: a tiny Qwen3 warm-started on the bundled tasks.

    model, tok = load_policy("bundled")          # builds it on first use (see pretrain.py)
    model, tok = load_policy("/path/to/hf_dir")  # any local HF causal-LM directory

``bundled_policy_path()`` is a cache: ``$MIXRL_HOME/policy-<hash>`` (default
``~/.cache/mixrl``) where the hash covers the whole pretraining recipe, so a
changed recipe never reuses a stale model. The first caller builds it under
a file lock (concurrent workers wait instead of training twice) and the
directory appears atomically (written aside, then renamed).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Any

BUNDLED = "bundled"


def mixrl_home(data_dir: str | Path | None = None) -> Path:
    """Cache root: ``data_dir`` if given, else ``$MIXRL_HOME``, else ``~/.cache/mixrl``."""
    if data_dir is not None:
        return Path(data_dir)
    return Path(os.environ.get("MIXRL_HOME", Path.home() / ".cache" / "mixrl"))


def qwen3_config(
    vocab_size: int,
    *,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    max_positions: int = 512,
    pad_id: int | None = None,
    eos_id: int | None = None,
) -> Any:
    """A ``transformers.Qwen3Config`` with tied embeddings (small vocab: the head is cheap)."""
    from transformers import Qwen3Config

    if hidden % heads:
        raise ValueError(f"qwen3_config: hidden={hidden} is not a multiple of heads={heads}")
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
    )


def tiny_config(vocab_size: int, **overrides: Any) -> Any:
    """A Qwen3 config for tests: 1 layer, hidden 32 (overridable)."""
    kw: dict[str, Any] = dict(layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64, max_positions=256)
    kw.update(overrides)
    return qwen3_config(vocab_size, **kw)


def bundled_policy_path(data_dir: str | Path | None = None, seed: int = 0) -> Path:
    """Directory of the bundled policy for ``seed``; pretrains it if missing."""
    from mixrl.models import pretrain

    recipe = pretrain.Recipe(seed=seed)
    out = mixrl_home(data_dir) / f"policy-{recipe.digest()}"
    if not (out / "recipe.json").exists():
        build_locked(recipe, out)
    return out


def build_locked(recipe: Any, out: Path, force: bool = False) -> bool:
    """Pretrain ``recipe`` into ``out`` under a file lock; False if it was already built."""
    from mixrl.models import pretrain

    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second process waits, then finds it built
        if (out / "recipe.json").exists() and not force:
            return False
        pretrain.pretrain(recipe, out)
        return True


def resolve(path_or_bundled: str | Path) -> Path:
    """``"bundled"`` -> the bundled policy's directory; otherwise the path, checked."""
    if str(path_or_bundled) == BUNDLED:
        return bundled_policy_path()
    p = Path(path_or_bundled)
    if not (p / "config.json").exists():
        raise FileNotFoundError(
            f"policy path {str(p)!r} is not an HF model directory (no config.json); "
            f"name a saved model or {BUNDLED!r}"
        )
    return p


def load_policy(path_or_bundled: str | Path = BUNDLED, dtype: Any = None) -> tuple[Any, Any]:
    """(model, tokenizer) from ``"bundled"`` or any local HF causal-LM directory.

    The model is in eval mode, FP32 unless ``dtype`` says otherwise.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = resolve(path_or_bundled)
    model = AutoModelForCausalLM.from_pretrained(str(p), dtype=dtype or torch.float32)
    model.eval()
    tok = AutoTokenizer.from_pretrained(str(p))
    return model, tok
