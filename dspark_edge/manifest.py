"""manifest.json: the single contract between the exporter and the runtime.

An engine folder holds graphs, tokenizer files and ``manifest.json``. The manifest names
every file with its sha256, the model's shape, the tokenizer's special ids, the graph's
input/output names, the hidden layers the target exposes to drafters, the fixed-width
variants, and the exporter's validation results. A variant's identity comes from here,
never from parsing file names. This module knows nothing about inference.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from .errors import EngineError, ManifestError
from .strict_json import from_json_dict, to_json_dict

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"

Precision = Literal["fp32", "fp16", "int8", "int4"]
Role = Literal["target", "drafter", "draft_model"]
Backend = Literal["onnxruntime", "tensorrt"]
PRECISIONS: tuple[str, ...] = ("fp32", "fp16", "int8", "int4")
# exporter[INT4_OUTPUT_KEY] == "fp32": the int4 graph holds the source's own 4-bit blocks and
# computes at FP32's precision, so its output is the FP32 graph's (export.gguf_blocks); anything
# else ("approximate") is a re-quantization.
INT4_OUTPUT_KEY = "int4_output"


def check_relative_path(path: str) -> None:
    """A ValueError unless ``path`` is a relative, '/'-separated path that stays inside its
    folder (no absolute path, drive, backslash, NUL, empty, '.' or '..' part)."""
    parts = path.split("/")
    if (not path or path.startswith("/") or "\\" in path or "\x00" in path
            or any(part in ("", ".", "..") for part in parts) or ":" in parts[0]):
        raise ValueError(f"file path {path!r} must be a relative '/'-separated path inside the engine folder")


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative to the engine folder, "/"-separated
    sha256: str
    size: int

    def __post_init__(self) -> None:
        check_relative_path(self.path)
        if len(self.sha256) != 64:
            raise ValueError(f"sha256 of {self.path!r} must be 64 hex digits")


# Far above any language model's shape; a manifest beyond them is damaged or hostile (sizes
# derived from them would overflow int64 or allocate without bound).
MODEL_LIMITS = {"num_layers": 4096, "hidden_size": 1 << 18, "num_heads": 4096, "num_kv_heads": 4096,
                "head_dim": 1 << 14, "vocab_size": 1 << 24, "max_position_embeddings": 1 << 26}


@dataclass(frozen=True)
class ModelInfo:
    name: str
    architecture: str
    source: str
    source_sha256: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int

    def __post_init__(self) -> None:
        for key, most in MODEL_LIMITS.items():
            if not 1 <= getattr(self, key) <= most:
                raise ValueError(f"{key} must be in [1, {most}], got {getattr(self, key)}")


@dataclass(frozen=True)
class TokenizerInfo:
    file: str
    chat_template_file: str | None
    bos_id: int | None
    eos_ids: tuple[int, ...]
    pad_id: int | None
    add_bos: bool

    def __post_init__(self) -> None:
        if not self.eos_ids:
            raise ValueError("eos_ids must name at least one end-of-generation token id")
        if self.add_bos and self.bos_id is None:
            raise ValueError("add_bos is true but bos_id is null")


@dataclass(frozen=True)
class GraphIO:
    """Tensor names of a decoder graph; ``{layer}`` stands for the layer index.

    ``kv_layout`` "shared_buffer": past and present name one preallocated [1, kv_heads,
    capacity, head_dim] buffer the graph writes in place (the fused ONNX Runtime graph).
    "append": past is the committed prefix [1, length, kv_heads, head_dim] of a sequence-major
    buffer and present names outputs holding only the new positions' K/V, which the runtime
    binds right after the prefix (the portable graph; no attention mask input)."""

    input_ids: str
    attention_mask: str | None
    past_key: str
    past_value: str
    present_key: str
    present_value: str
    logits: str
    hidden_states: str | None
    kv_layout: Literal["shared_buffer", "append"]

    def __post_init__(self) -> None:
        if self.kv_layout == "shared_buffer" and not self.attention_mask:
            raise ValueError("kv_layout shared_buffer needs an attention_mask input")
        for key in ("past_key", "past_value", "present_key", "present_value"):
            if "{layer}" not in getattr(self, key):
                raise ValueError(f"{key} {getattr(self, key)!r} must contain '{{layer}}'")

    def kv_names(self, num_layers: int) -> list[tuple[str, str]]:
        """(past, present) tensor names of every KV buffer: layer 0 key, layer 0 value, layer 1 key, …"""
        return [(past.format(layer=i), present.format(layer=i)) for i in range(num_layers)
                for past, present in ((self.past_key, self.present_key), (self.past_value, self.present_value))]


@dataclass(frozen=True)
class Variant:
    """One fixed-width way to run a graph: ``width`` new tokens per target pass (verify width)
    or the drafter's block size. Variants naming the same file share one session and its weights."""

    role: Role
    width: int
    precision: Precision
    backend: Backend
    file: str
    device: Literal["any", "gpu"] = "any"  # "gpu": built for GPUs (FP16; TensorRT engines)

    def __post_init__(self) -> None:
        if self.width < 1:
            raise ValueError(f"width must be >= 1, got {self.width}")


