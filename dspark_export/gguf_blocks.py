"""A GGUF's own quantized blocks in an ONNX graph, without re-quantizing them.

Q4_1 stores each weight row in blocks of 32: ``w = d·q + m`` with ``q`` in 0…15 and ``d``,
``m`` FP16 per block. onnxruntime's ``MatMulNBits`` holds 4-bit blocks as ``w = s·(q - z)``;
with no zero-point input ``z`` is 8, and a float zero point has no fast CPU kernel. The two
forms meet exactly by splitting the product::

    x·W = Σ_b x_b·(d_b·(q_b - 8)) + Σ_b sum(x_b)·(m_b + 8·d_b)

The first term is a ``MatMulNBits`` over the GGUF's own ``q`` and ``d`` (zero point 8, FP32
activations: ``accuracy_level`` 1), the second a matmul 32× smaller over the sums of each block
of 32 activations (computed once per activation that several weights read).

Q8_0 (``w = d·q``, ``q`` int8; the tied embedding / LM head of the default model): a
``Gather`` from such a table (the embedding) reads its int8 rows and scales them, ``d·q`` being
exact in FP32. A ``MatMul`` over it (the LM head) becomes an 8-bit ``MatMulNBits`` (``q + 128``,
zero point 128) run by the int8 kernel over the activation split into pieces (below): onnxruntime
has no fast 8-bit kernel with FP32 activations, and the FP32 head is the largest single weight
read at width 1 (docs/performance.md, "INT4 from the GGUF's blocks").

Activations in int8 pieces. The int8 kernels (``accuracy_level`` 4) quantize each block of 32
activations to ``s·round(x/s)`` with ``s = max|x_b| / 127``. The graph splits an activation into
``p`` pieces first: each piece but the last is that quantization of what the pieces before it
leave (exactly ``s·q`` with ``q`` an int8, so the kernel keeps it unchanged); the last is the
remainder, at most ``max|x_b| / 254^(p-1)`` per element and the only piece the kernel rounds, so
the error of the sum is at most ``max|x_b| / 254^p``. Three pieces put that at FP32's own
rounding (254^-3 is 6.1e-8 of the block's largest element, 2^-24 is 6.0e-8 of each element).
The pieces run as extra rows of one kernel call and are summed after it.

Every term is computed in FP32 (or exactly, in integers), so the result equals the FP32 graph's
up to the order of summation (the FP32 graph's weights are these blocks dequantized). Which graph weight a GGUF
tensor became is found by value, not by name: every output row of a ``MatMul`` weight (every
row of a ``Gather`` table) is looked up among the dequantized rows of the GGUF's tensors
(transformers fuses q/k/v, permutes the q and k rows for its rotary layout, and transposes).
A weight whose rows are not all found stays as it is, in FP32.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dspark_edge.errors import ExportError

log = logging.getLogger(__name__)

BLOCK = 32
Q4_1_BYTES = 20  # fp16 d, fp16 m, 16 bytes of packed nibbles
Q8_0_BYTES = 34  # fp16 d, 32 int8
ACCURACY_FP32 = 1  # MatMulNBits accuracy_level: activations stay FP32
ACCURACY_INT8 = 4  # MatMulNBits accuracy_level: activations quantized to int8 per block of 32
# The manifest's exporter["int4_weights"] for a graph made here.
INT4_GGUF_BLOCKS = ("the GGUF's own Q4_1 blocks, FP32 activations; Q8_0 LM head, activations as 3 int8 "
                    "pieces (FP32's precision)")
# --int4-activations: the pieces each activation reaches a 4-bit kernel in (1: FP32, that kernel's
# FP32-activation form); the 8-bit head always takes HEAD_PIECES, FP32's precision.
INT4_ACTIVATIONS = {"fp32": 1, "int8x2": 2, "int8x3": 3}
HEAD_PIECES = 3
# Piece counts at FP32's precision: FP32 activations themselves, or three int8 pieces (above).
FP32_PIECES = (1, 3)


def int4_weights_note(pieces: int) -> str:
    """The manifest's exporter["int4_weights"] for a graph made with ``pieces``."""
    if pieces == 1:
        return INT4_GGUF_BLOCKS
    return (f"the GGUF's own Q4_1 blocks, activations as {pieces} int8 pieces; Q8_0 LM head, "
            f"activations as {HEAD_PIECES} int8 pieces")


