#!/usr/bin/env bash
# GPU check: assertions a CUDA machine must pass (mixrl.lab.gpu.check). At most 10 minutes
# on one H100/H200; prints one JSON object on stdout; exit status 1 if any check fails (or
# there is no usable GPU), 124 if it ran out of time.
#
#   scripts/gpu_check.sh                         # bundled policy, every check, on cuda
#   scripts/gpu_check.sh --only trainer,reload   # a subset (trainer, ranks, ray, reload, colocated, probe)
#   OUT=docs/artifacts/gpu_check.json scripts/gpu_check.sh   # also keep the JSON
#
# The trainer steps are compared with float64 on the CPU (fp32, bf16, fp16); the Ray and
# embedded trainers must hold their weights on the GPU; vLLM FP8 reload must match a fresh
# engine; FP8 + BF16 vLLM groups and the trainer share GPU 0 for 2 steps (mem_get_info
# logged); `mixrl probe` compares vLLM's FP8 with the built-in emulated FP8. The same module
# runs its CPU parts in the tests: python -m mixrl.lab.gpu.check --device cpu.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
work="$(mktemp -d -t mixrl-gpu-check-XXXXXX)"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}" PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
rc=0
timeout "${GPU_CHECK_TIMEOUT_S:-600}" "$PY" -m mixrl.lab.gpu.check --out "$work" "$@" >"$work/result.json" || rc=$?
[ -s "$work/result.json" ] || echo "{\"ok\": false, \"error\": \"no result (exit $rc)\"}" >"$work/result.json"
cat "$work/result.json"
if [ -n "${OUT:-}" ]; then cp "$work/result.json" "$OUT"; fi
exit "$rc"
