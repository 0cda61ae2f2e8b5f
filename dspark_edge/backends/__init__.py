"""Inference backends behind one protocol (see ``base``). Implementations are imported lazily,
so ``import dspark_edge`` works without onnxruntime-gpu or TensorRT installed."""

from __future__ import annotations

from .base import BackendOptions, DecoderSession, ForwardOutput, KVCache

__all__ = ["BACKENDS", "BackendOptions", "DecoderSession", "ForwardOutput", "KVCache", "create_decoder"]


BACKENDS = ("onnxruntime", "tensorrt")


def create_decoder(backend: str, path: str, io, model, options: BackendOptions,
                   hidden_width: int = 0, tensorrt=None, qdq: bool = False,
                   initializers: dict | None = None) -> DecoderSession:
    """Open a decoder graph with the named backend: "onnxruntime", or "tensorrt" (``tensorrt``
    is the manifest's description of the engine). ``qdq``: an explicitly quantized graph.
    ``initializers``: arrays the onnxruntime session computes with in place of the graph's own
    (``tables.session_initializers``)."""
    from ..errors import BackendError

    if backend == "onnxruntime":
        from .ort import OrtDecoder

        return OrtDecoder(path, io, model, options, hidden_width, qdq, initializers)
    if backend == "tensorrt":
        from .trt import TrtDecoder

        if tensorrt is None:
            raise BackendError(f"{path}: the manifest does not describe this TensorRT engine")
        return TrtDecoder(path, io, model, options, hidden_width, tensorrt)
    raise BackendError(f"backend {backend!r} is not supported: choose one of {list(BACKENDS)}")
