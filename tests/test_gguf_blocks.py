"""int4 from a GGUF's own Q4_1 blocks (``export.gguf_blocks``): the blocks are read as llama.cpp
writes them, matched to the FP32 graph's weights by value (rows permuted, tensors fused), and
the rewritten graph computes what the FP32 graph computes; weights that are not Q4_1 stay FP32."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
onnx = pytest.importorskip("onnx")

from dspark_edge.errors import ExportError  # noqa: E402
from dspark_export.gguf_blocks import read_q4_1_rows, rewrite_to_gguf_blocks, unpack_q4_1  # noqa: E402

Q4_1 = gguf.GGMLQuantizationType.Q4_1


def _write_gguf(path, tensors: dict[str, tuple[np.ndarray, object]]) -> dict[str, np.ndarray]:
    """A GGUF holding ``tensors`` (name -> (float rows, type)); returns each as the file dequantizes it."""
    w = gguf.GGUFWriter(str(path), "llama")
    back = {}
    for name, (rows, kind) in tensors.items():
        data = gguf.quants.quantize(rows.astype(np.float32), kind)
        w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)
        back[name] = gguf.quants.dequantize(data, kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return back


def test_unpacked_blocks_dequantize_as_gguf_does():
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((5, 96)).astype(np.float32)
    data = gguf.quants.quantize(rows, Q4_1)
    q, d, m = unpack_q4_1(data)
    assert q.shape == (5, 96) and q.max() <= 15 and d.shape == m.shape == (5, 3)
    mine = (d[:, :, None] * q.reshape(5, 3, 32) + m[:, :, None]).reshape(5, 96)
    assert np.array_equal(mine, gguf.quants.dequantize(data, Q4_1))
    with pytest.raises(ExportError, match="not \\[rows, blocks"):
        unpack_q4_1(data[:, :-1])


def _graph(path, weights: dict[str, np.ndarray]) -> None:
    """y = (x·A) ⊙ (x·B) · C: A and B read the same activation (like an MLP's gate and up)."""
    from onnx import TensorProto, helper, numpy_helper

    k = weights["A"].shape[0]
    nodes = [helper.make_node("MatMul", ["x", "A"], ["a"], name="a"),
             helper.make_node("MatMul", ["x", "B"], ["b"], name="b"),
             helper.make_node("Mul", ["a", "b"], ["ab"], name="ab"),
             helper.make_node("MatMul", ["ab", "C"], ["y"], name="c")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "S", k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "S", weights["C"].shape[1]])],
                          [numpy_helper.from_array(w, n) for n, w in weights.items()])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save_model(model, str(path), save_as_external_data=True, location=path.name + ".data", size_threshold=0)


def _run(path, x):
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def test_the_rewritten_graph_computes_the_fp32_graph(tmp_path):
    rng = np.random.default_rng(1)
    k, n = 64, 64
    back = _write_gguf(tmp_path / "m.gguf", {
        "blk.0.attn_q.weight": (rng.standard_normal((40, k)), Q4_1),
        "blk.0.attn_k.weight": (rng.standard_normal((24, k)), Q4_1),
        "blk.0.ffn_up.weight": (rng.standard_normal((n, k)), Q4_1),
        "blk.0.ffn_down.weight": (rng.standard_normal((8, n)), gguf.GGMLQuantizationType.Q8_0)})
    q, kk = back["blk.0.attn_q.weight"], back["blk.0.attn_k.weight"]
    # A: q's rows in another order fused with k's (what transformers makes of q/k), transposed.
    fused = np.concatenate([q[rng.permutation(40)], kk[:24]])
    weights = {"A": fused.T.copy(), "B": back["blk.0.ffn_up.weight"].T.copy(),
               "C": back["blk.0.ffn_down.weight"].T.copy()}  # C: Q8_0, stays FP32
    _graph(tmp_path / "fp32.onnx", weights)
    counts = rewrite_to_gguf_blocks(tmp_path / "fp32.onnx", tmp_path / "m.gguf", tmp_path / "out" / "int4.onnx")
    assert counts == {"matmuls_4bit": 2, "matmuls_fp32": 1, "params_4bit": 2 * k * n}
    model = onnx.load(str(tmp_path / "out" / "int4.onnx"), load_external_data=False)
    ops = [nd.op_type for nd in model.graph.node]
    assert ops.count("MatMulNBits") == 2 and ops.count("ReduceSum") == 1  # one block sum for A and B's input
    assert not {"A", "B"} & {i.name for i in model.graph.initializer}
    x = rng.standard_normal((1, 5, k)).astype(np.float32)
    want, got = _run(tmp_path / "fp32.onnx", x), _run(tmp_path / "out" / "int4.onnx", x)
    assert np.allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_a_gguf_that_is_not_the_graphs_source_is_refused(tmp_path):
    rng = np.random.default_rng(2)
    _write_gguf(tmp_path / "other.gguf", {"w": (rng.standard_normal((32, 64)), Q4_1)})
    _write_gguf(tmp_path / "q8.gguf", {"w": (rng.standard_normal((32, 64)), gguf.GGMLQuantizationType.Q8_0)})
    _graph(tmp_path / "fp32.onnx", {"A": rng.standard_normal((64, 32)).astype(np.float32),
                                    "B": rng.standard_normal((64, 32)).astype(np.float32),
                                    "C": rng.standard_normal((32, 8)).astype(np.float32)})
    with pytest.raises(ExportError, match="not built from this file"):
        rewrite_to_gguf_blocks(tmp_path / "fp32.onnx", tmp_path / "other.gguf", tmp_path / "a.onnx")
    with pytest.raises(ExportError, match="no Q4_1 tensors"):
        rewrite_to_gguf_blocks(tmp_path / "fp32.onnx", tmp_path / "q8.gguf", tmp_path / "b.onnx")
    assert not (tmp_path / "a.onnx").exists() and not (tmp_path / "b.onnx").exists()
    assert read_q4_1_rows(tmp_path / "q8.gguf").q == {}