@dataclass(frozen=True)
class ValidationResult:
    """Exported graph vs the PyTorch reference, measured by the exporter."""

    precision: Precision
    prompts: int
    max_abs_logit_diff: float
    max_abs_hidden_diff: float
    greedy_tokens_compared: int
    greedy_tokens_matched: int  # greedy tokens equal to the reference before the first divergence
    teacher_forced_top1: float  # share of reference-continuation positions with the same argmax
    passed: bool


@dataclass(frozen=True)
class DrafterInfo:
    """A DSpark block drafter trained against this engine's target (role "drafter" variants;
    their width is the block size, i.e. the verify width: width - 1 drafts). ``tables`` (npz:
    vocab_ids, markov_in, markov_out, conf_w, conf_b) and ``embedding`` (npy [V, H], the target's
    input embeddings: the drafter's own FP16 copy, or the target's separately stored FP32 table
    when the drafter's embeddings equal it) are read by the runtime's sequential step."""

    kind: Literal["dspark"]
    slots: int  # drafts per block the drafter was trained for
    draft_vocab: int
    markov_rank: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    feature_layers: tuple[int, ...]
    temperatures: tuple[float, ...]  # calibration c_k = σ(z_k / T_k + b_k), one per draft position
    tables: str
    embedding: str
    provenance: dict[str, str]
    biases: tuple[float, ...] = ()  # b_k; empty: all 0 (drafters calibrated by temperature alone)
    # "head": z_k from the confidence head; "draft_probability": no head, z_k = logit of the
    # largest probability of slot k's draft distribution (calibrated online by the scheduler)
    confidence: Literal["head", "draft_probability"] = "head"
    # "own": every graph holds its LM head rows. "target_table": they equal the target's
    # embedding table (a tied target; checked on install), and the graphs that take a
    # ``head_table`` input read it from there instead of holding a copy.
    head: Literal["own", "target_table"] = "own"
    # The Markov head's tables as one .npy [Vd + 1, 2r] float16 (float32 when installed with
    # --markov-dtype float32, or before FP16 became the default): row v holds W1[v] then W2ᵀ[v]
    # (row Vd: the out-of-vocabulary anchor's W1 row, zeros after it). Memory-mapped, so a
    # round pages in the rows it reads. None: markov_in / markov_out in ``tables``.
    markov: str | None = None

    def __post_init__(self) -> None:
        if len(self.temperatures) != self.slots:
            raise ValueError(f"temperatures has {len(self.temperatures)} entries for {self.slots} slots")
        if any(not (t > 0 and math.isfinite(t)) for t in self.temperatures):
            raise ValueError("temperatures must be positive and finite")
        if self.biases and len(self.biases) != self.slots:
            raise ValueError(f"biases has {len(self.biases)} entries for {self.slots} slots (or leave it out)")
        if any(not math.isfinite(b) for b in self.biases):
            raise ValueError("biases must be finite")


