"""Which MatMuls the portable INT8 graph may quantize: static QDQ INT8 with several node
selections, each compared with the FP32 portable graph on the same texts.

    python bench/experiments/int8_sensitivity.py --engine engines/smollm2-135m-portable

Calibration: the exporter's 32 calibration prompts. Evaluation: three texts (prose, code, a
worked answer) run as one prefill each; reported per selection: the share of positions whose
argmax equals FP32's (top-1) and the largest |Δlogit|. Prints measured numbers only.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

TEXTS = [
    "The capital of France is Paris. It is known for the Eiffel Tower, museums such as the Louvre, and its "
    "cafes. Many tourists visit every year.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "for i in range(10):\n    print(fibonacci(i))",
    "Q: A train travels 60 km in 45 minutes. What is its speed in km/h?\nA: The train travels 60 km in 0.75 "
    "hours, so its speed is 60 / 0.75 = 80 km/h.",
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", type=Path, required=True, help="portable engine folder with an fp32 graph")
    args = ap.parse_args()

    import numpy as np
    import onnx
    import onnxruntime as ort

    from dspark_edge.manifest import read_manifest
    from dspark_edge.tokenizer import Tokenizer
    from dspark_export.portable import io_names, quantize_int8, weight_matmuls

    m = read_manifest(args.engine)
    src = args.engine / "target" / "fp32" / "model.onnx"
    tok = Tokenizer.from_engine(args.engine, m)
    info = m.model
    names = io_names(info.num_layers)[0]
    empty = np.zeros((1, 0, info.num_kv_heads, info.head_dim), dtype=np.float32)
    feeds = lambda ids: {names[0]: np.asarray([ids], dtype=np.int64), **{n: empty for n in names[1:]}}  # noqa: E731
    evals = [tok.encode(t) for t in TEXTS]
    ref = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    ref_logits = [ref.run(["logits"], feeds(ids))[0][0] for ids in evals]
    from dspark_export.target import calibration_prompts

    cal = [tok.encode_chat(messages) for messages in calibration_prompts()]
    graph = onnx.load(str(src), load_external_data=False)
    weights = {i.name for i in graph.graph.initializer}
    all_w = [n.name for n in graph.graph.node if n.op_type == "MatMul" and n.input[1] in weights]
    choices = {
        "every weight MatMul": all_w,
        "all but MLP down-projections": [n for n in all_w if "down_proj" not in n],
        "all but down-projections and LM head (the exporter's choice)": weight_matmuls(src),
    }
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, nodes in choices.items():
            t0 = time.perf_counter()
            dst = Path(tmp) / f"q{len(report)}" / "model.onnx"
            quantize_int8(src, dst, cal, info, nodes=nodes)
            sess = ort.InferenceSession(str(dst), providers=["CPUExecutionProvider"])
            agree, diff = [], 0.0
            for ids, r in zip(evals, ref_logits):
                o = sess.run(["logits"], feeds(ids))[0][0]
                agree.append(float(np.mean(o.argmax(-1) == r.argmax(-1))))
                diff = max(diff, float(np.abs(o - r).max()))
            report[label] = {"quantized_matmuls": len(nodes), "top1_vs_fp32": round(float(np.mean(agree)), 3),
                             "max_abs_logit_diff": round(diff, 2), "seconds": round(time.perf_counter() - t0, 1)}
            print(json.dumps({label: report[label]}), flush=True)
    return 0


if __name__ == "__main__":
    from dspark_edge.cli import run_reporting_errors

    sys.exit(run_reporting_errors(main))
