"""dspark_edge: on-device speculative decoding on ONNX Runtime (and TensorRT).

    import dspark_edge
    pipe = dspark_edge.load("engines/smollm2-135m")
    print(pipe.generate([{"role": "user", "content": "Hi!"}], max_new_tokens=64).text)

No PyTorch at run time: numpy, onnxruntime and tokenizers.
"""

from .backends import BackendOptions
from .config import GenerationConfig, GenerationResult, GenerationStats
from .errors import (BackendError, ConfigError, DSparkError, EngineError, ExportError, GenerationError,
                     ManifestError, PromptError)
from .manifest import Manifest, read_manifest
from .pipeline import Pipeline, TextStream, load

__version__ = "0.1.0"

__all__ = [
    "BackendError", "BackendOptions", "ConfigError", "DSparkError", "EngineError", "ExportError",
    "GenerationConfig", "GenerationError", "GenerationResult", "GenerationStats", "Manifest",
    "ManifestError", "Pipeline", "PromptError", "TextStream", "load", "read_manifest", "__version__",
]