@dataclass(frozen=True)
class TensorRTEngine:
    """A TensorRT engine built from one portable ONNX graph (``python -m export trt``). One
    engine holds the weights once and an optimization profile per decode width (input_ids
    fixed at [1, w], past length 0 .. max_context - w) plus, marked 0 in ``profiles``, a
    prefill profile (1 .. prefill_max new tokens). It runs only with the TensorRT version
    and GPU (compute capability) it was built for."""

    file: str
    onnx: str
    precision: Precision
    profiles: tuple[int, ...]  # new tokens per profile, in profile order; 0 = the prefill profile
    prefill_max: int
    max_context: int
    tensorrt_version: str
    gpu: str
    compute_capability: str
    timing_cache: str | None = None

    def __post_init__(self) -> None:
        if not self.profiles or any(w < 0 for w in self.profiles) or len(set(self.profiles)) != len(self.profiles):
            raise ValueError(f"profiles must list distinct widths >= 0 (0 = prefill), got {list(self.profiles)}")
        if self.max_context < 2 or self.prefill_max < 1:
            raise ValueError("max_context must be >= 2 and prefill_max >= 1")
        if max(self.profiles) >= self.max_context:
            raise ValueError(f"a profile width {max(self.profiles)} leaves no context (max_context {self.max_context})")


@dataclass(frozen=True)
class EmbeddingTable:
    """A decoder graph whose input embedding Gather reads ``initializer``, an FP32 [vocab,
    hidden] table held in ``file`` (a .npy file; the initializer's external data starts after
    its header). The runtime memory-maps the file and supplies the table to the session itself,
    so only gathered rows are paged in, and a DSpark drafter whose LM head is this table
    (``DrafterInfo.head`` "target_table") reads the same pages."""

    graph: str
    initializer: str
    file: str


