"""``python -m export trt --engine DIR``: TensorRT engines from an engine folder's portable graphs.

Planning (``plan_engines``) is pure and runs anywhere: which ONNX file each precision builds
from, one optimization profile per verify width (input_ids static at [1, w], past length
0 .. max_context - w) and one prefill profile (1 .. prefill_max new tokens), and the manifest
entries. Building (``build_engines``) needs TensorRT and an NVIDIA GPU: it parses the ONNX with
TensorRT's parser, builds a strongly typed network (the graph's own types decide the
precision: FP16 from the FP16 graph, INT8 from the explicitly quantized QDQ graph), reuses and
updates a timing cache, and writes ``trt-<id>/<precision>.engine``. All variants of a
precision live in one engine with several profiles, so the weights are in device memory once.
The manifest is rewritten atomically only after every engine was built and deserialized.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dspark_edge.errors import DSparkError, ExportError
from dspark_edge.manifest import (Manifest, TensorRTEngine, Variant, file_entry, read_manifest, verify_files,
                                  write_manifest)

log = logging.getLogger(__name__)

TRT_PRECISIONS = ("fp16", "int8")
DEFAULT_MAX_CONTEXT = 2048
DEFAULT_OPT_CONTEXT = 512
DEFAULT_PREFILL_MAX = 128  # the runtime's prefill chunk
DEFAULT_WORKSPACE_MIB = 1024

Shape = tuple[int, ...]


@dataclass(frozen=True)
class ProfilePlan:
    """One optimization profile: (min, opt, max) shape of every input."""

    width: int  # new tokens (0: the prefill profile)
    shapes: dict[str, tuple[Shape, Shape, Shape]]


@dataclass(frozen=True)
class EnginePlan:
    precision: str
    onnx: str  # relative to the engine folder
    engine: str  # relative path the engine will have
    profiles: tuple[ProfilePlan, ...]
    prefill_max: int
    max_context: int
    strongly_typed: bool = True
    workspace_bytes: int = DEFAULT_WORKSPACE_MIB << 20

    @property
    def widths(self) -> tuple[int, ...]:
        return tuple(p.width for p in self.profiles)

    def summary(self) -> dict:
        """The plan in brief: per profile, the (min, opt, max) shape of input_ids and of every past."""
        profiles = []
        for p in self.profiles:
            (ids, *pasts) = p.shapes.values()
            profiles.append({"width": p.width or f"prefill 1..{self.prefill_max}", "input_ids": ids,
                             "past (each of %d)" % len(pasts): pasts[0]})
        return {"precision": self.precision, "onnx": self.onnx, "engine": self.engine,
                "max_context": self.max_context, "profiles": profiles}


def plan_engines(manifest: Manifest, precisions: tuple[str, ...] = TRT_PRECISIONS,
                 max_context: int = DEFAULT_MAX_CONTEXT, opt_context: int = DEFAULT_OPT_CONTEXT,
                 prefill_max: int = DEFAULT_PREFILL_MAX, folder: str = "trt") -> list[EnginePlan]:
    """What ``build_engines`` will build for ``manifest`` (no TensorRT needed)."""
    io = manifest.io
    if io.kv_layout != "append":
        raise ExportError("TensorRT engines are built from the portable graph (standard ONNX operators); this "
                          "folder holds the fused ONNX Runtime graph. Export one with "
                          "`python -m export target --graph portable --precisions fp32,fp16,int8 --output DIR`")
    bad = [p for p in precisions if p not in TRT_PRECISIONS]
    if bad or not precisions:
        raise ExportError(f"TensorRT precisions must be among {list(TRT_PRECISIONS)}, got {list(precisions)}")
    m = manifest.model
    max_context = min(max_context, m.max_position_embeddings)
    if max_context < 2:
        raise ExportError(f"max_context must be >= 2, got {max_context}")
    if prefill_max < 1:
        raise ExportError(f"prefill_max must be >= 1, got {prefill_max}")
    prefill_max = min(prefill_max, max_context - 1)
    kv = (m.num_kv_heads, m.head_dim)
    pasts = [past for past, _ in io.kv_names(m.num_layers)]
    plans = []
    for precision in precisions:
        variants = manifest.variants_for("target", precision, "onnxruntime")
        if not variants:
            have = manifest.precisions("target")
            raise ExportError(f"the folder has no {precision} portable graph (it has {have}); export it with "
                              f"`python -m export target --graph portable --precisions ...,{precision}`")
        onnx = variants[0].file
        widths = sorted({v.width for v in variants})
        if widths[-1] >= max_context:
            raise ExportError(f"verify width {widths[-1]} leaves no context at max_context {max_context}")
        profiles = []
        for w in widths + [0]:
            lo, hi = (w, w) if w else (1, prefill_max)
            opt_new = w if w else min(prefill_max, 64)
            past_max = max_context - hi
            past_opt = min(opt_context, past_max)
            shapes: dict[str, tuple[Shape, Shape, Shape]] = {io.input_ids: ((1, lo), (1, opt_new), (1, hi))}
            for name in pasts:
                shapes[name] = ((1, 0, *kv), (1, past_opt, *kv), (1, past_max, *kv))
            profiles.append(ProfilePlan(w, shapes))
        plans.append(EnginePlan(precision=precision, onnx=onnx, engine=f"{folder}/{precision}.engine",
                                profiles=tuple(profiles), prefill_max=prefill_max, max_context=max_context))
    return plans


def manifest_with_engines(manifest: Manifest, engine_dir: Path, plans: list[EnginePlan],
                          built: dict[str, dict[str, str]], timing_cache: str | None) -> Manifest:
    """``manifest`` listing the built engines (replacing earlier TensorRT entries)."""
    old = {e.file.split("/")[0] for e in manifest.tensorrt}
    files = [f for f in manifest.files if f.path.split("/")[0] not in old]
    variants = [v for v in manifest.variants if v.backend != "tensorrt"]
    engines = []
    for plan in plans:
        files.append(file_entry(engine_dir, plan.engine))
        info = built[plan.precision]
        engines.append(TensorRTEngine(file=plan.engine, onnx=plan.onnx, precision=plan.precision,  # type: ignore[arg-type]
                                      profiles=plan.widths, prefill_max=plan.prefill_max,
                                      max_context=plan.max_context, tensorrt_version=info["tensorrt"],
                                      gpu=info["gpu"], compute_capability=info["compute_capability"],
                                      timing_cache=timing_cache))
        variants += [Variant(role="target", width=w, precision=plan.precision, backend="tensorrt",  # type: ignore[arg-type]
                             file=plan.engine, device="gpu") for w in plan.widths if w]
    if timing_cache:
        files.append(file_entry(engine_dir, timing_cache))
    return dataclasses.replace(manifest, files=tuple(files), variants=tuple(variants), tensorrt=tuple(engines))


def _require_tensorrt() -> str:
    from dspark_edge.backends.trt import require_tensorrt

    try:
        return require_tensorrt()
    except DSparkError as exc:
        raise ExportError(str(exc)) from exc


def build_engine(plan: EnginePlan, engine_dir: Path, out: Path, timing_cache: Path | None,
                 say: Callable[[str], None]) -> dict[str, str]:
    """Build one plan into ``out`` (TensorRT and a GPU needed); returns what the manifest records."""
    version = _require_tensorrt()
    import tensorrt as trt

    from dspark_edge.backends.trt import gpu_identity

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 0
    if plan.strongly_typed and hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"):
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    onnx_path = engine_dir / plan.onnx
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise ExportError(f"TensorRT could not parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, plan.workspace_bytes)
    cache_bytes = timing_cache.read_bytes() if timing_cache is not None and timing_cache.is_file() else b""
    cache = config.create_timing_cache(cache_bytes)
    config.set_timing_cache(cache, ignore_mismatch=False)
    for p in plan.profiles:
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in p.shapes.items():
            profile.set_shape(name, trt.Dims(list(lo)), trt.Dims(list(opt)), trt.Dims(list(hi)))
        config.add_optimization_profile(profile)
    t0 = time.perf_counter()
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise ExportError(f"TensorRT failed to build the {plan.precision} engine from {plan.onnx}; "
                          "run with -v for the builder's log")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(bytes(serialized))
    if timing_cache is not None:
        timing_cache.write_bytes(bytes(config.get_timing_cache().serialize()))
    # A plan that does not deserialize here would fail at load time: find out now.
    if trt.Runtime(logger).deserialize_cuda_engine(out.read_bytes()) is None:
        raise ExportError(f"the {plan.precision} engine built but does not deserialize")
    gpu = gpu_identity()
    say(f"      {plan.precision} engine: {out.stat().st_size / 2**20:.1f} MiB, {len(plan.profiles)} profiles, "
        f"built in {time.perf_counter() - t0:.0f}s on {gpu['gpu']}")
    return {"tensorrt": version, **gpu}


def build_engines(engine_dir: Path, precisions: tuple[str, ...] = TRT_PRECISIONS,
                  max_context: int = DEFAULT_MAX_CONTEXT, opt_context: int = DEFAULT_OPT_CONTEXT,
                  progress: Callable[[str], None] | None = None) -> Manifest:
    """Build TensorRT engines for ``engine_dir`` and list them in its manifest (atomically)."""
    say = progress or (lambda msg: log.info("%s", msg))
    engine_dir = Path(engine_dir)
    if not (engine_dir / "manifest.json").is_file():
        raise ExportError(f"{engine_dir} is not an engine folder (no manifest.json)")
    manifest = read_manifest(engine_dir)
    verify_files(manifest, engine_dir, check_hashes=False)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
    folder, n = f"trt-{stamp}", 1
    while (engine_dir / folder).exists():  # never overwrite what the manifest may list
        folder, n = f"trt-{stamp}-{n}", n + 1
    plans = plan_engines(manifest, precisions, max_context, opt_context, folder=folder)
    _require_tensorrt()  # fail before any work
    old_cache = next((engine_dir / e.timing_cache for e in manifest.tensorrt if e.timing_cache), None)
    stage = engine_dir / f".{folder}.partial"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir()
    built: dict[str, dict[str, str]] = {}
    try:
        cache = stage / "timing.cache"
        if old_cache is not None and old_cache.is_file():
            shutil.copyfile(old_cache, cache)
        for i, plan in enumerate(plans, 1):
            say(f"[{i}/{len(plans)}] building the {plan.precision} TensorRT engine from {plan.onnx} "
                f"(profiles: widths {[w for w in plan.widths if w]} + prefill 1..{plan.prefill_max}, "
                f"context ≤ {plan.max_context})")
            built[plan.precision] = build_engine(plan, engine_dir, stage / Path(plan.engine).name, cache, say)
        stage.rename(engine_dir / folder)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    new = manifest_with_engines(manifest, engine_dir, plans, built, f"{folder}/timing.cache")
    write_manifest(new, engine_dir)
    for e in manifest.tensorrt:
        old = e.file.split("/")[0]
        if old != folder:
            shutil.rmtree(engine_dir / old, ignore_errors=True)
    say(f"done: {engine_dir} lists TensorRT engines for {', '.join(p.precision for p in plans)}")
    return new
