"""ONNX Runtime decoder: one session per graph file, used at every width (weights shared).

The KV cache is preallocated once per cache on the session's device (host memory for the
CPU provider, GPU memory for the CUDA and TensorRT providers) and bound with IOBinding, so a
step copies no cache and, on a GPU, the cache never leaves the device:
- "shared_buffer" graphs (the fused graph): past and present are one [1, kv_heads, capacity,
  head_dim] buffer per layer, bound as both input and output once per cache;
- "append" graphs (the portable graph): past is bound to the committed prefix of a
  sequence-major buffer and the new-K/V output right after it (``layout.AppendLayout``).
Logits and hidden states are written into preallocated host arrays (one set per decode width).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import replace

import numpy as np

from ..errors import BackendError, EngineError
from ..manifest import GraphIO, ModelInfo
from .base import BackendOptions, ForwardOutput, KVCache, output_buffers
from .layout import AppendLayout

log = logging.getLogger(__name__)

# Providers whose tensors live in CUDA device memory.
CUDA_PROVIDERS = ("CUDAExecutionProvider", "TensorrtExecutionProvider")


def _import_ort():
    try:
        import onnxruntime as ort
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise BackendError("onnxruntime is not installed: install dspark-edge[cpu] "
                           "(or dspark-edge[gpu] for onnxruntime-gpu, never both)") from exc
    _check_single_build()
    return ort


@functools.cache
def _check_single_build() -> None:
    """onnxruntime and onnxruntime-gpu install the same module; together, whichever was
    installed last silently wins. Refuse to guess."""
    builds = installed_ort_builds()
    if len(builds) > 1:
        raise BackendError(f"{' and '.join(builds)} are both installed and shadow each other: keep one "
                           "(pip uninstall -y onnxruntime onnxruntime-gpu, then install dspark-edge[cpu] or "
                           "dspark-edge[gpu])")


def installed_ort_builds() -> list[str]:
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for dist in ("onnxruntime", "onnxruntime-gpu"):
        try:
            version(dist)
            found.append(dist)
        except PackageNotFoundError:
            pass
    return found


def resolve_providers(options: BackendOptions) -> tuple[list[str], list[dict]]:
    """The providers to request, checked against this onnxruntime build."""
    ort = _import_ort()
    available = ort.get_available_providers()
    opts = options.option_dicts()
    if len(opts) != len(options.providers):
        raise BackendError(f"provider_options has {len(opts)} entries for {len(options.providers)} providers")
    chosen, chosen_opts = [], []
    for name, o in zip(options.providers, opts):
        if name in available:
            chosen.append(name)
            chosen_opts.append(o)
        elif options.fallback_to_cpu:
            log.warning("execution provider %s is not available in this onnxruntime build (available: %s); "
                        "falling back as configured", name, ", ".join(available))
        else:
            raise BackendError(
                f"execution provider {name} is not available in this onnxruntime build "
                f"(available: {', '.join(available)}). Install the build that has it (dspark-edge[gpu] "
                "for CUDA/TensorRT providers), pick another provider, or set fallback_to_cpu=True")
    if not chosen or (options.fallback_to_cpu and "CPUExecutionProvider" not in chosen):
        chosen.append("CPUExecutionProvider")
        chosen_opts.append({})
    return chosen, chosen_opts


def open_session(path: str | bytes, options: BackendOptions, qdq: bool = False,
                 initializers: dict[str, np.ndarray] | None = None, external_folder: str | None = None,
                 label: str | None = None):
    """An InferenceSession for ``path`` (or a serialized graph, whose external weight files are
    in ``external_folder``) with the options' threads, spinning and providers. ``label`` names
    the graph in errors (default: ``path``, or "a serialized graph" for bytes).

    ``initializers``: arrays that replace the graph's initializers of those names on the CPU
    provider (onnxruntime computes with the caller's memory; the session keeps a reference).
    On other providers the session reads the graph's own files as usual.

    ``qdq``: the graph is explicitly quantized (the portable INT8 graph). On the CPU provider its
    QDQ fusions are turned off: the fused int8 kernels they make are far slower than FP32 for this
    graph (docs/notes/, "Portable graph on the CPU"), while the quantize-dequantize pairs run as
    written keep the same int8 rounding with FP32 products. INT8 speed on a CPU comes from the
    fused graph's int8; the portable graph's int8 is for TensorRT."""
    ort = _import_ort()
    so = ort.SessionOptions()
    if _SHARED_POOL or (options.shared_threads and _shared_pool(options.intra_op_threads)):
        # Once the process-wide pool exists onnxruntime refuses sessions with pools of their own.
        so.use_per_session_threads = False
    else:
        if options.intra_op_threads is not None:
            so.intra_op_num_threads = options.intra_op_threads
        so.add_session_config_entry("session.intra_op.allow_spinning", "1" if options.allow_spinning else "0")
    if qdq and (options.providers[:1] or ("CPUExecutionProvider",))[0] == "CPUExecutionProvider":
        so.add_session_config_entry("session.disable_quant_qdq", "1")
    so.log_severity_level = 3
    if external_folder is not None:
        so.add_session_config_entry("session.model_external_initializers_file_folder_path", external_folder)
    providers, provider_options = resolve_providers(options)
    values = []
    if initializers and providers[0] == "CPUExecutionProvider":
        for name, array in initializers.items():
            values.append(ort.OrtValue.ortvalue_from_numpy(array))
            so.add_initializer(name, values[-1])
    try:
        session = ort.InferenceSession(path, so, providers=providers, provider_options=provider_options)
    except Exception as exc:  # onnxruntime raises several unrelated types here
        name = label or (path if isinstance(path, str) else "a serialized graph")
        raise EngineError(f"onnxruntime could not load {name}: {exc}. The file may be truncated or "
                          "corrupted, or need a newer onnxruntime; re-export the engine folder") from exc
    check_created_providers(providers, session.get_providers(), options.fallback_to_cpu)
    session.dspark_initializers = (initializers, values)  # the memory the session computes with
    return session


_SHARED_POOL: list[int] = []  # the threads the process-wide pool was requested with, once requested


def _shared_pool(threads: int | None) -> bool:
    """Ask ONNX Runtime for the process-wide intra-op pool (once per process; ``threads`` None:
    its default, one per physical core). False when this onnxruntime build cannot: the caller
    then gives the session a pool of its own."""
    if not _SHARED_POOL:
        try:
            from onnxruntime.capi import _pybind_state
            _pybind_state.set_global_thread_pool_sizes(threads or 0, 1)
        except (ImportError, AttributeError, RuntimeError) as exc:
            log.warning("this onnxruntime cannot share one thread pool between sessions (%s); each session "
                        "keeps its own", exc)
            return False
        _SHARED_POOL.append(threads or 0)
        log.info("sessions share the process-wide onnxruntime thread pool (%s threads)", threads or "default")
    elif (threads or 0) != _SHARED_POOL[0]:
        log.warning("the shared thread pool has %s threads already; intra_op_threads=%s does not resize it",
                    _SHARED_POOL[0] or "default", threads)
    return True


def check_created_providers(requested: list[str], created: list[str], fallback_to_cpu: bool) -> None:
    """onnxruntime drops a provider it cannot create (e.g. CUDA without its libraries or a GPU)
    with only a log line and runs on what is left; make that an error, or a warning when the
    user allowed falling back."""
    missing = [p for p in requested if p not in created]
    if not missing:
        return
    msg = (f"onnxruntime could not create {', '.join(missing)} and would run on {', '.join(created)}: check "
           "the GPU driver and the CUDA/cuDNN (and TensorRT) libraries that onnxruntime-gpu needs")
    if fallback_to_cpu:
        log.warning("%s; falling back as configured", msg)
        return
    raise BackendError(msg + ", or allow it with fallback_to_cpu=True (--fallback-to-cpu)")


def trt_ep_profile(io: GraphIO, model: ModelInfo, capacity: int, prefill_max: int = 128,
                   opt_context: int = 512) -> dict[str, str]:
    """Explicit shape ranges for ONNX Runtime's TensorRT provider on the portable graph: without
    them it rebuilds its engine whenever the past length grows past what it has seen."""
    new_max = max(1, min(prefill_max, capacity - 1))
    kv = f"x{model.num_kv_heads}x{model.head_dim}"
    pasts = [past for past, _ in io.kv_names(model.num_layers)]

    def shapes(new: int, past: int) -> str:
        return ",".join([f"{io.input_ids}:1x{new}"] + [f"{p}:1x{past}{kv}" for p in pasts])

    return {"trt_profile_min_shapes": shapes(1, 0),
            "trt_profile_opt_shapes": shapes(1, min(opt_context, capacity - new_max)),
            "trt_profile_max_shapes": shapes(new_max, capacity - new_max)}


def _with_trt_profile(options: BackendOptions, io: GraphIO, model: ModelInfo, capacity: int) -> BackendOptions:
    """``options`` with explicit TensorRT-provider shape ranges added where the user gave none."""
    name = "TensorrtExecutionProvider"
    if name not in options.providers or io.kv_layout != "append":
        return options
    opts = options.option_dicts()
    i = options.providers.index(name)
    if any(k.startswith("trt_profile_") for k in opts[i]):
        return options
    opts[i] = {**trt_ep_profile(io, model, capacity), **opts[i]}
    log.info("TensorRT provider: explicit shape ranges for %d-token context", capacity)
    return replace(options, provider_options=tuple(opts))


def kv_device(providers: tuple[str, ...], options: BackendOptions) -> tuple[str, int]:
    """(device type, device id) for the KV cache: the device of the session's first provider."""
    first = providers[0] if providers else "CPUExecutionProvider"
    if first not in CUDA_PROVIDERS:
        return "cpu", 0
    opts = dict(zip(options.providers, options.option_dicts())).get(first, {})
    return "cuda", int(opts.get("device_id", options.device_id))


class OrtKVCache(KVCache):
    def __init__(self, capacity: int, buffers: list, binding) -> None:
        super().__init__(capacity)
        self.buffers = buffers  # OrtValues, kept alive while bound
        self.binding = binding
        self.pointers = [int(b.data_ptr()) for b in buffers]


class OrtKVRows:
    """K/V buffers for several caches in one allocation per layer, [rows, kv heads, capacity,
    head dim]: row r is one cache's buffer (the fused graph's shared-buffer layout), so a pass
    over rows first..first+n-1 binds one contiguous block (``OrtDecoder.run_rows``)."""

    def __init__(self, arrays: list[np.ndarray], values: list) -> None:
        self.arrays, self.values = arrays, values  # the OrtValues wrap the arrays' memory
        self.rows = arrays[0].shape[0]
        self.row_shape = tuple(arrays[0].shape[1:])
        self.row_bytes = int(np.prod(self.row_shape)) * arrays[0].itemsize
        self.bases = [int(v.data_ptr()) for v in values]


class OrtDecoder:
    """A decoder graph in an ONNX Runtime session (see module docstring)."""

    def __init__(self, path: str, io: GraphIO, model: ModelInfo, options: BackendOptions,
                 hidden_width: int = 0, qdq: bool = False, initializers: dict | None = None) -> None:
        self.capacity = min(options.max_context, model.max_position_embeddings)
        options = _with_trt_profile(options, io, model, self.capacity)
        self.path, self.io, self.model, self.options = path, io, model, options
        self.session = open_session(path, options, qdq, initializers)
        self.initializers = initializers  # a slots session (``slots.SlotsDecoder``) computes with the same
        self.providers = tuple(self.session.get_providers())
        inputs = {i.name: i for i in self.session.get_inputs()}
        outputs = {o.name for o in self.session.get_outputs()}
        # (past, present) tensor names in the order of a cache's buffers
        self._kv_names = io.kv_names(model.num_layers)
        needed_in = [io.input_ids] + ([io.attention_mask] if io.attention_mask else []) + [
            past for past, _ in self._kv_names]
        needed_out = [io.logits] + [present for _, present in self._kv_names]
        missing = [n for n in needed_in if n not in inputs] + [n for n in needed_out if n not in outputs]
        if io.hidden_states and io.hidden_states not in outputs:
            missing.append(io.hidden_states)
        if missing:
            raise EngineError(f"{path} does not have the inputs/outputs its manifest names: missing "
                              f"{missing[:4]}{'…' if len(missing) > 4 else ''}; re-export the engine folder")
        kv_type = self._kv_type = inputs[io.past_key.format(layer=0)].type
        self.kv_dtype = {"tensor(float)": np.float32, "tensor(float16)": np.float16}.get(kv_type)
        if self.kv_dtype is None:
            raise EngineError(f"{path}: unsupported KV cache type {kv_type}")
        self._ones = np.ones((1, self.capacity), dtype=np.int64)
        self.max_step = self.capacity
        self._outputs: dict[int, tuple[np.ndarray, np.ndarray | None]] = {}
        self.cached_widths: frozenset[int] = frozenset()  # set by the caller: the decode widths
        self._hidden_width = hidden_width if io.hidden_states else 0
        self.device, self.device_id = kv_device(self.providers, options)
        self.layout = None
        if io.kv_layout == "append":
            self.layout = AppendLayout(self.capacity, model.num_kv_heads, model.head_dim,
                                       np.dtype(self.kv_dtype).itemsize)
        log.info("opened %s on %s (KV capacity %d, %s layout, cache on %s)", path, ",".join(self.providers),
                 self.capacity, io.kv_layout, self.device)

    @property
    def kv_names(self) -> list[tuple[str, str]]:
        """(past, present) names of the graph's K/V tensors, in the order of a cache's buffers."""
        return list(self._kv_names)

    @property
    def hidden_width(self) -> int:
        """Columns of the hidden-state output (0: the graph has none)."""
        return self._hidden_width

    @property
    def _buffer_shape(self) -> tuple[int, ...]:
        """The shape of one K or V buffer of a cache of this session."""
        if self.layout is not None:
            return tuple(self.layout.buffer_shape)
        return (1, self.model.num_kv_heads, self.capacity, self.model.head_dim)

    def new_cache(self) -> OrtKVCache:
        ort = _import_ort()
        shape = self._buffer_shape
        binding = self.session.io_binding()
        buffers = []
        for past, present in self._kv_names:
            # On the CPU the OrtValue wraps this array's memory (one array per buffer);
            # on a GPU it is copied to a new device allocation.
            value = ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, dtype=self.kv_dtype), self.device,
                                                     self.device_id)
            if self.layout is None:
                binding.bind_ortvalue_input(past, value)
                binding.bind_ortvalue_output(present, value)
            buffers.append(value)
        return OrtKVCache(self.capacity, buffers, binding)

    def view_cache(self, cache: OrtKVCache) -> OrtKVCache:
        """A cache of this session over another session's cache buffers (same K/V layout, type
        and device): this graph reads and writes the other's K/V. Its ``length`` is its own;
        the caller keeps the two consistent."""
        if not isinstance(cache, OrtKVCache):
            raise BackendError(f"cannot share a {type(cache).__name__}: only an onnxruntime cache")
        mine = (list(self._buffer_shape), self._kv_type, self.device, len(self._kv_names))
        first = cache.buffers[0]
        theirs = (list(first.shape()), first.data_type(), first.device_name(), len(cache.buffers))
        if mine != theirs:
            raise BackendError(f"{self.path} cannot share this KV cache: its buffers are {theirs[:3]} x "
                               f"{theirs[3]}, this graph needs {mine[:3]} x {mine[3]} (another K/V type, "
                               "layout, capacity or device; load both with the same max_context and provider)")
        binding = self.session.io_binding()
        if self.layout is None:
            for (past, present), value in zip(self._kv_names, cache.buffers):
                binding.bind_ortvalue_input(past, value)
                binding.bind_ortvalue_output(present, value)
        view = OrtKVCache(cache.capacity, cache.buffers, binding)
        view.length = cache.length
        return view

    # -- several caches in one pass (continuous batching, ``dspark_edge.batching``) -----------
    def new_rows(self, rows: int) -> OrtKVRows:
        """K/V buffers for ``rows`` caches of this session, one row each (CPU, shared-buffer
        layout only: a BackendError otherwise)."""
        if self.layout is not None or self.device != "cpu":
            raise BackendError(f"{self.path}: several caches in one pass need the fused graph's shared K/V "
                               "buffer on the CPU")
        ort = _import_ort()
        shape = (rows, *self._buffer_shape[1:])
        arrays = [np.zeros(shape, dtype=self.kv_dtype) for _ in self._kv_names]
        return OrtKVRows(arrays, [ort.OrtValue.ortvalue_from_numpy(a) for a in arrays])

    def fits_rows(self, kv: OrtKVRows) -> bool:
        """Whether this graph can run over ``kv`` (another session's rows): the shared-buffer
        layout on the CPU, the same K/V type, row shape and layer count."""
        return (self.layout is None and self.device == "cpu" and self.kv_dtype == kv.arrays[0].dtype
                and tuple(self._buffer_shape[1:]) == kv.row_shape and len(self._kv_names) == len(kv.arrays))

    def run_rows(self, kv: OrtKVRows, first: int, ids: np.ndarray,
                 mask: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """One pass over rows ``first`` … ``first + n - 1`` of ``kv``: ``ids`` [n, S], ``mask``
        [n, T] (row r's ones: its committed positions and the S new ones). Returns new arrays,
        logits [n, S, V] and hidden states [n, S, H * layers] (None when the graph has none)."""
        rows, width = ids.shape
        b, io = self.session.io_binding(), self.io
        b.bind_cpu_input(io.input_ids, ids)
        b.bind_cpu_input(io.attention_mask, mask)
        shape = [rows, *kv.row_shape]
        for (past, present), base in zip(self._kv_names, kv.bases):
            ptr = base + first * kv.row_bytes
            b.bind_input(past, "cpu", 0, self.kv_dtype, shape, ptr)
            b.bind_output(present, "cpu", 0, self.kv_dtype, shape, ptr)
        logits = np.empty((rows, width, self.model.vocab_size), dtype=np.float32)
        hidden = np.empty((rows, width, self._hidden_width), dtype=np.float32) if self._hidden_width else None
        self._run_bound(b, logits, hidden, f"over {rows} rows at width {width}")
        return logits, hidden

    def _run_bound(self, b, logits: np.ndarray, hidden: np.ndarray | None, what: str) -> None:
        """Bind the output arrays to ``b`` and run; a BackendError naming ``what`` if it fails."""
        io = self.io
        b.bind_output(io.logits, "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        if hidden is not None:
            b.bind_output(io.hidden_states, "cpu", 0, np.float32, list(hidden.shape), hidden.ctypes.data)
        try:
            self.session.run_with_iobinding(b)
        except Exception as exc:
            raise BackendError(f"onnxruntime failed running {self.path} {what}: {exc}") from exc

    def _bind_append(self, cache: OrtKVCache, width: int) -> None:
        """Bind past to each buffer's committed prefix and the new K/V right after it."""
        lay, b = self.layout, cache.binding
        assert lay is not None
        past_shape, new_shape = lay.past_shape(cache.length), lay.new_shape(width)
        offset = lay.new_offset(cache.length)
        dev, dev_id, dtype = self.device, self.device_id, self.kv_dtype
        for (past, new), ptr in zip(self._kv_names, cache.pointers):
            b.bind_input(past, dev, dev_id, dtype, past_shape, ptr)
            b.bind_output(new, dev, dev_id, dtype, new_shape, ptr + offset)

    def forward(self, cache: OrtKVCache, ids: np.ndarray) -> ForwardOutput:
        """Run ``ids`` ([S] int64) after ``cache.length`` committed positions (nothing is committed)."""
        width = int(ids.shape[0])
        total = cache.length + width
        if width < 1 or total > cache.capacity:
            raise BackendError(f"cannot run {width} new tokens after {cache.length} of {cache.capacity} "
                               "KV positions: the context is full (raise max_context when loading)")
        b, io = cache.binding, self.io
        b.bind_cpu_input(io.input_ids, ids.reshape(1, width))
        if io.attention_mask:
            b.bind_cpu_input(io.attention_mask, self._ones[:, :total])
        if self.layout is not None:
            self._bind_append(cache, width)
        logits, hidden = output_buffers(self._outputs, self.cached_widths, width, self.model.vocab_size,
                                        self._hidden_width)
        self._run_bound(b, logits, hidden, f"at width {width}, past length {cache.length}")
        return ForwardOutput(logits[0], None if hidden is None else hidden[0])