@dataclass(frozen=True)
class Manifest:
    schema_version: int
    created_utc: str
    exporter: dict[str, str]
    model: ModelInfo
    tokenizer: TokenizerInfo
    io: GraphIO
    hidden_state_layers: tuple[int, ...]
    variants: tuple[Variant, ...]
    files: tuple[FileEntry, ...]
    validation: tuple[ValidationResult, ...] = field(default=())
    drafter: DrafterInfo | None = None
    tensorrt: tuple[TensorRTEngine, ...] = field(default=())
    embedding_tables: tuple[EmbeddingTable, ...] = field(default=())

    def embedding_table(self, graph: str) -> EmbeddingTable | None:
        """The separately stored embedding table ``graph`` reads, if it has one."""
        return next((t for t in self.embedding_tables if t.graph == graph), None)

    def tensorrt_engine(self, file: str) -> TensorRTEngine:
        for e in self.tensorrt:
            if e.file == file:
                return e
        raise EngineError(f"the manifest describes no TensorRT engine {file!r}; rebuild with `python -m export trt`")

    def __post_init__(self) -> None:
        if self.schema_version > SCHEMA_VERSION:
            raise ValueError(
                f"schema_version {self.schema_version} is newer than this dspark_edge understands "
                f"({SCHEMA_VERSION}): upgrade dspark_edge or re-export with this version")
        if self.schema_version < 1:
            raise ValueError(f"schema_version must be >= 1, got {self.schema_version}")
        n = self.model.num_layers
        for layer in self.hidden_state_layers:
            if not 1 <= layer < n:
                raise ValueError(f"hidden_state_layers entry {layer} outside [1, {n}) "
                                 "(index i is the residual stream entering layer i; the final layer is never exposed)")
        if self.hidden_state_layers and self.io.hidden_states is None:
            raise ValueError("hidden_state_layers is set but io.hidden_states names no output")
        paths = [f.path for f in self.files]
        if len(set(paths)) != len(paths):
            raise ValueError("files lists a path twice")
        known = set(paths)
        seen = set()
        for v in self.variants:
            if v.file not in known:
                raise ValueError(f"variant {v.role}/{v.precision}/w{v.width} names file {v.file!r} "
                                 "that is not listed in files")
            key = (v.role, v.precision, v.backend, v.width)
            if key in seen:
                raise ValueError(f"variant {key} is listed twice")
            seen.add(key)
        if self.tokenizer.file not in known:
            raise ValueError(f"tokenizer file {self.tokenizer.file!r} is not listed in files")
        template = self.tokenizer.chat_template_file
        if template is not None and template not in known:
            raise ValueError(f"chat template file {template!r} is not listed in files")
        for e in self.tensorrt:
            if e.file not in known:
                raise ValueError(f"TensorRT engine {e.file!r} is not listed in files")
            widths = {v.width for v in self.variants if v.file == e.file}
            if not widths or not widths <= set(e.profiles):
                raise ValueError(f"TensorRT engine {e.file!r}: variants {sorted(widths)} need profiles "
                                 f"{list(e.profiles)} to include each of their widths")
        for v in self.variants:
            if v.backend == "tensorrt" and not any(e.file == v.file for e in self.tensorrt):
                raise ValueError(f"variant {v.role}/{v.precision}/w{v.width} names TensorRT engine {v.file!r} "
                                 "that the tensorrt section does not describe")
        for t in self.embedding_tables:
            if t.file not in known:
                raise ValueError(f"embedding table file {t.file!r} is not listed in files")
        if len({t.graph for t in self.embedding_tables}) != len(self.embedding_tables):
            raise ValueError("embedding_tables lists a graph twice")
        has_drafter_variants = any(v.role == "drafter" for v in self.variants)
        if has_drafter_variants != (self.drafter is not None):
            raise ValueError("drafter variants and the drafter section must come together")
        if self.drafter is not None:
            for f in (self.drafter.tables, self.drafter.embedding, self.drafter.markov):
                if f is not None and f not in known:
                    raise ValueError(f"drafter file {f!r} is not listed in files")
            if tuple(self.drafter.feature_layers) != tuple(self.hidden_state_layers):
                raise ValueError(f"the drafter reads layers {list(self.drafter.feature_layers)} but the target "
                                 f"exposes {list(self.hidden_state_layers)}")
            if self.drafter.head == "target_table" and not any(
                    self.embedding_table(v.file) for v in self.variants if v.role == "target"):
                raise ValueError("the drafter's LM head is the target's embedding table, but no target graph "
                                 "lists one in embedding_tables")
            for v in self.variants:
                if v.role == "drafter" and v.width - 1 > self.drafter.slots:
                    raise ValueError(f"drafter block {v.width} needs {v.width - 1} slots; trained for "
                                     f"{self.drafter.slots}")

    # -- queries -------------------------------------------------------------------------
    def variants_for(self, role: str, precision: str | None = None, backend: str | None = None) -> list[Variant]:
        return [v for v in self.variants if v.role == role
                and (precision is None or v.precision == precision)
                and (backend is None or v.backend == backend)]

    def precisions(self, role: str = "target", backend: str | None = None) -> list[str]:
        present = {v.precision for v in self.variants if v.role == role and backend in (None, v.backend)}
        return [p for p in PRECISIONS if p in present]

    def faithful_precisions(self, backend: str | None = None) -> list[str]:
        """Target precisions whose output is the model's own: the most precise one exported, and
        int4 beside FP32 when the exporter says the int4 graph computes FP32's output (the
        source's own 4-bit blocks, FP32-precision activations). INT8, FP16 beside FP32 and a
        re-quantized int4 change the output."""
        present = self.precisions("target", backend)
        if not present:
            return []
        faithful = [present[0]]
        if present[0] == "fp32" and "int4" in present and self.exporter.get(INT4_OUTPUT_KEY) == "fp32":
            faithful.append("int4")
        return faithful

    def widths(self, role: str, precision: str, backend: str | None = None) -> tuple[int, ...]:
        return tuple(sorted({v.width for v in self.variants_for(role, precision, backend)}))

    def file_entry(self, path: str) -> FileEntry:
        for f in self.files:
            if f.path == path:
                return f
        raise KeyError(path)

    # -- JSON ------------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(to_json_dict(self), indent=2, sort_keys=False) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str = MANIFEST_NAME) -> "Manifest":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ManifestError(f"{where}: not valid JSON ({exc}); re-export the engine folder") from exc
        except (RecursionError, ValueError) as exc:  # nesting too deep, an integer of thousands of digits
            raise ManifestError(f"{where}: not a manifest this dspark_edge can read ({type(exc).__name__}: "
                                f"{str(exc)[:120]}); re-export the engine folder") from None
        if isinstance(data, dict) and isinstance(data.get("schema_version"), int) \
                and data["schema_version"] > SCHEMA_VERSION:
            raise ManifestError(
                f"{where}: schema_version {data['schema_version']} is newer than this dspark_edge "
                f"understands ({SCHEMA_VERSION}); upgrade dspark_edge or re-export with this version")
        return from_json_dict(cls, data, where)


