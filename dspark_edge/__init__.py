"""dspark_edge: on-device speculative decoding on ONNX Runtime (and TensorRT).

    import dspark_edge
    with dspark_edge.load("engines/smollm2-135m", drafter="auto") as pipe:
        print(pipe.generate([{"role": "user", "content": "Hi!"}], max_new_tokens=64).text)

No PyTorch at run time: numpy, onnxruntime, tokenizers, jinja2 and psutil. The names below
are the public API; everything else may change between versions.
"""

from .backends import BackendOptions
from .config import GenerationConfig, GenerationResult, GenerationStats, TokenLogprob
from .drafters import Draft, Drafter, DraftRequest, DrafterSpec, parse_spec
from .errors import (BackendError, ConfigError, DSparkError, EngineError, ExportError, GenerationError,
                     ManifestError, OutputError, PromptError)
from .grammar import Grammar
from .manifest import Manifest, read_manifest
from .pipeline import Pipeline, TextStream, auto_drafter, load
from .rounds import RoundInfo
from .scheduler import SchedulerConfig

__version__ = "0.1.0"

__all__ = [
    "BackendError", "BackendOptions", "ConfigError", "DSparkError", "Draft", "DraftRequest", "Drafter",
    "DrafterSpec", "EngineError", "ExportError", "GenerationConfig", "GenerationError", "GenerationResult",
    "GenerationStats", "Grammar", "Manifest", "ManifestError", "OutputError", "Pipeline", "PromptError", "RoundInfo",
    "SchedulerConfig", "TextStream", "TokenLogprob", "auto_drafter", "load", "parse_spec", "read_manifest", "__version__",
]
