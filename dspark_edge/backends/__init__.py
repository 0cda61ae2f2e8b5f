"""Inference backends behind one protocol (see ``base``). Implementations are imported lazily,
so ``import dspark_edge`` works without onnxruntime-gpu or TensorRT installed."""

from __future__ import annotations

from .base import BackendOptions, DecoderSession, ForwardOutput, KVCache

__all__ = ["BackendOptions", "DecoderSession", "ForwardOutput", "KVCache", "create_decoder"]


def create_decoder(backend: str, path: str, io, model, options: BackendOptions,
                   hidden_width: int = 0) -> DecoderSession:
    """Open a decoder graph with the named backend ("onnxruntime")."""
    from ..errors import BackendError

    if backend == "onnxruntime":
        from .ort import OrtDecoder

        return OrtDecoder(path, io, model, options, hidden_width)
    raise BackendError(f"backend {backend!r} is not supported by this dspark_edge build "
                       "(available: onnxruntime); re-export with an ONNX Runtime variant")