@dataclass
class GGUFRows:
    """The Q4_1 and Q8_0 rows of a GGUF file: per tensor its values and block constants, and an
    index from each dequantized row to where it is."""

    kind: dict[str, str] = field(default_factory=dict)  # tensor -> "q4_1" | "q8_0"
    q: dict[str, np.ndarray] = field(default_factory=dict)  # [rows, K]: uint8 0..15 (q4_1) or int8
    d: dict[str, np.ndarray] = field(default_factory=dict)  # [rows, K/32] float32
    m: dict[str, np.ndarray] = field(default_factory=dict)  # [rows, K/32] float32 (q4_1 only)
    index: dict[bytes, tuple[str, int]] = field(default_factory=dict)

    def add(self, name: str, kind: str, q: np.ndarray, d: np.ndarray, m: np.ndarray | None) -> None:
        rows = d[:, :, None] * q.reshape(q.shape[0], -1, BLOCK).astype(np.float32)  # what the loader computes
        if m is not None:
            rows = rows + m[:, :, None]
        for i, row in enumerate(rows.reshape(q.shape[0], -1)):
            self.index.setdefault(_digest(row), (name, i))
        self.kind[name], self.q[name], self.d[name] = kind, q, d
        if m is not None:
            self.m[name] = m

    def match(self, rows: np.ndarray) -> list[tuple[str, int]] | None:
        """The GGUF row behind each of ``rows`` (all of one kind), or None."""
        found = []
        for row in rows:
            hit = self.index.get(_digest(row))
            if hit is None or (found and self.kind[hit[0]] != self.kind[found[0][0]]):
                return None
            found.append(hit)
        return found

    def gather(self, hits: list[tuple[str, int]]):
        """(kind, q, d, m) stacked in the order of ``hits``."""
        kind = self.kind[hits[0][0]]
        stack = lambda table: np.stack([table[t][i] for t, i in hits])
        return kind, stack(self.q), stack(self.d), stack(self.m) if kind == "q4_1" else None


def _digest(row: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(row, dtype=np.float32).tobytes(), digest_size=16).digest()


def _split_blocks(raw: np.ndarray, size: int, kind: str) -> np.ndarray:
    if raw.ndim != 2 or raw.shape[1] % size:
        raise ExportError(f"a {kind} tensor's data has shape {raw.shape}, not [rows, blocks·{size}]")
    return raw.reshape(raw.shape[0], -1, size)


