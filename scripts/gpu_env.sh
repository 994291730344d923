# Sourced by scripts/gpu_check.sh and scripts/gpu_study.sh, from the repository root, with
# GPU_SCRIPT set to the caller's name (for its messages): sets PY (the interpreter), the
# environment the steps run in, and installs the wheels carried to a machine without network
# (scripts/gpu_wheels.sh writes .whl/; GPU_CHECK_WHEELS=DIR elsewhere) before anything runs.
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}" PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
wheels="${GPU_CHECK_WHEELS:-.whl}"
if compgen -G "$wheels/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps "$wheels"/*.whl >&2 \
    || "$PY" -m pip install -q --no-index --no-deps --user --break-system-packages "$wheels"/*.whl >&2 \
    || { echo "$GPU_SCRIPT: the wheels in $wheels did not install" >&2; exit 1; }
fi
