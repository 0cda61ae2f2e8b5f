"""A GGUF's own 4-bit blocks in an ONNX graph, without re-quantizing them.

A Q4_1 tensor stores each weight row in blocks of 32: ``w = d·q + m`` with ``q`` in 0…15 and
``d``, ``m`` FP16 per block. onnxruntime's ``MatMulNBits`` holds 4-bit blocks as
``w = s·(q - z)``; with no zero-point input ``z`` is 8, and a float zero point has no fast CPU
kernel. The two forms meet exactly by splitting the product::

    x·W = Σ_b x_b·(d_b·(q_b - 8)) + Σ_b sum(x_b)·(m_b + 8·d_b)

The first term is a ``MatMulNBits`` over the GGUF's own ``q`` and ``d`` (zero point 8, FP32
activations: ``accuracy_level`` 1), the second a matmul 32× smaller over the sums of each
block of 32 activations. Both are computed in FP32, so the result equals the FP32 graph's up to
the order of summation (the FP32 graph's weights are these blocks dequantized).

Which graph weight a GGUF tensor became is found by value, not by name: every output row of an
FP32 ``MatMul`` weight is looked up among the dequantized rows of the GGUF's Q4_1 tensors
(transformers fuses q/k/v, permutes the q and k rows for its rotary layout, and transposes).
A weight whose every row is found is rewritten; the others (the Q8_0 tied embedding / LM head,
norms) stay as they are, in FP32, which is exact for them too.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dspark_edge.errors import ExportError

log = logging.getLogger(__name__)

BLOCK = 32
Q4_1_BYTES = 20  # fp16 d, fp16 m, 16 bytes of packed nibbles
ACCURACY_FP32 = 1  # MatMulNBits accuracy_level: activations stay FP32
# The manifest's exporter["int4_weights"] for a graph made here.
INT4_GGUF_BLOCKS = "the GGUF's own Q4_1 blocks, FP32 activations"


@dataclass(frozen=True)
class Q4Rows:
    """The Q4_1 rows of a GGUF file: per row, its 4-bit values and block constants."""

    q: dict[str, np.ndarray]  # tensor name -> [rows, K] uint8 in 0..15
    d: dict[str, np.ndarray]  # tensor name -> [rows, K/32] float32
    m: dict[str, np.ndarray]  # tensor name -> [rows, K/32] float32
    index: dict[bytes, tuple[str, int]]  # digest of a dequantized row -> (tensor, row)


def _digest(row: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(row, dtype=np.float32).tobytes(), digest_size=16).digest()


def unpack_q4_1(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_1 tensor's bytes [rows, K/32·20] → (q [rows, K] 0..15, d, m [rows, K/32] float32).

    Within a block, byte j holds element j in its low nibble and element j+16 in its high one."""
    rows = raw.shape[0]
    if raw.ndim != 2 or raw.shape[1] % Q4_1_BYTES:
        raise ExportError(f"a Q4_1 tensor's data has shape {raw.shape}, not [rows, blocks·{Q4_1_BYTES}]")
    blocks = raw.reshape(rows, -1, Q4_1_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [rows, blocks, 32] in element order
    return q.reshape(rows, -1), d, m


def read_q4_1_rows(gguf_path: Path) -> Q4Rows:
    """Every Q4_1 tensor of ``gguf_path``, unpacked and indexed by its dequantized rows."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    qs, ds, ms, index = {}, {}, {}, {}
    for t in reader.tensors:
        if t.tensor_type != gguf.GGMLQuantizationType.Q4_1:
            continue
        q, d, m = unpack_q4_1(np.asarray(t.data))
        rows = d[:, :, None] * q.reshape(q.shape[0], -1, BLOCK) + m[:, :, None]  # what the loader computes
        for i, row in enumerate(rows.reshape(q.shape[0], -1)):
            index.setdefault(_digest(row), (t.name, i))
        qs[t.name], ds[t.name], ms[t.name] = q, d, m
    return Q4Rows(qs, ds, ms, index)


def _pack_nbits(q: np.ndarray) -> np.ndarray:
    """[N, K] values 0..15 → MatMulNBits' B [N, K/32, 16]: element 2i low nibble, 2i+1 high."""
    n, k = q.shape
    pairs = q.reshape(n, k // BLOCK, BLOCK // 2, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).astype(np.uint8)


def _match(weight: np.ndarray, rows: Q4Rows) -> list[tuple[str, int]] | None:
    """For an FP32 MatMul weight [K, N], the GGUF row behind each of its N columns, or None."""
    found = []
    for col in weight.T:
        hit = rows.index.get(_digest(col))
        if hit is None:
            return None
        found.append(hit)
    return found


def rewrite_to_gguf_blocks(fp32_model: Path, gguf_path: Path, out_model: Path,
                           say: Callable[[str], None] | None = None) -> dict[str, int]:
    """Write ``out_model``: the FP32 graph at ``fp32_model`` with every MatMul whose weight is a
    GGUF Q4_1 tensor computed from that tensor's own blocks. Returns counts for the manifest.

    Raises ExportError when the GGUF has no Q4_1 tensor that the graph uses."""
    import onnx
    from onnx import helper, numpy_helper

    say = say or (lambda msg: log.info("%s", msg))
    rows = read_q4_1_rows(gguf_path)
    if not rows.q:
        raise ExportError(f"{gguf_path.name} has no Q4_1 tensors: an exact 4-bit engine needs a Q4_1 GGUF "
                          "(other files: export int4 from a Hugging Face folder, which re-quantizes)")
    model = onnx.load(str(fp32_model), load_external_data=True)
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    new_nodes, dropped, added = [], set(), []
    block_sums: dict[str, str] = {}  # activation name -> its [.., K/32] block sums
    counts = {"matmuls_4bit": 0, "matmuls_fp32": 0, "params_4bit": 0}
    for node in graph.node:
        weight = inits.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if weight is None or len(weight.dims) != 2:
            new_nodes.append(node)
            continue
        w = numpy_helper.to_array(weight)
        k, n = w.shape
        hits = _match(w, rows) if k % BLOCK == 0 else None
        if hits is None:
            counts["matmuls_fp32"] += 1
            new_nodes.append(node)
            continue
        q = np.stack([rows.q[t][i] for t, i in hits])  # [N, K]
        d = np.stack([rows.d[t][i] for t, i in hits])  # [N, K/32]
        m = np.stack([rows.m[t][i] for t, i in hits])
        base = weight.name
        b_name, s_name, c_name = f"{base}.q4", f"{base}.q4_scales", f"{base}.q4_block_offsets"
        added += [numpy_helper.from_array(_pack_nbits(q), b_name),
                  numpy_helper.from_array(d.reshape(-1).astype(np.float32), s_name),
                  numpy_helper.from_array((m + 8.0 * d).T.astype(np.float32).copy(), c_name)]  # [K/32, N]
        x, y, tag = node.input[0], node.output[0], node.name or base
        new_nodes.append(helper.make_node("MatMulNBits", [x, b_name, s_name], [f"{tag}/q4_out"], name=f"{tag}/q4",
                                          domain="com.microsoft", K=k, N=n, bits=4, block_size=BLOCK,
                                          accuracy_level=ACCURACY_FP32))
        if x not in block_sums:  # one per activation: e.g. the MLP's gate and up read the same one
            stem = f"{tag}/input"
            shape_name, axes_name = f"{base}.block_shape", f"{base}.block_axes"
            added += [numpy_helper.from_array(np.array([0, 0, k // BLOCK, BLOCK], np.int64), shape_name),
                      numpy_helper.from_array(np.array([-1], np.int64), axes_name)]
            new_nodes += [
                helper.make_node("Reshape", [x, shape_name], [f"{stem}_blocks"], name=f"{stem}_blocks"),
                helper.make_node("ReduceSum", [f"{stem}_blocks", axes_name], [f"{stem}_block_sums"],
                                 name=f"{stem}_block_sums", keepdims=0)]
            block_sums[x] = f"{stem}_block_sums"
        new_nodes += [
            helper.make_node("MatMul", [block_sums[x], c_name], [f"{tag}/offsets"], name=f"{tag}/offsets"),
            helper.make_node("Add", [f"{tag}/q4_out", f"{tag}/offsets"], [y], name=f"{tag}/sum")]
        dropped.add(base)
        counts["matmuls_4bit"] += 1
        counts["params_4bit"] += k * n
    if not counts["matmuls_4bit"]:
        raise ExportError(f"no weight of the graph matches a Q4_1 tensor of {gguf_path.name}: the graph was "
                          "not built from this file")
    still_used = {i for nd in new_nodes for i in nd.input}
    keep = [i for i in graph.initializer if i.name not in dropped or i.name in still_used]
    del graph.initializer[:]
    graph.initializer.extend(keep + added)
    del graph.node[:]
    graph.node.extend(new_nodes)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    out_model.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(out_model), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=out_model.name + ".data", size_threshold=1024)
    for made, like in ((out_model, fp32_model), (out_model.with_name(out_model.name + ".data"), fp32_model)):
        shutil.copymode(like, made)  # onnx writes its weights file owner-only; keep the FP32 graph's mode
    say(f"      {counts['matmuls_4bit']} matmuls from the GGUF's Q4_1 blocks "
        f"({counts['params_4bit'] / 1e6:.1f}M weights), {counts['matmuls_fp32']} kept in FP32")
    return counts