def _fp16(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def unpack_q4_1(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_1 tensor's bytes [rows, K/32·20] → (q [rows, K] 0..15, d, m [rows, K/32] float32).

    Within a block, byte j holds element j in its low nibble and element j+16 in its high one."""
    blocks = _split_blocks(raw, Q4_1_BYTES, "Q4_1")
    qs = blocks[..., 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [rows, blocks, 32] in element order
    return q.reshape(raw.shape[0], -1), _fp16(blocks, 0), _fp16(blocks, 2)


def unpack_q8_0(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A Q8_0 tensor's bytes [rows, K/32·34] → (q [rows, K] int8, d [rows, K/32] float32)."""
    blocks = _split_blocks(raw, Q8_0_BYTES, "Q8_0")
    return blocks[..., 2:].copy().view(np.int8).reshape(raw.shape[0], -1), _fp16(blocks, 0)


def read_gguf_rows(gguf_path: Path) -> GGUFRows:
    """Every Q4_1 and Q8_0 tensor of ``gguf_path``, unpacked and indexed by its dequantized rows."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    rows = GGUFRows()
    for t in reader.tensors:
        if t.tensor_type == gguf.GGMLQuantizationType.Q4_1:
            rows.add(t.name, "q4_1", *unpack_q4_1(np.asarray(t.data)))
        elif t.tensor_type == gguf.GGMLQuantizationType.Q8_0:
            rows.add(t.name, "q8_0", *unpack_q8_0(np.asarray(t.data)), None)
    return rows


def _pack_nbits(q: np.ndarray) -> np.ndarray:
    """[N, K] values 0..15 → MatMulNBits' B [N, K/32, 16]: element 2i low nibble, 2i+1 high."""
    n, k = q.shape
    pairs = q.reshape(n, k // BLOCK, BLOCK // 2, 2).astype(np.uint8)
    return pairs[..., 0] | (pairs[..., 1] << 4)


class _Rewriter:
    """Collects the nodes and initializers of the rewritten graph."""

    def __init__(self, pieces: int, head_pieces: int, opset: int) -> None:
        from onnx import helper, numpy_helper

        self.helper, self.numpy_helper = helper, numpy_helper
        self.nodes: list = []
        self.added: list = []
        self.block_sums: dict[str, str] = {}  # activation -> its [.., K/32] block sums
        self.split_of: dict[tuple[str, int], str] = {}  # (activation, pieces) -> [pieces, .., K]
        self.pieces, self.head_pieces = pieces, head_pieces
        self.opset = opset  # ReduceMax takes its axes as an input from opset 18 on

    def const(self, name: str, value: np.ndarray) -> str:
        self.added.append(self.numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def node(self, op: str, inputs: list[str], output: str, **attrs) -> str:
        domain = "com.microsoft" if op == "MatMulNBits" else ""
        self.nodes.append(self.helper.make_node(op, inputs, [output], name=output, domain=domain, **attrs))
        return output

    def sums(self, x: str, k: int, tag: str) -> str:
        """The block sums of activation ``x`` ([batch, seq, K], as the builder's graphs have them;
        another rank fails validation rather than passing silently)."""
        if x not in self.block_sums:  # one per activation: e.g. the MLP's gate and up read the same one
            blocks = self.node("Reshape", [x, self.const(f"{tag}.block_shape", np.array([0, 0, k // BLOCK, BLOCK]))],
                               f"{tag}/input_blocks")
            self.block_sums[x] = self.node("ReduceSum", [blocks, self.const(f"{tag}.block_axes", np.array([-1]))],
                                           f"{tag}/input_block_sums", keepdims=0)
        return self.block_sums[x]

    def split(self, x: str, k: int, tag: str, pieces: int) -> str:
        """``x`` ([batch, seq, K]) as ``pieces`` stacked on a new first axis, each block of 32 of
        every piece but the last exactly ``s·q`` with ``q`` an int8 and ``s = max|block| / 127``
        (what the int8 kernel's own block quantization reproduces), the last the remainder. The
        pieces sum to ``x`` exactly in FP32; the kernel quantizes only the remainder, whose
        error is ``max|x_b| / 254^pieces`` at most."""
        if (x, pieces) not in self.split_of:
            # Blocks as [1, batch, seq, K/32, 32]: the pieces then stack on the first axis as they are.
            lifted = self.node("Unsqueeze", [x, self.const(f"{tag}.split_axis", np.array([0]))], f"{tag}/lifted")
            shape = self.const(f"{tag}.split_shape", np.array([0, 0, 0, k // BLOCK, BLOCK]))
            blocks = self.node("Reshape", [lifted, shape], f"{tag}/split_blocks")
            axes = self.const(f"{tag}.split_axes", np.array([-1]))
            tiny = self.const(f"{tag}.tiny", np.array(1e-30, np.float32))  # an all-zero block: scale 0
            int8_max = self.const(f"{tag}.int8_max", np.array(127.0, np.float32))
            parts, rest = [], blocks
            for i in range(pieces - 1):
                magnitude = self.node("Abs", [rest], f"{tag}/abs{i}")
                if self.opset >= 18:
                    top = self.node("ReduceMax", [magnitude, axes], f"{tag}/max{i}", keepdims=1)
                else:
                    top = self.node("ReduceMax", [magnitude], f"{tag}/max{i}", keepdims=1, axes=[-1])
                top = self.node("Max", [top, tiny], f"{tag}/max{i}_nz")
                scale = self.node("Div", [top, int8_max], f"{tag}/scale{i}")
                part = self.node("Mul", [self.node("Round", [self.node("Div", [rest, scale], f"{tag}/scaled{i}")],
                                                   f"{tag}/int{i}"), scale], f"{tag}/piece{i}")
                rest = self.node("Sub", [rest, part], f"{tag}/rest{i}")
                parts.append(part)
            parts.append(rest)
            stacked = self.node("Concat", parts, f"{tag}/stacked_blocks", axis=0)
            shape = self.const(f"{tag}.pieces_shape", np.array([0, 0, 0, k]))
            self.split_of[(x, pieces)] = self.node("Reshape", [stacked, shape], f"{tag}/pieces")
        return self.split_of[(x, pieces)]

    def nbits(self, x: str, tag: str, packed: np.ndarray, scales: np.ndarray, n: int, k: int, bits: int,
              pieces: int) -> str:
        """``MatMulNBits`` over ``x``: FP32 activations with one piece, else the int8 kernel over
        ``x``'s pieces, summed."""
        inputs = [self.const(f"{tag}.q{bits}", packed), self.const(f"{tag}.q{bits}_scales", scales)]
        if pieces == 1:
            return self.node("MatMulNBits", [x, *inputs], f"{tag}/q{bits}_out", K=k, N=n, bits=bits,
                             block_size=BLOCK, accuracy_level=ACCURACY_FP32)
        each = self.node("MatMulNBits", [self.split(x, k, tag, pieces), *inputs], f"{tag}/q{bits}_pieces", K=k, N=n,
                         bits=bits, block_size=BLOCK, accuracy_level=ACCURACY_INT8)
        return self.node("ReduceSum", [each, self.const(f"{tag}.piece_axis", np.array([0]))], f"{tag}/q{bits}_out",
                         keepdims=0)

    def matmul(self, x: str, y: str, tag: str, q: np.ndarray, d: np.ndarray, m: np.ndarray) -> None:
        """``y = x·W`` for the Q4_1 rows (q, d, m) of W's N output columns, each of K inputs."""
        n, k = q.shape
        out = self.nbits(x, tag, _pack_nbits(q), d.reshape(-1).astype(np.float32), n, k, 4, self.pieces)
        fix = self.node("MatMul", [self.sums(x, k, tag), self.const(f"{tag}.q4_block_offsets",
                                                                    (m + 8.0 * d).T.astype(np.float32))], f"{tag}/offsets")
        self.nodes.append(self.helper.make_node("Add", [out, fix], [y], name=f"{tag}/sum"))

    def matmul_q8_0(self, x: str, y: str, tag: str, q: np.ndarray, d: np.ndarray) -> None:
        """``y = x·W`` for Q8_0 rows: 8-bit blocks with zero point 128 (``q + 128``)."""
        n, k = q.shape
        codes = (q.astype(np.int16) + 128).astype(np.uint8).reshape(n, k // BLOCK, BLOCK)
        out = self.nbits(x, tag, codes, d.reshape(-1).astype(np.float32), n, k, 8, self.head_pieces)
        self.nodes.append(self.helper.make_node("Identity", [out], [y], name=f"{tag}/q8"))

    def gather_q8_0(self, ids: str, y: str, tag: str, q: np.ndarray, d: np.ndarray) -> None:
        """``y = table[ids]`` for a Q8_0 table: its int8 rows times their block scales."""
        v, k = q.shape
        rows = self.node("Cast", [self.node("Gather", [self.const(f"{tag}.q8", q), ids], f"{tag}/q8_rows")],
                         f"{tag}/q8_rows_f32", to=1)
        blocks = self.node("Reshape", [rows, self.const(f"{tag}.block_shape", np.array([0, 0, k // BLOCK, BLOCK]))],
                           f"{tag}/blocks")
        scales = self.node("Gather", [self.const(f"{tag}.q8_scales", d.reshape(v, -1, 1).astype(np.float32)), ids],
                           f"{tag}/scales")
        scaled = self.node("Mul", [blocks, scales], f"{tag}/scaled")
        self.nodes.append(self.helper.make_node("Reshape", [scaled, self.const(f"{tag}.shape", np.array([0, 0, k]))],
                                                [y], name=f"{tag}/rows"))


def _table_of(node, inits: dict, producers: dict) -> tuple[str, bool] | None:
    """A Gather's table as (initializer name, transposed), when it is a 2-D initializer or its
    transpose."""
    data = node.input[0]
    if data in inits:
        return (data, False) if len(inits[data].dims) == 2 else None
    src = producers.get(data)
    if src is not None and src.op_type == "Transpose" and src.input[0] in inits:
        perm = [list(a.ints) for a in src.attribute if a.name == "perm"]
        if perm in ([], [[1, 0]]) and len(inits[src.input[0]].dims) == 2:
            return src.input[0], True
    return None


def _prune(graph) -> None:
    """Drop nodes nothing reads (e.g. the transpose that fed a replaced embedding) and unused initializers."""
    outputs = {o.name for o in graph.output}
    while True:
        read = {i for nd in graph.node for i in nd.input} | outputs
        dead = [nd for nd in graph.node if not any(o in read for o in nd.output)]
        if not dead:
            break
        for nd in dead:
            graph.node.remove(nd)
    read = {i for nd in graph.node for i in nd.input} | outputs
    keep = [i for i in graph.initializer if i.name in read]
    del graph.initializer[:]
    graph.initializer.extend(keep)


def rewrite_to_gguf_blocks(fp32_model: Path, gguf_path: Path, out_model: Path,
                           say: Callable[[str], None] | None = None, pieces: int = 1) -> dict[str, int]:
    """Write ``out_model``: the FP32 graph at ``fp32_model`` with every MatMul whose weight is a
    GGUF Q4_1 or Q8_0 tensor, and every Gather from a Q8_0 table, computed from that tensor's own
    blocks. ``pieces``: the 4-bit matmuls' activations stay FP32 (1) or reach the int8 kernel in
    that many pieces; a Q8_0 matmul's always in ``HEAD_PIECES``. Returns counts for the manifest.

    Raises ExportError when the GGUF has no Q4_1 tensor that the graph uses."""
    import onnx
    from onnx import numpy_helper

    say = say or (lambda msg: log.info("%s", msg))
    rows = read_gguf_rows(gguf_path)
    if "q4_1" not in rows.kind.values():
        raise ExportError(f"{gguf_path.name} has no Q4_1 tensors: an exact 4-bit engine needs a Q4_1 GGUF "
                          "(other files: export int4 from a Hugging Face folder, which re-quantizes)")
    model = onnx.load(str(fp32_model), load_external_data=True)
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    producers = {o: nd for nd in graph.node for o in nd.output}
    matched: dict[tuple[str, bool], list[tuple[str, int]] | None] = {}

    def hits_of(name: str, transposed: bool) -> list[tuple[str, int]] | None:
        """The GGUF rows behind an initializer's rows (its columns when ``transposed``), matched
        once: a tied embedding and LM head are one initializer read by a Gather and a MatMul."""
        if (name, transposed) not in matched:
            w = numpy_helper.to_array(inits[name])
            table = w.T if transposed else w
            matched[(name, transposed)] = rows.match(table) if table.shape[1] % BLOCK == 0 else None
        return matched[(name, transposed)]

    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
    out = _Rewriter(pieces, HEAD_PIECES, opset)
    counts = {"matmuls_4bit": 0, "matmuls_8bit": 0, "matmuls_fp32": 0, "params_4bit": 0, "gathers_8bit": 0}
    for node in graph.node:
        tag = node.name or node.output[0]
        if node.op_type == "Gather" and node.input[0] not in inits:
            table = _table_of(node, inits, producers)
            hits = hits_of(*table) if table is not None else None
            if hits is not None and rows.kind[hits[0][0]] == "q8_0":
                _, q, d, _ = rows.gather(hits)
                out.gather_q8_0(node.input[1], node.output[0], tag, q, d)
                counts["gathers_8bit"] += 1
                continue
        weight = inits.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if weight is None or len(weight.dims) != 2:
            out.nodes.append(node)
            continue
        hits = hits_of(weight.name, True)
        if hits is not None and rows.kind[hits[0][0]] == "q8_0":
            _, q, d, _ = rows.gather(hits)
            out.matmul_q8_0(node.input[0], node.output[0], tag, q, d)
            counts["matmuls_8bit"] += 1
            continue
        if hits is None or rows.kind[hits[0][0]] != "q4_1":
            counts["matmuls_fp32"] += 1
            out.nodes.append(node)
            continue
        _, q, d, m = rows.gather(hits)
        out.matmul(node.input[0], node.output[0], tag, q, d, m)
        counts["matmuls_4bit"] += 1
        counts["params_4bit"] += q.size
    if not counts["matmuls_4bit"]:
        raise ExportError(f"no weight of the graph matches a Q4_1 tensor of {gguf_path.name}: the graph was "
                          "not built from this file")
    del graph.node[:]
    graph.node.extend(out.nodes)
    graph.initializer.extend(out.added)
    _prune(graph)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    out_model.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(out_model), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=out_model.name + ".data", size_threshold=1024)
    for made in (out_model, out_model.with_name(out_model.name + ".data")):
        shutil.copymode(fp32_model, made)  # onnx writes its weights file owner-only; keep the FP32 graph's mode
    say(f"      {counts['matmuls_4bit']} matmuls from the GGUF's Q4_1 blocks ({counts['params_4bit'] / 1e6:.1f}M "
        f"weights), {counts['matmuls_8bit']} from Q8_0 blocks, {counts['gathers_8bit']} embedding table(s) from "
        f"Q8_0 blocks, {counts['matmuls_fp32']} matmul(s) kept in FP32")
    return counts
