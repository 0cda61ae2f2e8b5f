"""int4 from a GGUF's own blocks (``export.gguf_blocks``): Q4_1 and Q8_0 blocks are read as
llama.cpp writes them, matched to the FP32 graph's weights by value (rows permuted, tensors
fused, a transposed embedding table), and the rewritten graph computes what the FP32 graph
computes; weights the GGUF does not hold stay FP32."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
onnx = pytest.importorskip("onnx")

from dspark_edge.errors import ExportError
from dspark_export import gguf_blocks
from dspark_export.gguf_blocks import (
    read_gguf_rows,
    rewrite_to_gguf_blocks,
    unpack_q4_1,
    unpack_q8_0,
)

Q4_1 = gguf.GGMLQuantizationType.Q4_1
Q8_0 = gguf.GGMLQuantizationType.Q8_0


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
    data = gguf.quants.quantize(rows, Q8_0)
    q, d = unpack_q8_0(data)
    assert q.dtype == np.int8 and q.min() < 0
    assert np.array_equal((d[:, :, None] * q.reshape(5, 3, 32)).reshape(5, 96), gguf.quants.dequantize(data, Q8_0))


def _graph(path, weights: dict[str, np.ndarray]) -> None:
    """y = (x·A) ⊙ (x·B) · C (A and B read the same activation, like an MLP's gate and up),
    z = x·D, and e = the rows ``ids`` of the transpose of Et (an embedding tied to a head)."""
    from onnx import TensorProto, helper, numpy_helper

    k = weights["A"].shape[0]
    f32 = TensorProto.FLOAT
    nodes = [helper.make_node("MatMul", ["x", "A"], ["a"], name="a"),
             helper.make_node("MatMul", ["x", "B"], ["b"], name="b"),
             helper.make_node("Mul", ["a", "b"], ["ab"], name="ab"),
             helper.make_node("MatMul", ["ab", "C"], ["y"], name="c"),
             helper.make_node("MatMul", ["x", "D"], ["z"], name="d"),
             helper.make_node("Transpose", ["Et"], ["E"], name="t", perm=[1, 0]),
             helper.make_node("Gather", ["E", "ids"], ["e"], name="embed")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", f32, [1, "S", k]),
                                       helper.make_tensor_value_info("ids", TensorProto.INT64, [1, "S"])],
                          [helper.make_tensor_value_info("y", f32, [1, "S", weights["C"].shape[1]]),
                           helper.make_tensor_value_info("z", f32, [1, "S", weights["D"].shape[1]]),
                           helper.make_tensor_value_info("e", f32, [1, "S", weights["Et"].shape[0]])],
                          [numpy_helper.from_array(w, n) for n, w in weights.items()])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save_model(model, str(path), save_as_external_data=True, location=path.name + ".data", size_threshold=0)


def _run(path, feeds):
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)


def _weights(rng, back, k=64):
    return {"A": np.concatenate([back["q"][rng.permutation(40)], back["k"]]).T.copy(),  # q's rows permuted, fused
            "B": back["up"].T.copy(), "C": back["down"].T.copy(),
            "D": rng.standard_normal((k, 16)).astype(np.float32),  # in no GGUF: stays FP32
            "Et": back["embd"].T.copy()}


def test_the_rewritten_graph_computes_the_fp32_graph(tmp_path):
    rng = np.random.default_rng(1)
    k = n = 64
    back = _write_gguf(tmp_path / "m.gguf", {
        "q": (rng.standard_normal((40, k)), Q4_1), "k": (rng.standard_normal((24, k)), Q4_1),
        "up": (rng.standard_normal((n, k)), Q4_1), "down": (rng.standard_normal((8, n)), Q8_0),
        "embd": (rng.standard_normal((50, k)) * 0.1, Q8_0)})
    _graph(tmp_path / "fp32.onnx", _weights(rng, back))
    counts = rewrite_to_gguf_blocks(tmp_path / "fp32.onnx", tmp_path / "m.gguf", tmp_path / "out" / "int4.onnx")
    assert counts == {"matmuls_4bit": 2, "matmuls_8bit": 1, "matmuls_fp32": 1, "params_4bit": 2 * k * n,
                      "gathers_8bit": 1}
    model = onnx.load(str(tmp_path / "out" / "int4.onnx"), load_external_data=False)
    nbits = [nd for nd in model.graph.node if nd.op_type == "MatMulNBits"]
    accuracy = sorted((next(a.i for a in nd.attribute if a.name == "bits"),
                       next(a.i for a in nd.attribute if a.name == "accuracy_level")) for nd in nbits)
    assert accuracy == [(4, 1), (4, 1), (8, 4)]  # A, B with FP32 activations; C (Q8_0) by the int8 kernel
    ops = [nd.op_type for nd in model.graph.node]
    assert ops.count("Transpose") == 0 and ops.count("Round") == 2  # C's input in 3 pieces
    assert ops.count("ReduceSum") == 2  # one block sum for A and B's input, one sum of C's pieces
    # D is in no GGUF; the embedding reads int8 rows, not Et.
    assert {i.name for i in model.graph.initializer} & {"A", "B", "C", "D", "Et"} == {"D"}
    feeds = {"x": rng.standard_normal((1, 5, k)).astype(np.float32), "ids": np.array([[0, 7, 49, 7, 3]])}
    for want, got in zip(_run(tmp_path / "fp32.onnx", feeds), _run(tmp_path / "out" / "int4.onnx", feeds)):
        assert np.allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert np.array_equal(_run(tmp_path / "out" / "int4.onnx", feeds)[2], _run(tmp_path / "fp32.onnx", feeds)[2])


def _two_matmuls(path, w: np.ndarray, other: np.ndarray) -> None:
    """y = x·W and z = x·other."""
    from onnx import TensorProto, helper, numpy_helper

    f32 = TensorProto.FLOAT
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"], name="w"),
                           helper.make_node("MatMul", ["x", "O"], ["z"], name="o")], "g",
                          [helper.make_tensor_value_info("x", f32, [1, "S", w.shape[0]])],
                          [helper.make_tensor_value_info("y", f32, [1, "S", w.shape[1]]),
                           helper.make_tensor_value_info("z", f32, [1, "S", other.shape[1]])],
                          [numpy_helper.from_array(w, "W"), numpy_helper.from_array(other, "O")])
    onnx.save_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_activations_in_int8_pieces_reach_fp32s_precision_with_three(tmp_path, monkeypatch, kind):
    """The int8 kernel over 2 and 3 pieces of an activation (heavy-tailed, as a transformer's):
    the third piece divides the error by a large factor, and three pieces are as close to the
    exact product as FP32's own matmul is (a Q4_1 matmul with --int4-activations int8x2 / int8x3,
    a Q8_0 head with HEAD_PIECES)."""
    rng = np.random.default_rng(3)
    k, n = 256, 96
    back = _write_gguf(tmp_path / "m.gguf", {"w": (rng.standard_normal((n, k)), Q4_1 if kind == "q4_1" else Q8_0),
                                             "other": (rng.standard_normal((32, k)), Q4_1)})
    _two_matmuls(tmp_path / "fp32.onnx", back["w"].T.copy(), back["other"].T.copy())
    x = (rng.standard_normal((1, 6, k)) * np.exp(2 * rng.standard_normal(k))).astype(np.float32)
    exact = x.astype(np.float64) @ back["w"].T.astype(np.float64)
    scale = np.abs(exact).max()
    fp32_err = np.abs(_run(tmp_path / "fp32.onnx", {"x": x})[0] - exact).max() / scale
    errs = {}
    for pieces in (2, 3):
        out = tmp_path / f"p{pieces}" / "m.onnx"
        monkeypatch.setattr(gguf_blocks, "HEAD_PIECES", pieces)
        counts = rewrite_to_gguf_blocks(tmp_path / "fp32.onnx", tmp_path / "m.gguf", out,
                                        pieces=pieces if kind == "q4_1" else 1)
        assert (counts["matmuls_4bit"], counts["matmuls_8bit"]) == ((2, 0) if kind == "q4_1" else (1, 1))
        ops = [nd.op_type for nd in onnx.load(str(out), load_external_data=False).graph.node]
        assert ops.count("Round") == pieces - 1  # x split once (both Q4_1 matmuls read it), or for the head alone
        errs[pieces] = np.abs(_run(out, {"x": x})[0] - exact).max() / scale
    assert errs[2] < 1e-4 and errs[3] < errs[2] / 20, errs
    assert errs[3] < 4 * fp32_err + 1e-7, (errs, fp32_err)


def test_a_gguf_that_is_not_the_graphs_source_is_refused(tmp_path):
    rng = np.random.default_rng(2)
    _write_gguf(tmp_path / "other.gguf", {"w": (rng.standard_normal((32, 64)), Q4_1)})
    _write_gguf(tmp_path / "q8.gguf", {"w": (rng.standard_normal((32, 64)), Q8_0)})
    weights = {"A": rng.standard_normal((64, 32)), "B": rng.standard_normal((64, 32)), "C": rng.standard_normal((32, 8)),
               "D": rng.standard_normal((64, 4)), "Et": rng.standard_normal((64, 10))}
    _graph(tmp_path / "fp32.onnx", {n: w.astype(np.float32) for n, w in weights.items()})
    with pytest.raises(ExportError, match="not built from this file"):
        rewrite_to_gguf_blocks(tmp_path / "fp32.onnx", tmp_path / "other.gguf", tmp_path / "a.onnx")
    with pytest.raises(ExportError, match="no Q4_1 tensors"):
        rewrite_to_gguf_blocks(tmp_path / "fp32.onnx", tmp_path / "q8.gguf", tmp_path / "b.onnx")
    assert not (tmp_path / "a.onnx").exists() and not (tmp_path / "b.onnx").exists()
    assert set(read_gguf_rows(tmp_path / "q8.gguf").kind.values()) == {"q8_0"}
