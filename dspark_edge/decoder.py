"""A decoder model of an engine folder (the target, or an independent draft model): one
precision's graph opened once and run at the widths the manifest lists.

``step`` runs exactly a listed width (an unlisted width is an error, never clamped);
``prefill`` runs the prompt in chunks so a long prompt never materialises [S, V] logits at
once. Knows nothing about tokenization or sampling.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from .backends import BACKENDS, BackendOptions, ForwardOutput, KVCache, create_decoder
from .backends.tables import session_initializers
from .errors import ConfigError, EngineError
from .manifest import Manifest

log = logging.getLogger(__name__)

PREFILL_CHUNK = 128


class DecoderModel:
    def __init__(self, manifest: Manifest, engine_dir: str | Path, precision: str | None = None,
                 backend: str = "onnxruntime", options: BackendOptions | None = None,
                 role: str = "target") -> None:
        if backend not in BACKENDS:
            raise ConfigError(f"backend {backend!r} is not supported: choose one of {list(BACKENDS)}")
        present = manifest.precisions(role)
        if not present:
            raise EngineError(f"{engine_dir}: the manifest lists no {role} variant")
        if precision is None:
            precision = (manifest.precisions(role, backend) or present)[0]
        if precision not in present:
            raise ConfigError(f"precision {precision!r} is not in this engine's {role} (it has "
                              f"{present}); export it with `--precisions {precision}`")
        variants = manifest.variants_for(role, precision, backend)
        if not variants:
            present = sorted({v.backend for v in manifest.variants_for(role, precision)})
            hint = ("; build TensorRT engines with `python -m export trt --engine DIR`" if backend == "tensorrt"
                    else "")
            raise ConfigError(f"no {backend} {role} variant at precision {precision} (backends present for "
                              f"{precision}: {present}){hint}")
        files = {v.file for v in variants}
        if len(files) != 1:
            raise EngineError(f"{precision} {role} variants name several graph files {sorted(files)}; "
                              "this runtime expects one graph used at every width")
        self.manifest = manifest
        self.role = role
        self.precision = precision
        self.backend = backend
        self.file = files.pop()
        self.widths = tuple(sorted(v.width for v in variants))
        self.options = options or BackendOptions()
        hidden_width = manifest.model.hidden_size * len(manifest.hidden_state_layers)
        engine = manifest.tensorrt_engine(self.file) if backend == "tensorrt" else None
        qdq = manifest.io.kv_layout == "append" and precision == "int8"  # the portable INT8 graph is QDQ
        shared = session_initializers(engine_dir, manifest, self.file) if backend == "onnxruntime" else None
        self.session = create_decoder(backend, str(Path(engine_dir) / self.file), manifest.io, manifest.model,
                                      self.options, hidden_width, engine, qdq, shared)
        self.capacity = self.session.capacity
        self.session.cached_widths = frozenset(self.widths)  # decode widths reuse their output buffers

    def new_cache(self) -> KVCache:
        return self.session.new_cache()

    def step(self, cache: KVCache, ids: np.ndarray) -> ForwardOutput:
        """Run ``ids`` ([w] int64, w a listed width) after the committed positions; commits nothing.

        The returned arrays are reused by the next call of the same width: copy what you keep.
        """
        self.check_width(ids.shape[0])
        return self.session.forward(cache, ids)

    def check_width(self, width: int) -> None:
        """Refuse a pass of ``width`` tokens that this graph does not list."""
        if width not in self.widths:
            raise ConfigError(f"width {width} is not a listed {self.precision} {self.role} width "
                              f"{self.widths}; pick one of those")

    def prefill(self, cache: KVCache, ids: np.ndarray, chunk: int = PREFILL_CHUNK,
                hidden_sink: list | None = None, logits_sink=None) -> ForwardOutput:
        """Run and commit all of ``ids``; returns the last chunk's output. With ``hidden_sink``,
        a copy of every chunk's hidden states ([n, H * layers]) is appended to it; with
        ``logits_sink``, it is called with every chunk's logits ([n, V]) before the next chunk
        runs (their buffer is reused)."""
        chunk = min(chunk, self.session.max_step)  # e.g. a TensorRT engine's prefill profile
        return prefill_in_chunks(self.session.forward, cache, ids, chunk, hidden_sink, logits_sink)


def prefill_in_chunks(forward, cache: KVCache, ids: np.ndarray, chunk: int,
                      hidden_sink: list | None = None, logits_sink=None) -> ForwardOutput:
    """``forward(cache, part)`` over ``ids`` in chunks of at most ``chunk``, committing each;
    the last chunk's output (see ``DecoderModel.prefill``)."""
    out = None
    for start in range(0, ids.shape[0], chunk):
        part = ids[start:start + chunk]
        out = forward(cache, part)
        cache.commit(part.shape[0])
        if hidden_sink is not None and out.hidden is not None:
            hidden_sink.append(out.hidden.copy())
        if logits_sink is not None:
            logits_sink(out.logits)
    if out is None:
        raise ConfigError("prefill needs at least one token")
    return out
