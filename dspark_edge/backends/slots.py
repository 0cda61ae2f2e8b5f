"""Several requests' new tokens in one target pass: the fused graph with one attention per slot.

onnxruntime's CPU GroupQueryAttention runs several new tokens after a cached context only at
batch size 1, so a batch of rows cannot verify drafts. This module rewrites the fused graph so
it never needs to: the new tokens of P *graph slots* are concatenated into one sequence
(``input_ids`` [1, N]); every matmul, norm and the LM head run over all N tokens at once (the
weights are read once for every request), and in each layer the attention input is split by
the slots' widths (``slot_widths``) and each slot's part goes to an attention node of its own,
at batch size 1, over that slot's own K/V buffer (``<past name>.s<j>``, past and present bound
to the same memory, as in the fused graph). A slot's positions come from its own committed
length (``slot_totals``: committed + new, per slot), so every slot is exactly the pass it
would be alone, with the same kernels and inputs; only the row count of the matmuls differs.

Every slot must have at least one new token (the attention refuses zero): a pass over fewer
requests than P fills the other slots with one-token dummies over a one-position scratch
buffer (``SlotsDecoder``).

The rewrite happens in memory when a server batches (nothing is written to the engine folder);
the session reads the same external weight file as the engine's own graph.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..errors import BackendError, EngineError
from ..manifest import GraphIO

log = logging.getLogger(__name__)

SLOT_WIDTHS = "slot_widths"  # [P] int64: each slot's new tokens, in slot order
SLOT_TOTALS = "slot_totals"  # [P] int32: each slot's committed + new positions
ATTENTION = ("com.microsoft", "GroupQueryAttention")


def _slot_name(name: str, slot: int) -> str:
    return f"{name}.s{slot}"


def rewrite(model, io: GraphIO, num_layers: int, slots: int):
    """The fused graph ``model`` (an onnx ModelProto, external data not loaded) rewritten for
    ``slots`` graph slots (see the module docstring). Raises EngineError for a graph that is not
    the fused graph this rewrite knows (every past/present K/V tensor used by exactly one
    GroupQueryAttention node that takes the positions from the attention mask)."""
    from onnx import TensorProto, helper

    if slots < 2:
        raise ValueError("a slots graph needs at least 2 slots")
    g = model.graph
    kv = io.kv_names(num_layers)
    pasts = {p for p, _ in kv}
    presents = {q for _, q in kv}
    attn = [n for n in g.node if (n.domain, n.op_type) == ATTENTION]
    if len(attn) != num_layers:
        raise EngineError(f"the graph has {len(attn)} GroupQueryAttention nodes for {num_layers} layers: "
                          "not the fused graph a batched server can split by request")
    used_by = {}
    for n in g.node:
        for name in n.input:
            if name in pasts:
                used_by.setdefault(name, []).append(n)
    if any(len(used_by.get(p, [])) != 1 or (used_by[p][0].domain, used_by[p][0].op_type) != ATTENTION
           for p in pasts):
        raise EngineError("the graph's past K/V tensors are not each read by one attention node: not the "
                          "fused graph a batched server can split by request")

    new_nodes = []
    # Per-slot position inputs, shared by every layer: seqlens_k [1] = total - 1, total (scalar).
    for j in range(slots):
        new_nodes += [
            helper.make_node("Constant", [], [f"/slots/idx{j}"], value=helper.make_tensor(
                f"/slots/idx{j}", TensorProto.INT64, [1], [j])),
            helper.make_node("Gather", [SLOT_TOTALS, f"/slots/idx{j}"], [f"/slots/total_1d{j}"], axis=0),
            helper.make_node("Sub", [f"/slots/total_1d{j}", "/slots/one"], [f"/slots/seqlens{j}"]),
            helper.make_node("Squeeze", [f"/slots/total_1d{j}", "/slots/axis0"], [f"/slots/total{j}"]),
        ]
    new_nodes = [helper.make_node("Constant", [], ["/slots/one"], value=helper.make_tensor(
                     "/slots/one", TensorProto.INT32, [1], [1])),
                 helper.make_node("Constant", [], ["/slots/axis0"], value=helper.make_tensor(
                     "/slots/axis0", TensorProto.INT64, [1], [0]))] + new_nodes

    body = []
    for n in g.node:
        if (n.domain, n.op_type) != ATTENTION:
            body.append(n)
            continue
        ins, outs = list(n.input), list(n.output)
        if len(ins) < 7 or len(outs) < 3 or ins[3] not in pasts or outs[1] not in presents:
            raise EngineError(f"attention node {n.name!r} does not have the fused graph's inputs "
                              "(query, key, value, past key, past value, seqlens, total length, …)")
        parts = {}
        for i in (0, 1, 2):  # packed QKV in input 0, or separate key and value inputs
            if ins[i]:
                names = [f"{n.name}/slots/in{i}.{j}" for j in range(slots)]
                body.append(helper.make_node("Split", [ins[i], SLOT_WIDTHS], names, axis=1,
                                             name=f"{n.name}/slots/split{i}"))
                parts[i] = names
        pieces = []
        for j in range(slots):
            sin = [parts[i][j] if i in parts else "" for i in (0, 1, 2)]
            sin += [_slot_name(ins[3], j), _slot_name(ins[4], j), f"/slots/seqlens{j}", f"/slots/total{j}"]
            sin += ins[7:]
            sout = [f"{n.name}/slots/out.{j}", _slot_name(outs[1], j), _slot_name(outs[2], j)] + [
                f"{o}.s{j}" if o else "" for o in outs[3:]]
            body.append(helper.make_node(n.op_type, sin, sout, name=f"{n.name}/slots/{j}", domain=n.domain))
            body[-1].attribute.extend(n.attribute)
            pieces.append(sout[0])
        body.append(helper.make_node("Concat", pieces, [outs[0]], axis=1, name=f"{n.name}/slots/concat"))

    nodes = new_nodes + body
    # Drop what no longer feeds an output (the attention mask's reformatting).
    graph_outputs = {o.name for o in g.output} - presents | {
        _slot_name(q, j) for q in presents for j in range(slots)}
    needed, live = set(graph_outputs), []
    for node in reversed(nodes):
        if any(o in needed for o in node.output if o):
            live.append(node)
            needed.update(i for i in node.input if i)
    live.reverse()

    old_inputs = {i.name: i for i in g.input}
    inputs = [helper.make_tensor_value_info(io.input_ids, old_inputs[io.input_ids].type.tensor_type.elem_type,
                                           [1, "total_new_tokens"]),
              helper.make_tensor_value_info(SLOT_WIDTHS, TensorProto.INT64, [slots]),
              helper.make_tensor_value_info(SLOT_TOTALS, TensorProto.INT32, [slots])]
    def per_slot(info) -> list:  # a K/V value's one [1, kv_heads, capacity_j, head_dim] copy per slot
        elem = info.type.tensor_type.elem_type
        dims = [d.dim_value or d.dim_param for d in info.type.tensor_type.shape.dim]
        return [helper.make_tensor_value_info(_slot_name(info.name, j), elem, [1, dims[1], f"capacity_{j}", dims[3]])
                for j in range(slots)]

    for i in g.input:
        if i.name in pasts:
            inputs += per_slot(i)
        elif i.name not in (io.input_ids, io.attention_mask) and i.name in needed:
            inputs.append(i)
    outputs = []
    for o in g.output:
        if o.name in presents:
            outputs += per_slot(o)
        else:
            outputs.append(o)
    graph = helper.make_graph(live, f"{g.name}-slots{slots}", inputs, outputs, initializer=list(g.initializer),
                              value_info=[])
    out = helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    return out


class SlotsDecoder:
    """The target's slots graph in a session of its own (its weights are a second copy in
    memory: onnxruntime packs a session's weights for itself). Runs passes over rows of an
    ``OrtKVRows`` (the runner's K/V buffers): ``run`` takes up to ``slots`` jobs, each a row, its
    committed length and its new tokens."""

    def __init__(self, decoder, slots: int) -> None:
        import onnx

        from .ort import open_session

        self.decoder, self.slots = decoder, slots
        io, model = decoder.io, decoder.model
        if io.kv_layout != "shared_buffer" or decoder.device != "cpu":
            raise BackendError("verifying several requests in one pass needs the fused graph on the CPU")
        try:
            proto = onnx.load(decoder.path, load_external_data=False)
        except Exception as exc:  # onnx raises DecodeError and OSError subclasses here
            raise EngineError(f"cannot read {decoder.path} to split its attention by request: {exc}") from exc
        graph = rewrite(proto, io, model.num_layers, slots)
        folder = str(Path(decoder.path).resolve().parent)
        # Two sessions take turns on the same cores: without the process-wide pool, this one's
        # threads must not spin after its pass and slow the engine's next one.
        options = decoder.options if decoder.options.shared_threads else replace(decoder.options, allow_spinning=False)
        self.session = open_session(graph.SerializeToString(), options, initializers=decoder.initializers,
                                    external_folder=folder, label=f"{decoder.path} ({slots} slots)")
        self.kv_dtype = decoder.kv_dtype
        self._kv_names = decoder.kv_names
        self._scratch = [np.zeros((1, model.num_kv_heads, 1, model.head_dim), dtype=self.kv_dtype)
                         for _ in self._kv_names]
        log.info("opened the %d-slot graph of %s (one pass verifies several requests)", slots, decoder.path)

    def run(self, kv, jobs: list[tuple[int, int, np.ndarray]]) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """One pass over ``jobs`` [(row, committed length, ids [w])], at most ``slots`` of them,
        each row at most once. Returns each job's (logits [w, V], hidden [w, H] or None), views
        of one pass's output arrays (the caller's own)."""
        if not 1 <= len(jobs) <= self.slots or len({r for r, _, _ in jobs}) != len(jobs):
            raise BackendError(f"a {self.slots}-slot pass takes 1 to {self.slots} jobs on distinct rows")
        d = self.decoder
        widths = [int(ids.shape[0]) for _, _, ids in jobs] + [1] * (self.slots - len(jobs))
        totals = [length + int(ids.shape[0]) for _, length, ids in jobs] + [1] * (self.slots - len(jobs))
        n = sum(widths)
        ids = np.zeros((1, n), dtype=np.int64)
        ids[0, :sum(widths[:len(jobs)])] = np.concatenate([j[2] for j in jobs])
        b = self.session.io_binding()
        b.bind_cpu_input(d.io.input_ids, ids)
        b.bind_cpu_input(SLOT_WIDTHS, np.asarray(widths, dtype=np.int64))
        b.bind_cpu_input(SLOT_TOTALS, np.asarray(totals, dtype=np.int32))
        shape = [1, *kv.row_shape]
        for (past, present), base, scratch in zip(self._kv_names, kv.bases, self._scratch):
            for j in range(self.slots):
                if j < len(jobs):
                    ptr, dims = base + jobs[j][0] * kv.row_bytes, shape
                else:  # a dummy: one token at position 0 of the scratch buffer
                    ptr, dims = scratch.ctypes.data, list(scratch.shape)
                b.bind_input(_slot_name(past, j), "cpu", 0, self.kv_dtype, dims, ptr)
                b.bind_output(_slot_name(present, j), "cpu", 0, self.kv_dtype, dims, ptr)
        logits = np.empty((1, n, d.model.vocab_size), dtype=np.float32)
        hidden = np.empty((1, n, d.hidden_width), dtype=np.float32) if d.hidden_width else None
        b.bind_output(d.io.logits, "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        if hidden is not None:
            b.bind_output(d.io.hidden_states, "cpu", 0, np.float32, list(hidden.shape), hidden.ctypes.data)
        try:
            self.session.run_with_iobinding(b)
        except Exception as exc:
            raise BackendError(f"onnxruntime failed running the {self.slots}-slot pass of {d.path} over "
                               f"widths {widths[:len(jobs)]}: {exc}") from exc
        out, start = [], 0
        for w in widths[:len(jobs)]:
            out.append((logits[0, start:start + w], None if hidden is None else hidden[0, start:start + w]))
            start += w
        return out

