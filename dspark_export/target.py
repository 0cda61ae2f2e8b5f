"""``python -m export target`` / ``draft-model``: a source model → an engine folder.

Plan (validate options and source) → stage in a hidden sibling folder → load the FP32
PyTorch model → build one fused decoder graph per precision with onnxruntime-genai's model
builder (GroupQueryAttention, one shared past/present KV buffer, ``aux_hidden_states`` for
the drafter) → write tokenizer files → validate every graph against PyTorch → write
manifest.json last → rename into place. Any failure removes the staging folder.
"""

from __future__ import annotations

import copy
import datetime as _dt
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from dspark_edge.errors import ExportError
from dspark_edge.manifest import (INT4_OUTPUT_KEY, GraphIO, Manifest, ModelInfo, SCHEMA_VERSION, Variant,
                                  file_entry, write_manifest)

from .atomic import publish, staging
from .atomic import scratch as scratch_dir
from .embedding_table import separate_embedding_table
from .gguf_blocks import FP32_PIECES, INT4_ACTIVATIONS, int4_weights_note, rewrite_to_gguf_blocks
from .portable import PORTABLE_IO, PORTABLE_PRECISIONS
from .sources import Source, load_source, resolve_source, source_digest

log = logging.getLogger(__name__)

TARGET_PRECISIONS = ("fp32", "int8", "int4")
# "fused": onnxruntime-genai's CPU-tuned graph (contrib operators); "portable": standard operators
# only, for TensorRT and GPU providers (export.portable).
GRAPHS = ("fused", "portable")
DEFAULT_WIDTHS = (1, 2, 3, 4, 6, 8)
MAX_WIDTH = 64
GRAPH_IO = GraphIO(input_ids="input_ids", attention_mask="attention_mask",
                   past_key="past_key_values.{layer}.key", past_value="past_key_values.{layer}.value",
                   present_key="present.{layer}.key", present_value="present.{layer}.value",
                   logits="logits", hidden_states="aux_hidden_states", kv_layout="shared_buffer")

Progress = Callable[[str], None]


@dataclass(frozen=True)
class ExportOptions:
    """What to export. ``role`` "target" builds the target (verify widths, hidden-state output
    for drafters); "draft_model" builds an independent draft model (width 1, no hidden states),
    optionally keeping only its first ``keep_layers`` layers, and checks that it shares the
    tokenizer of the engine folder ``target_engine``. ``hidden_layers`` are indices of residual
    streams entering those layers (1 .. num_layers-1); None picks three spread over the depth.
    ``overwrite`` replaces an existing engine folder (atomically)."""

    source: str
    output: Path
    precisions: tuple[str, ...] = ("fp32", "int8")
    widths: tuple[int, ...] = DEFAULT_WIDTHS
    hidden_layers: tuple[int, ...] | None = None
    overwrite: bool = False
    validate: bool = True
    role: str = "target"
    keep_layers: int | None = None
    target_engine: Path | None = None
    distill_minutes: float = 0.0
    distill_min_steps: int = 0  # at least this many distillation steps, whatever the clock says
    graph: str = "fused"
    int4_activations: str = "fp32"  # a GGUF's int4 graph: "fp32", or "int8x2" / "int8x3" (gguf_blocks)

    def __post_init__(self) -> None:
        object.__setattr__(self, "output", Path(self.output))
        if self.role not in ("target", "draft_model"):
            raise ExportError(f"role must be 'target' or 'draft_model', got {self.role!r}")
        if self.role == "draft_model":
            if self.hidden_layers:
                raise ExportError("a draft model exposes no hidden layers; drop --hidden-layers")
            object.__setattr__(self, "hidden_layers", ())
        if self.distill_minutes < 0 or (self.distill_minutes and (self.role != "draft_model" or not self.keep_layers)):
            raise ExportError("distillation needs a draft model made smaller with --keep-layers "
                              f"(and minutes >= 0), got minutes={self.distill_minutes}, keep_layers={self.keep_layers}")
        if self.keep_layers is not None and self.keep_layers < 1:
            raise ExportError(f"keep_layers must be >= 1, got {self.keep_layers}")
        if self.target_engine is not None:
            object.__setattr__(self, "target_engine", Path(self.target_engine))
            if not (self.target_engine / "manifest.json").is_file():
                raise ExportError(f"--target {self.target_engine} is not an engine folder (no manifest.json)")
        if self.graph not in GRAPHS:
            raise ExportError(f"graph must be one of {list(GRAPHS)}, got {self.graph!r}")
        if self.int4_activations not in INT4_ACTIVATIONS:
            raise ExportError(f"int4 activations must be one of {list(INT4_ACTIVATIONS)}, "
                              f"got {self.int4_activations!r}")
        if self.int4_activations != "fp32" and "int4" not in self.precisions:
            raise ExportError(f"--int4-activations {self.int4_activations} shapes the int4 graph: add int4 to "
                              "--precisions, or drop the option")
        allowed = TARGET_PRECISIONS if self.graph == "fused" else PORTABLE_PRECISIONS
        if not self.precisions:
            raise ExportError("precisions is empty: name at least one of " + ", ".join(allowed))
        bad = [p for p in self.precisions if p not in allowed]
        if bad:
            hint = (" (fp16 needs --graph portable)" if self.graph == "fused" and "fp16" in bad else
                    " (int4 needs --graph fused)" if "int4" in bad else "")
            raise ExportError(f"unsupported precision(s) {bad} for the {self.graph} graph: choose from "
                              f"{list(allowed)}{hint}")
        if len(set(self.precisions)) != len(self.precisions):
            raise ExportError(f"precisions lists one twice: {list(self.precisions)}")
        if not self.widths or any(not isinstance(w, int) or not 1 <= w <= MAX_WIDTH for w in self.widths):
            raise ExportError(f"verify widths must be integers in [1, {MAX_WIDTH}], got {list(self.widths)}")
        if 1 not in self.widths:
            raise ExportError(f"verify widths must include 1 (plain decoding), got {list(self.widths)}")
        object.__setattr__(self, "widths", tuple(sorted(set(self.widths))))
        if self.output.exists() and not self.overwrite:
            raise ExportError(f"{self.output} already exists: pass --overwrite to replace it, or choose another --output")
        if self.output.exists() and not (self.output / "manifest.json").is_file() and any(self.output.iterdir()):
            raise ExportError(f"{self.output} exists and is not an engine folder; refusing to replace it")


