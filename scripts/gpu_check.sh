#!/usr/bin/env bash
# GPU check: on a CUDA machine, mixrl with vLLM samplers on the GPU in FP8 weights
# + FP8 KV cache (and NVFP4 weights + FP8 KV where the GPU has it, compute
# capability >= 10.0) and a CUDA trainer: a few training steps per format, then
# `mixrl probe` on the same profiles. Prints one JSON object on stdout:
#   {"gpu": {...}, "runs": {PROFILE: {steps, samples_per_s, ...} | {"error": ...}},
#    "skipped": {PROFILE: reason}, "probe": {...}}
#
# Without a CUDA GPU (or without a CUDA build of vLLM) it prints one line to
# stderr saying which, and exits 2. CI never runs it.
#
#   scripts/gpu_check.sh                  # bundled policy, 4 steps per format
#   MODEL=/path/to/hf STEPS=8 scripts/gpu_check.sh
#
# One vLLM engine per run: each reserves most of the GPU's memory, so the formats
# run one after the other; the trainer (one FSDP2 rank on cuda:0) shares the GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
MODEL="${MODEL:-bundled}"
STEPS="${STEPS:-4}"
OUT="${OUT:-$(mktemp -d -t mixrl-gpu-check-XXXXXX)}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"

exec "$PY" - "$MODEL" "$STEPS" "$OUT" <<'PYEOF'
import json
import subprocess
import sys
from pathlib import Path

model, steps, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])


def die(msg: str) -> None:
    print(f"gpu_check: {msg}", file=sys.stderr)
    sys.exit(2)


try:
    import torch
except ImportError as e:
    die(f"torch is not importable ({e})")
if not torch.cuda.is_available():
    why = "this torch is a CPU-only build" if torch.version.cuda is None else "torch sees no CUDA device"
    die(f"no CUDA GPU: {why} (torch {torch.__version__}); run this on a machine with an NVIDIA GPU")
try:
    import vllm
    from vllm.platforms import current_platform
except Exception as e:  # noqa: BLE001 - any import failure is the same message
    die(f"vLLM is not importable ({type(e).__name__}: {e}); install the CUDA build of vllm")
if not current_platform.is_cuda():
    die(f"this vLLM is not a CUDA build (platform {type(current_platform).__name__}); install the CUDA build of vllm")

from mixrl.models.policy import resolve
from mixrl.sampling.profiles import get_profile
from mixrl.sampling.vllm.formats import detect_platform, vllm_options
from mixrl.sampling.vllm.weights import model_shape

def last_json(text: str) -> dict:
    """The last JSON object a command printed (one line, or indented from a line "{")."""
    lines = text.strip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("{"):
            try:
                return json.loads("\n".join(lines[i:]))
            except ValueError:
                continue
    raise ValueError("no JSON object in the output")


exe = Path(sys.executable).parent / "mixrl"
mixrl = [str(exe)] if exe.exists() else ["mixrl"]
plat = detect_platform()
cap = torch.cuda.get_device_capability(0)
gpu = {"name": torch.cuda.get_device_name(0), "capability": f"{cap[0]}.{cap[1]}", "count": torch.cuda.device_count(),
       "memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
       "torch": torch.__version__, "cuda": torch.version.cuda, "vllm": vllm.__version__}
path = str(resolve(model))
head_dim = int(model_shape(path)["head_dim"])
wanted = ["h100-vllm-fp8", "b200-vllm-nvfp4"]  # FP8 W8A8 + FP8 KV; NVFP4 weights + FP8 KV
runs, skipped = {}, {}
for name in wanted:
    prof = get_profile(name)
    try:
        vllm_options(prof, plat, head_dim=head_dim)  # refuses what this GPU cannot run, with the reason
    except Exception as e:  # noqa: BLE001 - the reason is reported, the other formats still run
        skipped[name] = str(e)
        continue
    run_dir = out / name
    group = f'{{name="{name}", profile="{name}", replicas=1, min_replicas=1, max_replicas=1}}'
    cmd = [*mixrl, "train", "--json", "--no-eval", "--overwrite",
           "--set", f'model.path="{model}"', "--set", f"runtime.steps={steps}",
           "--set", f'observe.run_dir="{run_dir}"', "--set", "runtime.checkpoint_every=0",
           "--set", "observe.tensorboard=false", "--set", "observe.progress=false",
           "--set", "trainer.num_gpus=1", "--set", f"fleet.groups=[{group}]"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    (out / f"{name}.log").write_text(p.stdout + p.stderr)
    if p.returncode != 0:
        tail = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        runs[name] = {"error": f"exit {p.returncode}: {tail}", "log": str(out / f"{name}.log")}
        continue
    s = last_json(p.stdout)
    runs[name] = {k: v for k, v in s.items() if isinstance(v, (int, float, str, bool))}  # the summary's figures
    runs[name]["run_dir"] = str(run_dir)
probe = {}
ok = [n for n in wanted if n not in skipped]
if ok:
    p = subprocess.run([*mixrl, "probe", "--json", "--model", model, "--profiles", ",".join(ok),
                        "--num-prompts", "64"], capture_output=True, text=True)
    (out / "probe.log").write_text(p.stdout + p.stderr)
    if p.returncode == 0:
        probe = last_json(p.stdout)
    else:
        probe = {"error": f"exit {p.returncode}: {(p.stderr.strip().splitlines() or ['(no output)'])[-1]}"}
res = {"gpu": gpu, "runs": runs, "skipped": skipped, "probe": probe, "out": str(out)}
print(json.dumps(res))
sys.exit(0 if runs and all("error" not in r for r in runs.values()) else 1)
PYEOF