def read_manifest(engine_dir: str | os.PathLike) -> Manifest:
    """Read and validate ``engine_dir/manifest.json`` (files are checked by ``verify_files``)."""
    engine_dir = Path(engine_dir)
    if not engine_dir.is_dir():
        raise EngineError(f"engine folder {engine_dir} does not exist; build one with "
                          f"`python -m export target --source default --output {engine_dir}`")
    path = engine_dir / MANIFEST_NAME
    if not path.is_file():
        raise ManifestError(f"{path} is missing: {engine_dir} is not an engine folder "
                            "(or its export did not finish); re-run `python -m export target`")
    data = read_bounded(engine_path(engine_dir, MANIFEST_NAME), MAX_MANIFEST_BYTES, ManifestError)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ManifestError(f"{path} is not UTF-8 text (byte {exc.start}); re-export the engine folder") from None
    return Manifest.from_json(text, str(path))


def write_manifest(manifest: Manifest, engine_dir: str | os.PathLike) -> Path:
    """Write manifest.json atomically (temp file + rename)."""
    path = Path(engine_dir) / MANIFEST_NAME
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(manifest.to_json(), encoding="utf-8")
    os.replace(tmp, path)
    return path


MAX_MANIFEST_BYTES = 16 << 20  # far above any real manifest; a larger one is refused unread


def engine_path(engine_dir: str | os.PathLike, rel: str) -> Path:
    """The path of ``rel`` in ``engine_dir``, refused unless it names a regular file that lies
    inside the folder once symlinks are resolved. Every file the runtime reads from an engine
    folder goes through here: the folder is untrusted input, and a path or a link in it must
    not make the runtime read a file elsewhere, a device or a FIFO."""
    engine_dir = Path(engine_dir)
    try:
        check_relative_path(rel)
    except ValueError as exc:
        raise EngineError(f"{engine_dir}: {exc}; re-export the engine folder") from None
    path = engine_dir / rel
    root = engine_dir.resolve()
    real = path.resolve()
    if real != root and root not in real.parents:
        raise EngineError(f"{path} resolves to {real}, outside the engine folder {root}: "
                          "an engine folder may only name its own files; re-export it")
    if path.exists() and not path.is_file():
        raise EngineError(f"{path} is not a regular file (a folder, device or FIFO); re-export the engine folder")
    return path


