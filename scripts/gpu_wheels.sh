#!/usr/bin/env bash
# Wheels a GPU machine without network needs beside its own PyTorch image to run
# scripts/gpu_check.sh: mixrl's dependencies that such an image (torch, transformers, peft,
# safetensors, tokenizers, numpy, scipy, rich, tensorboard, matplotlib, aiohttp, ...) lacks,
# at the versions this checkout's .venv holds, for CPython 3.12 on x86-64 Linux.
#
#   scripts/gpu_wheels.sh            # -> .whl/ (about 11 MB; gpu_check.sh installs them if present)
#   scripts/gpu_wheels.sh DIR        # elsewhere
#
# Ray (about 70 MB) and vLLM are left out: the checks that need them are skipped, and say so.
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:-.whl}"
PY="${PYTHON:-.venv/bin/python}"
mkdir -p "$dest"
names="pydantic pydantic-core annotated-types typing-inspection tomli-w orjson gguf datasets dill multiprocess
       fastapi starlette uvicorn httptools openai distro jiter sniffio torchao"
specs=$("$PY" - $names <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version

out = []
for name in sys.argv[1:]:
    try:
        out.append(f"{name}=={version(name)}")
    except PackageNotFoundError:  # not in this .venv: the newest that fits
        out.append(name)
print(" ".join(out))
EOF
)
for spec in $specs; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d "$dest" "$spec" 2>&1 | grep -v "^WARNING: Location" || true
done
ls "$dest"
du -sh "$dest"
