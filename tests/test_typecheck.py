"""mypy over the GPU code: the TensorRT backend and engine builder are type-checked against
tensorrt-stubs (TensorRT itself cannot be installed here), the rest of that code's imports
as usual. The generated stubs do not parse as they are (a parameter named ``in``, a required
parameter after defaulted ones, an import of the ``tensorrt_libs`` wheel that only the real
TensorRT installs); the test checks against a copy with exactly those lines mended, none of
which touches an API the project calls."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GPU_CODE = ["dspark_edge/backends/trt.py", "dspark_edge/backends/layout.py", "dspark_edge/backends/ort.py",
            "dspark_export/trt.py"]


def _mend(text: str) -> str:
    text = re.sub(r"([(,]\s*)in:", r"\1in_:", text)
    text = re.sub(r"^import tensorrt_libs as tensorrt_libs$", "", text, flags=re.M)
    lines = []
    for line in text.splitlines():
        m = re.match(r"^(\s*def \w+\()(.*)(\)\s*->.*)$", line)
        if m and "=" in m.group(2):
            params, seen_default = [], False
            for part in m.group(2).split(", "):
                if "=" in part:
                    seen_default = True
                elif seen_default and ":" in part and not part.lstrip().startswith("*"):
                    part += " = ..."
                params.append(part)
            line = m.group(1) + ", ".join(params) + m.group(3)
        lines.append(line)
    return "\n".join(lines) + "\n"


def _patched_stubs(dest: Path) -> Path:
    import importlib.util

    spec = importlib.util.find_spec("tensorrt_bindings")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("tensorrt-stubs is not installed (scripts/env.sh installs it with --no-deps)")
    site = Path(list(spec.submodule_search_locations)[0]).parent
    for pkg in ("tensorrt", "tensorrt_bindings"):
        (dest / pkg).mkdir(parents=True, exist_ok=True)
        for stub in (site / pkg).glob("*.pyi"):
            (dest / pkg / stub.name).write_text(_mend(stub.read_text(encoding="utf-8")), encoding="utf-8")
    return dest


def test_gpu_code_type_checks_against_tensorrt_stubs(tmp_path):
    stubs = _patched_stubs(tmp_path / "stubs")
    assert "def get_workspace_size(self, in_:" in (stubs / "tensorrt_bindings" / "tensorrt.pyi").read_text()
    env = {**os.environ, "MYPYPATH": str(stubs)}
    proc = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", *GPU_CODE], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Success" in proc.stdout


def test_type_check_catches_a_wrong_tensorrt_call(tmp_path):
    """The check is real: a call that does not exist in TensorRT's API fails it."""
    stubs = _patched_stubs(tmp_path / "stubs")
    bad = tmp_path / "bad.py"
    bad.write_text("import tensorrt as trt\n\n"
                   "def f(engine: trt.ICudaEngine) -> None:\n"
                   "    engine.create_execution_context_v7()\n"
                   "    ctx = engine.create_execution_context()\n"
                   "    ctx.set_input_shape('x', 3)\n")
    env = {**os.environ, "MYPYPATH": str(stubs)}
    proc = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", str(bad)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1
    assert "create_execution_context_v7" in proc.stdout
    assert "set_input_shape" in proc.stdout
