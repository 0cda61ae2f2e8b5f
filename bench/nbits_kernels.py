"""onnxruntime's CPU kernels for one weight matrix, FP32 against 4-bit and 8-bit blocks, at
the widths (rows) a decoder pass runs: which exact form of block-quantized weights is fast.

    python bench/nbits_kernels.py                          # the default model's shapes
    python bench/nbits_kernels.py --shapes 576x1536,576x49152 --threads 2

For each K×N shape, one single-node graph per form, all timed interleaved (median µs of one
run of M rows, M = 1, 2, 4, 8):
- ``fp32``: MatMul over FP32 weights;
- ``q4``: MatMulNBits, 4 bits, blocks of 32, no zero-point input (zero point 8), FP32
  activations (accuracy level 1): the form ``export.gguf_blocks`` writes;
- ``q4-zp``: the same with an explicit uint8 zero-point input;
- ``q4-fzp``: with float zero points (a Q4_1 block's ``m`` held as ``-m/d``, the direct form);
- ``q4-int8act``: 4 bits with int8 activations (accuracy level 4; not FP32's output);
- ``q8``: 8 bits, FP32 activations; ``q8-int8act``: 8 bits, int8 activations.
A small matrix stays in cache when it is run alone, so its FP32 time is far below the time it
takes inside a whole model, where every weight streams from memory; the LM head's shape
(576x49152, 113 MB in FP32) shows the memory-bound case.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

FORMS = ("fp32", "q4", "q4-zp", "q4-fzp", "q4-int8act", "q8", "q8-int8act")


def session(k: int, n: int, form: str, threads: int, rng):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    inits, inputs = [], ["x"]
    if form == "fp32":
        inits.append(numpy_helper.from_array(rng.standard_normal((k, n)).astype(np.float32), "W"))
        node = helper.make_node("MatMul", ["x", "W"], ["y"])
    else:
        bits = 8 if form.startswith("q8") else 4
        blocks = k // 32
        inits += [numpy_helper.from_array(rng.integers(0, 256, (n, blocks, 32 * bits // 8)).astype(np.uint8), "B"),
                  numpy_helper.from_array((rng.standard_normal(n * blocks) * 0.01).astype(np.float32), "S")]
        inputs += ["B", "S"]
        if form == "q4-zp":
            inits.append(numpy_helper.from_array(np.zeros(n * ((blocks + 1) // 2), np.uint8), "Z"))
            inputs.append("Z")
        elif form == "q4-fzp":
            inits.append(numpy_helper.from_array(rng.standard_normal(n * blocks).astype(np.float32), "Z"))
            inputs.append("Z")
        node = helper.make_node("MatMulNBits", inputs, ["y"], domain="com.microsoft", K=k, N=n, bits=bits,
                                block_size=32, accuracy_level=4 if form.endswith("int8act") else 1)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")  # sessions take turns
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="576x1536,1536x576,576x49152", help="KxN, comma-separated")
    ap.add_argument("--forms", default=",".join(FORMS))
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = [int(m) for m in args.rows.split(",")]
    report = {}
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        sessions = {f: session(k, n, f, args.threads, rng) for f in args.forms.split(",")}
        xs = {m: rng.standard_normal((m, k)).astype(np.float32) for m in rows}
        times = {(f, m): [] for f in sessions for m in rows}
        reps = max(3, args.repeats // 10) if n > 10_000 else args.repeats
        for rep in range(reps + 2):
            for f, s in sessions.items():
                for m in rows:
                    t0 = time.perf_counter()
                    s.run(None, {"x": xs[m]})
                    if rep >= 2:
                        times[(f, m)].append((time.perf_counter() - t0) * 1e6)
        report[shape] = {f: {str(m): round(statistics.median(times[(f, m)]), 1) for m in rows} for f in sessions}
        print(f"{shape}: " + "; ".join(f"{f} " + "/".join(str(v) for v in r.values()) for f, r in report[shape].items()),
              flush=True)
    print(json.dumps({"threads": args.threads, "rows": rows, "median_us": report}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
