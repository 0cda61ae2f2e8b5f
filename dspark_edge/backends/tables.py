"""Embedding tables shared in memory between a target session and its drafter.

An engine's FP32 target graph may read its input embedding table from a file of its own
(``Manifest.embedding_tables``, written by ``dspark_export.embedding_table``). ``shared_table`` maps
that file read-only, once per process: the target's session gets it as a user-supplied
initializer (onnxruntime computes with the caller's buffer, no copy) and pages in only the rows
it gathers; a DSpark drafter whose LM head is the same table feeds the same array to its graph.
One mapping per table, however many sessions, graphs and batch slots read it.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import tokenize
import weakref

import numpy as np

from ..errors import EngineError
from ..manifest import EmbeddingTable, Manifest, engine_path

log = logging.getLogger(__name__)

_LOCK = threading.Lock()
_TABLES: weakref.WeakValueDictionary[tuple, np.ndarray] = weakref.WeakValueDictionary()


def map_npy(path: str | os.PathLike) -> np.ndarray:
    """A .npy file's array, memory-mapped read-only with the kernel's read-ahead turned off
    (``MADV_RANDOM``). Reading one row then pages in that row, not the megabytes around it that
    read-ahead fetches (8 MiB a fault on some disks: a table gathered a row at a time would be
    resident within a few hundred tokens). Raises ValueError or OSError for a file that is not
    a plain .npy array."""
    with open(path, "rb") as f:
        try:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
            elif version == (2, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
            else:
                raise ValueError(f".npy format version {version} is not one this reader maps")
        except (SyntaxError, tokenize.TokenError, TypeError, KeyError, IndexError, OverflowError, RecursionError,
                MemoryError) as exc:  # numpy parses the header as Python literals: a damaged one fails in the tokenizer
            raise ValueError(f"the .npy header does not parse ({type(exc).__name__}: {str(exc)[:80]})") from None
        offset = f.tell()
        if fortran or dtype.hasobject:
            raise ValueError("not a C-ordered numeric array")
        count = int(np.prod(shape, dtype=np.int64))
        if offset + count * dtype.itemsize > os.fstat(f.fileno()).st_size:
            raise ValueError(f"the file holds fewer bytes than its header's {dtype} {shape} needs")
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(mapped, "madvise") and hasattr(mmap, "MADV_RANDOM"):
        mapped.madvise(mmap.MADV_RANDOM)
    return np.frombuffer(mapped, dtype=dtype, count=count, offset=offset).reshape(shape)


def shared_table(engine_dir: str | os.PathLike, manifest: Manifest, table: EmbeddingTable) -> np.ndarray:
    """The [vocab, hidden] float32 table ``table`` names, memory-mapped read-only (the caller
    has verified the file against the manifest). The same array for every caller while any
    holds it, keyed by the file's content as the manifest records it: an engine's FP32 and INT8
    graphs gather from identical tables, and both read one mapping. Raises EngineError when
    the file is not such a table."""
    path = engine_path(engine_dir, table.file)
    entry = manifest.file_entry(table.file)
    key = (entry.sha256, entry.size)
    with _LOCK:
        found = _TABLES.get(key)
        if found is not None:
            return found
        shape = (manifest.model.vocab_size, manifest.model.hidden_size)
        try:
            array = map_npy(path)
        except (ValueError, OSError, EOFError) as exc:
            raise EngineError(f"{path} is not a readable .npy embedding table ({exc}); re-export the engine "
                              "folder") from None
        if array.shape != shape or array.dtype != np.float32 or not array.flags.c_contiguous:
            raise EngineError(f"{path} holds a {array.dtype} array of shape {array.shape}, not the float32 "
                              f"{list(shape)} embedding table the manifest describes; re-export the engine folder")
        _TABLES[key] = array
        log.info("embedding table %s mapped (%.0f MiB, paged in as read)", path, array.nbytes / 2**20)
        return array


def session_initializers(engine_dir: str | os.PathLike, manifest: Manifest, graph: str) -> dict[str, np.ndarray]:
    """The user-supplied initializers a session of ``graph`` takes: its embedding table, if
    the manifest stores one apart."""
    table = manifest.embedding_table(graph)
    return {} if table is None else {table.initializer: shared_table(engine_dir, manifest, table)}


def target_table(engine_dir: str | os.PathLike, manifest: Manifest) -> EmbeddingTable | None:
    """The embedding table a drafter with ``head`` "target_table" reads: the one of the
    target's most precise graph that has one."""
    for precision in manifest.precisions("target"):
        for v in manifest.variants_for("target", precision):
            t = manifest.embedding_table(v.file)
            if t is not None:
                return t
    return None


__all__ = ["session_initializers", "shared_table", "target_table"]
