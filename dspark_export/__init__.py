"""dspark_edge's exporter: turns a source model into an engine folder (``python -m export``).

Needs the ``export`` extra (PyTorch, transformers, gguf, onnxruntime-genai's graph builder).
The runtime never imports this package.
"""

from .target import ExportOptions, export_target

__all__ = ["ExportOptions", "export_target"]