def default_hidden_layers(num_layers: int, count: int = 3) -> tuple[int, ...]:
    """``count`` residual streams spread over the depth, never the input or final one."""
    if num_layers < 2:
        return ()
    picks = sorted({max(1, min(num_layers - 1, round(num_layers * (i + 1) / (count + 1)))) for i in range(count)})
    return tuple(picks)


def _check_hidden_layers(layers: tuple[int, ...], num_layers: int) -> None:
    bad = [i for i in layers if not 1 <= i < num_layers]
    if bad:
        raise ExportError(f"hidden layer(s) {bad} out of range: the model has {num_layers} layers, so indices "
                          f"must be in [1, {num_layers - 1}] (the final layer is never exposed)")


def _model_info(source: Source, config, digest: str) -> ModelInfo:
    heads = config.num_attention_heads
    return ModelInfo(
        name=source.name, architecture=config.model_type, source=source.description, source_sha256=digest,
        num_layers=config.num_hidden_layers, hidden_size=config.hidden_size, num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        vocab_size=config.vocab_size, max_position_embeddings=config.max_position_embeddings)


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("dspark-edge", "torch", "transformers", "onnx", "onnxruntime", "onnxruntime-genai"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def _die_with_parent() -> None:
    """In the builder child (Linux): get SIGKILL when the exporter dies, so a killed export
    leaves no orphan writing into its staging folder."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def build_graph(hf_dir: Path, out_dir: Path, precision: str, hidden_layers: tuple[int, ...], log_path: Path,
                keep_all: bool = False) -> None:
    """Run onnxruntime-genai's model builder for one precision (CPU-targeted graph). The builder's
    other files (genai_config.json, the tokenizer) are removed unless ``keep_all`` (an
    onnxruntime-genai model folder, e.g. for a benchmark against onnxruntime-genai itself)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cache = out_dir.parent / f".builder-cache-{precision}"
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(out_dir),
           "-p", precision, "-e", "cpu", "-c", str(cache)]
    if hidden_layers:
        cmd += ["--extra_options", "aux_hidden_state_layers=" + ",".join(str(i) for i in hidden_layers)]
    # The builder stamps the graph's producer_version with `git rev-parse HEAD` run five folders
    # above its own file: with the environment inside a git checkout (.venv in this project),
    # that is the checkout's commit, and every commit would change the graph's hash (and mark
    # every device profile stale). No git repository for it: it falls back to its own release.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GIT_DIR": os.devnull}
    with open(log_path, "w") as logf:
        proc = subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent)
    shutil.rmtree(cache, ignore_errors=True)
    if proc.returncode != 0:
        tail = log_path.read_text(errors="replace").replace("\r", "\n").splitlines()[-15:]
        raise ExportError(f"the graph builder failed for {precision} (exit {proc.returncode}):\n  "
                          + "\n  ".join(tail))
    if not keep_all:  # only the graph and its weights: the manifest is the one description of the folder
        for extra in out_dir.iterdir():
            if extra.name not in ("model.onnx", "model.onnx.data"):
                shutil.rmtree(extra) if extra.is_dir() else extra.unlink()
    if not (out_dir / "model.onnx").is_file():
        raise ExportError(f"the graph builder wrote no model.onnx for {precision}; see {log_path}")


