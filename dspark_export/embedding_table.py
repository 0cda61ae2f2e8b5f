"""The input embedding table of an FP32 decoder graph, stored on its own so the runtime can
share it.

onnxruntime-genai's model builder writes a tied model's FP32 embedding as
``Gather(Transpose(W))`` over the LM head's ``[hidden, vocab]`` weight. onnxruntime folds that
Transpose when a session opens, into a ``[vocab, hidden]`` copy the session owns: memory no one
else can read, all of it resident though a decode step reads one row. Here the graph is
rewritten so the Gather reads an initializer of its own, the same values transposed, held in a
``.npy`` file beside the graph (the initializer's external data starts after the ``.npy``
header, so onnxruntime reads the file as it is when nothing supplies the table). The builder's
INT8 graph keeps its embedding as an FP32 ``[vocab, hidden]`` initializer; it moves to such a
file too.

The runtime memory-maps that file and hands it to the session as a user initializer
(``dspark_edge.backends.tables``): the session pages in only the rows it gathers, and a DSpark
drafter whose LM head is the same table (DeepSpec freezes the target's embeddings and head)
computes its logits from the same pages instead of holding a second copy. The graph computes
exactly what it did: a Gather of the same values.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

from dspark_edge.manifest import EmbeddingTable

log = logging.getLogger(__name__)

TABLE_INITIALIZER = "model.embed_tokens.weight"
TABLE_FILE = "embed_tokens.npy"


def _npy_with_header(path: Path, table: np.ndarray) -> int:
    """Write ``table`` as a .npy file; returns the byte offset where its data starts."""
    with open(path, "wb") as f:
        np.lib.format.write_array(f, np.ascontiguousarray(table, dtype=np.float32), allow_pickle=False)
    with open(path, "rb") as f:
        np.lib.format.read_magic(f)
        np.lib.format.read_array_header_1_0(f)
        return f.tell()


def separate_embedding_table(graph_path: Path, graph_rel: str, vocab_size: int, hidden_size: int,
                             say=log.info) -> EmbeddingTable | None:
    """Rewrite the graph at ``graph_path`` (its manifest path ``graph_rel``) so its input
    embedding Gather reads an FP32 initializer held in ``TABLE_FILE`` beside it: either the
    builder's ``Gather(Transpose(W))`` over a tied ``[hidden, vocab]`` LM head (replaced by a
    ``[vocab, hidden]`` initializer of the same values), or a ``[vocab, hidden]`` FP32
    initializer already (its bytes moved to the file). Returns the manifest entry, or None when
    the Gather reads anything else (a quantized table, FP16), leaving the graph as it is."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(graph_path), load_external_data=True)
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    gathers = [n for n in graph.node if n.op_type == "Gather" and len(n.input) == 2 and n.input[1] == "input_ids"]
    if len(gathers) != 1:
        return None
    gather = gathers[0]
    readers = lambda name: sum(name in n.input for n in graph.node) + (name in {o.name for o in graph.output})
    source = producers.get(gather.input[0])
    if gather.input[0] in inits:  # a table of its own already
        tensor = inits[gather.input[0]]
        if list(tensor.dims) != [vocab_size, hidden_size] or tensor.data_type != onnx.TensorProto.FLOAT:
            return None
        table = numpy_helper.to_array(tensor)
        graph.initializer.remove(tensor)
        name = tensor.name
    elif source is not None and source.op_type == "Transpose" and source.input[0] in inits:
        perm = [list(a.ints) for a in source.attribute if a.name == "perm"]
        weight = inits[source.input[0]]
        if (list(weight.dims) != [hidden_size, vocab_size] or weight.data_type != onnx.TensorProto.FLOAT
                or perm not in ([], [[1, 0]]) or TABLE_INITIALIZER in inits or readers(source.output[0]) != 1):
            return None
        table = numpy_helper.to_array(weight).T
        graph.node.remove(source)
        name = gather.input[0] = TABLE_INITIALIZER
    else:
        return None
    table = np.ascontiguousarray(table, dtype=np.float32)
    folder = graph_path.parent
    offset = _npy_with_header(folder / TABLE_FILE, table)
    entry = onnx.TensorProto(name=name, data_type=onnx.TensorProto.FLOAT, dims=list(table.shape),
                             data_location=onnx.TensorProto.EXTERNAL)
    for key, value in (("location", TABLE_FILE), ("offset", str(offset)), ("length", str(table.nbytes))):
        entry.external_data.add(key=key, value=value)
    graph.initializer.append(entry)
    data_name = f"{graph_path.name}.data"
    tmp = graph_path.with_name(f".{graph_path.name}.partial")
    # Every other initializer goes back to the graph's data file (written anew: onnx appends to
    # an existing one, and every tensor is in memory now); the table's entry already points at
    # its own file and holds no bytes, so onnx writes it as it is.
    mode = graph_path.stat().st_mode & 0o777
    (folder / data_name).unlink(missing_ok=True)
    onnx.save_model(model, str(tmp), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=data_name, size_threshold=1024)
    os.replace(tmp, graph_path)
    for written in (graph_path, folder / data_name, folder / TABLE_FILE):
        os.chmod(written, mode)  # onnx creates its data file owner-only; the folder is read by whoever serves it
    say(f"      {graph_rel}: the input embedding table is read from {TABLE_FILE} "
        f"({table.nbytes / 2**20:.0f} MiB; memory-mapped at run time and shared with a drafter whose LM head it is)")
    return EmbeddingTable(graph=graph_rel, initializer=name, file=f"{Path(graph_rel).parent.as_posix()}/{TABLE_FILE}")