def read_bounded(path: Path, max_bytes: int, error: type[Exception] = EngineError,
                 fix: str = "re-export the engine folder") -> bytes:
    """The bytes of ``path``, refused (unread past the limit) when it holds more than ``max_bytes``;
    ``fix`` ends the error's message."""
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as exc:
        raise error(f"cannot read {path} ({exc.strerror or exc}); check its permissions, or {fix}") from None
    if len(data) > max_bytes:
        raise error(f"{path} is larger than {max_bytes} bytes, far more than a file of its kind needs; {fix}")
    return data


def read_engine_file(manifest: "Manifest", engine_dir: str | os.PathLike, rel: str, max_bytes: int,
                     check_hash: bool = True) -> bytes:
    """The bytes of a file the manifest lists, checked against its recorded size (and sha256)
    before use; the bytes checked are the bytes returned (one read)."""
    try:
        entry = manifest.file_entry(rel)
    except KeyError:
        raise EngineError(f"{rel} is not listed in {MANIFEST_NAME}; re-export the engine folder") from None
    path = engine_path(engine_dir, rel)
    if not path.is_file():
        raise EngineError(f"{path} is missing (listed in {MANIFEST_NAME}); re-export the engine folder")
    data = read_bounded(path, max_bytes)
    if len(data) != entry.size:
        raise EngineError(f"{path} has {len(data)} bytes but {MANIFEST_NAME} records {entry.size}: "
                          "the file is truncated or was replaced; re-export the engine folder")
    if check_hash and hashlib.sha256(data).hexdigest() != entry.sha256:
        raise EngineError(f"{path} does not match its sha256 in {MANIFEST_NAME}: the file is corrupted or "
                          "was replaced; re-export it")
    return data


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_entry(engine_dir: str | os.PathLike, rel: str) -> FileEntry:
    path = Path(engine_dir) / rel
    return FileEntry(path=rel, sha256=sha256_file(path), size=path.stat().st_size)


def verify_files(manifest: Manifest, engine_dir: str | os.PathLike, paths: list[str] | None = None,
                 check_hashes: bool = True) -> None:
    """Check that the listed files exist with the recorded size (and sha256)."""
    engine_dir = Path(engine_dir)
    wanted = manifest.files if paths is None else [manifest.file_entry(p) for p in paths]
    for entry in wanted:
        path = engine_path(engine_dir, entry.path)
        if not path.is_file():
            raise EngineError(f"{path} is missing (listed in {MANIFEST_NAME}); re-export the engine folder")
        size = path.stat().st_size
        if size != entry.size:
            raise EngineError(f"{path} has {size} bytes but {MANIFEST_NAME} records {entry.size}: "
                              "the file is truncated or was replaced; re-export the engine folder")
        if check_hashes:
            digest = sha256_file(path)
            if digest != entry.sha256:
                raise EngineError(f"{path} sha256 {digest[:12]}… does not match {MANIFEST_NAME} "
                                  f"({entry.sha256[:12]}…): the file is corrupted or was replaced; re-export it")


def role_files(manifest: Manifest, role: str, precision: str) -> list[FileEntry]:
    """The listed files one role/precision loads: its graphs, their external data and the
    embedding tables they read."""
    graphs = {v.file for v in manifest.variants_for(role, precision)}
    tables = {t.file for t in manifest.embedding_tables if t.graph in graphs}
    return [f for f in manifest.files
            if f.path in graphs or f.path in tables or any(f.path.startswith(g + ".") for g in graphs)]


def verify_role_files(manifest: Manifest, engine_dir: str | os.PathLike, role: str, precision: str,
                      check_hashes: bool = True) -> None:
    """Check the graph files one role/precision uses (with their external data) and the tokenizer."""
    paths = [f.path for f in role_files(manifest, role, precision)]
    paths += [f.path for f in manifest.files if f.path == manifest.tokenizer.file]
    verify_files(manifest, engine_dir, paths, check_hashes=check_hashes)