def _truncate(model, keep: int) -> None:
    """Keep the first ``keep`` decoder layers (a cheap draft model made from a larger one)."""
    n = model.config.num_hidden_layers
    if keep > n:
        raise ExportError(f"keep_layers={keep} but the source has only {n} layers")
    model.model.layers = model.model.layers[:keep]
    model.config.num_hidden_layers = keep
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:keep]


def _check_draft_compatible(manifest: Manifest, target_engine: Path, output: Path) -> None:
    """The runtime's own draft/target check, run before validation so a mismatch stops early."""
    from dspark_edge.drafters.draft_model import check_compatible
    from dspark_edge.errors import EngineError
    from dspark_edge.manifest import read_manifest

    try:
        check_compatible(read_manifest(target_engine), manifest, output)
    except EngineError as exc:
        raise ExportError(f"{exc}; nothing was written") from exc


def calibration_prompts(count: int = 32) -> list[list[dict]]:
    """The first ``count`` chat prompts of the project's distillation set (INT8 calibration)."""
    import json
    from importlib.resources import files

    text = (files("dspark_export") / "data" / "distill_prompts.jsonl").read_text(encoding="utf-8")
    return [json.loads(line)["messages"] for line in text.splitlines()[:count]]


def calibration_sequences(hf_tok, count: int = 32) -> list[list[int]]:
    """Token ids of real prompts (chat-formatted when the tokenizer has a template) for INT8 calibration."""
    seqs = []
    for messages in calibration_prompts(count):
        if getattr(hf_tok, "chat_template", None):
            ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        else:
            ids = hf_tok(messages[-1]["content"], add_special_tokens=False)["input_ids"]
        seqs.append([int(i) for i in ids])
    return seqs


def _build_portable(model, hf_tok, options: ExportOptions, info: ModelInfo, layers, stage: Path, scratch: Path,
                    say: Progress, step: Callable[[], int], steps: int) -> list[Variant]:
    """The portable graph at every requested precision (FP16 and INT8 are made from FP32)."""
    from .portable import convert_fp16, export_fp32, quantize_int8

    role = options.role
    t0 = time.perf_counter()
    fp32 = (stage if "fp32" in options.precisions else scratch) / role / "fp32" / "model.onnx"
    export_fp32(model, info, layers, fp32)
    say(f"      traced in {time.perf_counter() - t0:.1f}s")
    variants = []
    for precision in options.precisions:
        rel = f"{role}/{precision}/model.onnx"
        if precision != "fp32":
            t0 = time.perf_counter()
            say(f"[{step()}/{steps}] making the {precision} portable graph")
            if precision == "fp16":
                convert_fp16(fp32, stage / rel)
            else:
                quantize_int8(fp32, stage / rel, calibration_sequences(hf_tok), info, say)
            say(f"      {precision} graph made in {time.perf_counter() - t0:.1f}s")
        device = "gpu" if precision == "fp16" else "any"
        variants += [Variant(role=role, width=w, precision=precision, backend="onnxruntime", file=rel,
                             device=device) for w in options.widths]
    return variants


