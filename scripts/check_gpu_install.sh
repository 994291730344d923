#!/usr/bin/env bash
# Does the GPU install command resolve? Metadata only: nothing is downloaded but the
# index pages and wheel metadata, nothing is installed, the local venv is not consulted.
#   scripts/check_gpu_install.sh                  # the README's GPU install: this project with [vllm]
#   scripts/check_gpu_install.sh 'vllm==0.33.0'   # another requirement set
# Target: x86_64 Linux with glibc 2.35 (Ubuntu 22.04 and later, the usual CUDA images),
# CPython 3.11. Exit status: pip's (0 = resolves). Prints what would be installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
INDEX="${MIXRL_INDEX_URL:-https://pypi.org/simple}"
report=$(mktemp)
wheels=$(mktemp -d)
trap 'rm -rf "$report" "$wheels"' EXIT
if [ "$#" -eq 0 ]; then
    # this project with its [vllm] extra, as `pip install -e '.[vllm]'` asks for it: built into
    # a pure-Python wheel first (a foreign platform's resolution takes binaries only)
    "$PY" -m pip wheel --quiet --no-deps --no-build-isolation -w "$wheels" . >/dev/null
    set -- "$(ls "$wheels"/mixrl-*.whl)[vllm]"
fi
plat=()
for v in $(seq 35 -1 17); do plat+=(--platform "manylinux_2_${v}_x86_64"); done
plat+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform linux_x86_64)
# --isolated and empty PIP_* : this machine's pip configuration (local wheel folders,
# constraints) must not answer for the public index
PIP_CONSTRAINT= PIP_FIND_LINKS= PIP_EXTRA_INDEX_URL= "$PY" -m pip --isolated install --dry-run --quiet \
    --ignore-installed --only-binary=:all: "${plat[@]}" --python-version 3.11 --implementation cp \
    --index-url "$INDEX" --report "$report" "$@"
"$PY" - "$report" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
pins = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in r["install"]}
reqs = {i["metadata"]["name"].lower(): i["metadata"].get("requires_dist") or [] for i in r["install"]}
vllm_torch = [d for d in reqs.get("vllm", []) if d.split(";")[0].replace(" ", "").startswith("torch=")]
keys = ("torch", "vllm", "transformers", "triton", "nvidia-cuda-runtime", "nvidia-nccl-cu13", "nvidia-nccl-cu12",
        "flashinfer-python", "xformers")
print(json.dumps({"resolves": True, "packages": len(pins), **{k: pins[k] for k in keys if k in pins},
                  "vllm_requires_torch": vllm_torch}))
PY
