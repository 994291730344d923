#!/usr/bin/env bash
# The real model's study on a GPU (mixrl.lab.gpu.study): one command, a 3-update timing run of
# every cell first (it stops, saying why, when one run would not fit the minutes left), then
# as many of the study's runs as fit, then the report from OUT/data. Resumable piece by piece.
#
#   scripts/gpu_study.sh --out runs/gpu-study --minutes 12     # a lease of ~15 minutes
#   scripts/gpu_study.sh --resume --out runs/gpu-study --minutes 12
#   scripts/gpu_study.sh --cpu --model bundled --steps 3 --calibrate 3 --eval-tasks 4 --eval-n 2
#
# examples/real_model/study.toml is the study (its [study] pre-registration, cells, seeds and
# updates); on a GPU its groups and the trainer (FP32) run on GPU 0. Wheels in .whl/
# (scripts/gpu_wheels.sh; GPU_CHECK_WHEELS=DIR elsewhere) are installed first. Options:
# python -m mixrl.lab.gpu.study --help.
set -euo pipefail
args=() minutes=12
while [ $# -gt 0 ]; do  # --out relative to the caller's folder
  case "$1" in
    --out) args+=("--out" "$(realpath -m "$2")"); shift 2 ;;
    --minutes) minutes="$2"; args+=("$1" "$2"); shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
cd "$(dirname "$0")/.."
GPU_SCRIPT=gpu_study
. scripts/gpu_env.sh  # PY, the environment, the carried wheels
limit=$(python3 -c "print(int(float('$minutes') * 60 + 60))")  # a minute past --minutes
rc=0
timeout "$limit" "$PY" -m mixrl.lab.gpu.study "${args[@]}" || rc=$?
if [ "$rc" = 124 ]; then echo "gpu_study: out of time after $limit s" >&2; fi
exit "$rc"