def export_target(options: ExportOptions, progress: Progress | None = None) -> Manifest:
    """Export ``options.source`` into ``options.output``; returns the written manifest."""
    say = progress or (lambda msg: log.info("%s", msg))
    source = resolve_source(options.source)
    if options.int4_activations != "fp32" and (source.kind == "hf" or options.distill_minutes):
        raise ExportError(f"--int4-activations {options.int4_activations} applies to int4 made from a GGUF's own "
                          "blocks; this int4 graph is re-quantized by the model builder: drop the option")
    pieces = INT4_ACTIVATIONS[options.int4_activations]
    try:
        if options.graph == "fused":
            import onnxruntime_genai.models.builder  # noqa: F401  (fail before any long work)
        else:
            import onnx  # noqa: F401
            import onnxruntime.quantization  # noqa: F401
    except ImportError as exc:
        need = ("dspark-edge[cpu,export,export-fused]' (onnxruntime-genai's model builder)" if options.graph == "fused"
                else "dspark-edge[cpu,export]' or 'dspark-edge[gpu,export]'")
        raise ExportError(f"the {options.graph} exporter needs: pip install '{need} ({exc})") from exc
    from .tokenizer import write_tokenizer
    from .validate import VALIDATION_PROMPTS, torch_reference, validate_precision

    graph_steps = len(options.precisions) if options.graph == "fused" else len(set(options.precisions) - {"fp32"})
    steps = 4 + graph_steps + (1 if options.validate else 0)
    n = iter(range(1, steps + 1))
    t_start = time.perf_counter()
    with staging(options.output) as stage, scratch_dir(options.output) as scratch:
        say(f"[{next(n)}/{steps}] loading {source.description} as an FP32 PyTorch model")
        model, hf_tok = load_source(source)
        extra_info: dict[str, str] = {}
        teacher = copy.deepcopy(model) if options.distill_minutes else None
        if options.keep_layers is not None:
            _truncate(model, options.keep_layers)
        if teacher is not None:
            from .distill import distill

            say(f"      distilling the {options.keep_layers}-layer draft against the full model for "
                f"{options.distill_minutes:g} min")
            report = distill(model, teacher, hf_tok, options.distill_minutes, say,
                             target_engine=options.target_engine, min_steps=options.distill_min_steps)
            extra_info = {f"distill_{k}": f"{v:.4g}" if isinstance(v, float) else str(v) for k, v in report.items()}
            extra_info["distill_minutes"] = f"{options.distill_minutes:g}"
            del teacher
        # A GGUF's Q4_1 blocks are the model itself: int4 takes them as they are (export.gguf_blocks)
        # unless distillation changed the weights; from other sources the builder re-quantizes.
        exact_int4 = "int4" in options.precisions and source.kind != "hf" and not options.distill_minutes
        if "int4" in options.precisions:
            extra_info["int4_weights"] = (int4_weights_note(pieces) if exact_int4 else
                                          "re-quantized by onnxruntime-genai's model builder")
            # The runtime's precision="auto" may pick int4 only where this says its output is FP32's.
            extra_info[INT4_OUTPUT_KEY] = "fp32" if exact_int4 and pieces in FP32_PIECES else "approximate"
        config = model.config
        layers = options.hidden_layers if options.hidden_layers is not None else default_hidden_layers(
            config.num_hidden_layers)
        _check_hidden_layers(layers, config.num_hidden_layers)
        info = _model_info(source, config, source_digest(source))
        tables: list = []
        if options.graph == "portable":
            say(f"[{next(n)}/{steps}] tracing the portable FP32 graph (standard ONNX operators)")
            variants = _build_portable(model, hf_tok, options, info, layers, stage, scratch, say,
                                       lambda: next(n), steps)
        else:
            say(f"[{next(n)}/{steps}] writing the FP32 checkpoint for the graph builder")
            hf_dir = scratch / "hf"
            model.save_pretrained(hf_dir)
            hf_tok.save_pretrained(hf_dir)
            variants = []
            # FP32 first: an int4 graph from a GGUF's own blocks is rewritten from it.
            for precision in sorted(options.precisions, key=lambda p: p != "fp32"):
                t0 = time.perf_counter()
                rel = f"{options.role}/{precision}"
                if precision == "int4" and exact_int4:
                    say(f"[{next(n)}/{steps}] building the int4 {options.role} graph from the GGUF's own "
                        f"blocks ({options.int4_activations} activations)")
                    fp32_dir = stage / f"{options.role}/fp32"
                    if "fp32" not in options.precisions:
                        fp32_dir = scratch / "fp32-for-int4"
                        build_graph(hf_dir, fp32_dir, "fp32", layers, scratch / "builder-fp32.log")
                    counts = rewrite_to_gguf_blocks(fp32_dir / "model.onnx", source.path, stage / rel / "model.onnx",
                                                    say, pieces=pieces)
                    extra_info.update({f"int4_{k}": str(v) for k, v in counts.items()})
                else:
                    say(f"[{next(n)}/{steps}] building the {precision} {options.role} graph (hidden layers "
                        f"{list(layers)})")
                    build_graph(hf_dir, stage / rel, precision, layers, scratch / f"builder-{precision}.log")
                variants += [Variant(role=options.role, width=w, precision=precision, backend="onnxruntime",
                                     file=f"{rel}/model.onnx") for w in options.widths]
                say(f"      {precision} graph built in {time.perf_counter() - t0:.1f}s")
            # After every graph is built: the int4 rewrite reads the FP32 graph as the builder wrote it.
            for precision in options.precisions:
                rel = f"{options.role}/{precision}/model.onnx"
                if precision in ("fp32", "int8"):
                    table = separate_embedding_table(stage / rel, rel, info.vocab_size, info.hidden_size, say)
                    tables += [table] if table is not None else []
        say(f"[{next(n)}/{steps}] writing tokenizer and chat template")
        gen_cfg = getattr(model, "generation_config", None)
        own = source.path / "tokenizer.json" if source.kind == "hf" else None
        tok_info = write_tokenizer(hf_tok, config, stage, gen_cfg, source_file=own)
        graph_io = PORTABLE_IO if options.graph == "portable" else GRAPH_IO
        say(f"[{next(n)}/{steps}] hashing files")
        files = tuple(file_entry(stage, p.relative_to(stage).as_posix())
                      for p in sorted(stage.rglob("*")) if p.is_file())
        manifest = Manifest(
            schema_version=SCHEMA_VERSION,
            created_utc=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            exporter={**_versions(), **extra_info}, model=info, tokenizer=tok_info,
            io=graph_io if layers else replace(graph_io, hidden_states=None), hidden_state_layers=layers,
            variants=tuple(variants), files=files, embedding_tables=tuple(tables))
        if options.target_engine is not None:
            _check_draft_compatible(manifest, options.target_engine, options.output)
        if options.validate:
            say(f"[{next(n)}/{steps}] validating against PyTorch ({len(VALIDATION_PROMPTS)} prompts, "
                f"greedy 32 tokens, widest verify width {max(options.widths)})")
            refs = [torch_reference(model, hf_tok(p, add_special_tokens=False)["input_ids"], layers)
                    for p in VALIDATION_PROMPTS]
            results = []
            for precision in options.precisions:
                r = validate_precision(manifest, stage, precision, refs, role=options.role,
                                       exact=precision == "int4" and exact_int4)
                say(f"      {precision}: max|Δlogit| {r.max_abs_logit_diff:.2e}, max|Δhidden| "
                    f"{r.max_abs_hidden_diff:.2e}, greedy {r.greedy_tokens_matched}/{r.greedy_tokens_compared}, "
                    f"top-1 {r.teacher_forced_top1:.0%} {'ok' if r.passed else 'FAILED'}")
                results.append(r)
            manifest = replace(manifest, validation=tuple(results))
            failed = [r for r in results if not r.passed]
            if failed:
                raise ExportError("validation against PyTorch failed for "
                                  + ", ".join(f"{r.precision} (max|Δlogit| {r.max_abs_logit_diff:.3g}, greedy "
                                              f"{r.greedy_tokens_matched}/{r.greedy_tokens_compared}, top-1 {r.teacher_forced_top1:.0%})"
                                              for r in failed)
                                  + "; nothing was written")
        write_manifest(manifest, stage)
        publish(stage, options.output)
    say(f"engine folder {options.output} written in {time.perf_counter() - t_start:.0f}s")
    return manifest
