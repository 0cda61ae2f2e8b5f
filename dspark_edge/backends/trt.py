"""TensorRT decoder: one engine (weights once) with an execution context per optimization
profile, every context sharing one scratch allocation, the KV cache in device memory.

The engine is built by ``python -m export trt`` from the portable graph, so the cache uses the
"append" layout (``layout.AppendLayout``): per step the past inputs are bound to the committed
prefix of each sequence-major buffer and the new-K/V outputs right after it, so the cache never
moves and never leaves the GPU; rolling back is forgetting a length. Per step only the token
ids go to the device and the logits (and hidden states) come back. Device memory and the
stream come from cuda-python (``cuda.bindings.runtime``). TensorRT and cuda-python are
imported only when a TensorRT engine is opened: install ``dspark-edge[tensorrt]``.
"""

from __future__ import annotations

import logging
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import BackendError, EngineError
from ..manifest import GraphIO, ModelInfo, TensorRTEngine
from .base import BackendOptions, ForwardOutput, KVCache, output_buffers
from .layout import AppendLayout

if TYPE_CHECKING:  # checked by mypy against tensorrt-stubs; imported at run time only when used
    import tensorrt as trt

log = logging.getLogger(__name__)

INSTALL = ("install the tensorrt extra on a machine with an NVIDIA GPU: pip install 'dspark-edge[tensorrt]' "
           "(TensorRT 10 and cuda-python)")


def require_tensorrt() -> str:
    """TensorRT's version, or a BackendError naming the extra to install. Callers then
    ``import tensorrt`` themselves (so the type checker sees the real API)."""
    try:
        import tensorrt
    except ImportError as exc:
        raise BackendError(f"TensorRT is not installed: {INSTALL}") from exc
    if not hasattr(tensorrt, "Builder"):  # a namespace package left by tensorrt-stubs alone
        raise BackendError(f"only TensorRT's type stubs are installed, not TensorRT itself: {INSTALL}")
    return str(tensorrt.__version__)


def import_cudart() -> Any:
    """cuda-python's runtime bindings (``cuda.bindings.runtime``; ``cuda.cudart`` before 12.6)."""
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart
        except ImportError as exc:
            raise BackendError(f"cuda-python is not installed: {INSTALL}") from exc
    return cudart


def cuda_call(result: Any, what: str) -> Any:
    """Unwrap a cuda-python call's ``(error, *values)`` tuple, raising BackendError on failure."""
    cudart = import_cudart()
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != int(cudart.cudaError_t.cudaSuccess):
        _, name = cudart.cudaGetErrorName(err)
        raise BackendError(f"CUDA failed during {what}: {name.decode() if isinstance(name, bytes) else name}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def gpu_identity(device_id: int = 0) -> dict[str, str]:
    """Name and compute capability of a CUDA device (what a TensorRT engine is tied to)."""
    cudart = import_cudart()
    props = cuda_call(cudart.cudaGetDeviceProperties(device_id), "cudaGetDeviceProperties")
    name = props.name.decode(errors="replace") if isinstance(props.name, bytes) else str(props.name)
    return {"gpu": name.rstrip("\x00").strip(), "compute_capability": f"{props.major}.{props.minor}"}


def check_engine_matches(engine: TensorRTEngine, trt_version: str, gpu: dict[str, str], file: str) -> None:
    """An engine runs only with the TensorRT version and compute capability it was built for."""
    if engine.tensorrt_version.split(".")[:2] != trt_version.split(".")[:2]:
        raise EngineError(f"{file} was built with TensorRT {engine.tensorrt_version}, this is {trt_version}: "
                          "rebuild it here with `python -m export trt --engine DIR`")
    if engine.compute_capability != gpu["compute_capability"]:
        raise EngineError(f"{file} was built for {engine.gpu} (compute {engine.compute_capability}), this GPU is "
                          f"{gpu['gpu']} (compute {gpu['compute_capability']}): rebuild it here with "
                          "`python -m export trt --engine DIR`")


class _DeviceMemory:
    """Device allocations freed together when their owner is collected."""

    def __init__(self) -> None:
        self.pointers: list[int] = []
        weakref.finalize(self, _free_all, self.pointers)

    def alloc(self, nbytes: int, what: str) -> int:
        cudart = import_cudart()
        ptr = int(cuda_call(cudart.cudaMalloc(max(1, nbytes)), f"cudaMalloc of {nbytes} bytes for {what}"))
        self.pointers.append(ptr)
        return ptr


def _free_all(pointers: list[int]) -> None:
    try:
        cudart = import_cudart()
    except BackendError:  # pragma: no cover - nothing was allocated without it
        return
    for ptr in pointers:
        cudart.cudaFree(ptr)
    pointers.clear()


class TrtKVCache(KVCache):
    def __init__(self, capacity: int, memory: _DeviceMemory, pointers: list[int]) -> None:
        super().__init__(capacity)
        self.memory = memory  # freed when the cache is collected
        self.pointers = pointers


class TrtDecoder:
    """A portable-graph decoder in a TensorRT engine (see module docstring)."""

    def __init__(self, path: str, io: GraphIO, model: ModelInfo, options: BackendOptions, hidden_width: int,
                 engine_info: TensorRTEngine) -> None:
        if io.kv_layout != "append":
            raise EngineError(f"{path}: TensorRT engines need the portable graph's append KV layout")
        version = require_tensorrt()
        import tensorrt as trt

        cudart = self._cudart = import_cudart()
        self.path, self.io, self.model, self.options, self.info = path, io, model, options, engine_info
        cuda_call(cudart.cudaSetDevice(options.device_id), f"cudaSetDevice({options.device_id})")
        self.gpu = gpu_identity(options.device_id)
        check_engine_matches(engine_info, version, self.gpu, path)
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        try:
            plan = Path(path).read_bytes()
        except OSError as exc:
            raise EngineError(f"cannot read TensorRT engine {path}: {exc}") from exc
        engine = self._runtime.deserialize_cuda_engine(plan)
        if engine is None:
            raise EngineError(f"TensorRT could not deserialize {path} (corrupted, or built for another "
                              "TensorRT/GPU): rebuild it with `python -m export trt --engine DIR`")
        self.engine: trt.ICudaEngine = engine
        self.stream = cuda_call(cudart.cudaStreamCreate(), "cudaStreamCreate")
        self._stream_handle = int(self.stream)  # what TensorRT's calls take
        weakref.finalize(self, cudart.cudaStreamDestroy, self.stream)
        self.memory = _DeviceMemory()
        n = self.engine.num_optimization_profiles
        if n != len(engine_info.profiles):
            raise EngineError(f"{path} has {n} optimization profiles, the manifest lists "
                              f"{len(engine_info.profiles)}; rebuild it with `python -m export trt`")
        # Runs are sequential on one stream, so every context can share one scratch allocation.
        scratch = max(int(self.engine.get_device_memory_size_for_profile_v2(i)) for i in range(n))
        self._scratch = self.memory.alloc(scratch, "TensorRT scratch")
        strategy = trt.ExecutionContextAllocationStrategy.USER_MANAGED
        self.contexts: dict[int, trt.IExecutionContext] = {}
        for i, width in enumerate(engine_info.profiles):
            ctx = self.engine.create_execution_context(strategy)
            if ctx is None:
                raise BackendError(f"TensorRT could not create an execution context for {path}")
            ctx.set_optimization_profile_async(i, self._stream_handle)
            ctx.set_device_memory(self._scratch, scratch)
            self.contexts[width] = ctx
        self.prefill_max = engine_info.prefill_max
        self.capacity = min(options.max_context, engine_info.max_context, model.max_position_embeddings)
        kv_type = self.engine.get_tensor_dtype(io.past_key.format(layer=0))
        itemsize = {trt.DataType.HALF: 2, trt.DataType.FLOAT: 4}.get(kv_type)
        if itemsize is None:
            raise EngineError(f"{path}: unsupported KV cache type {kv_type}")
        self.layout = AppendLayout(self.capacity, model.num_kv_heads, model.head_dim, itemsize)
        self._hidden_width = hidden_width if io.hidden_states else 0
        widest = self.max_step = max(self.prefill_max, *engine_info.profiles)  # device I/O buffers fit this
        self._d_ids = self.memory.alloc(widest * 8, "input ids")
        self._d_logits = self.memory.alloc(widest * model.vocab_size * 4, "logits")
        self._d_hidden = self.memory.alloc(widest * max(1, self._hidden_width) * 4, "hidden states")
        self._names = io.kv_names(model.num_layers)
        self._outputs: dict[int, tuple[np.ndarray, np.ndarray | None]] = {}
        self.cached_widths: frozenset[int] = frozenset()  # set by the caller: the decode widths
        self.providers = ("TensorRT",)
        log.info("opened TensorRT engine %s on %s (%d profiles, KV capacity %d, scratch %.1f MiB)", path,
                 self.gpu["gpu"], n, self.capacity, scratch / 2**20)

    def new_cache(self) -> TrtKVCache:
        memory = _DeviceMemory()
        pointers = []
        for past, _ in self._names:
            ptr = memory.alloc(self.layout.buffer_bytes, f"KV buffer {past}")
            cuda_call(self._cudart.cudaMemset(ptr, 0, self.layout.buffer_bytes), "cudaMemset")
            pointers.append(ptr)
        return TrtKVCache(self.capacity, memory, pointers)

    def _pieces(self, length: int, width: int) -> list[tuple[int, int]]:
        """(profile width, new tokens) runs covering ``width`` tokens after ``length``: one run at
        the width's own static profile, or the prefill profile while its past range allows
        (past ≤ max_context − prefill_max); otherwise (a prompt chunk near the end of the
        context) consecutive runs at the widest static profiles that fit."""
        if width in self.contexts:
            return [(width, width)]
        if width <= self.prefill_max and length + self.prefill_max <= self.info.max_context:
            return [(0, width)]
        statics = sorted((w for w in self.contexts if w), reverse=True)
        pieces, done = [], 0
        while done < width:
            rest = width - done
            if rest <= self.prefill_max and length + done + self.prefill_max <= self.info.max_context:
                pieces.append((0, rest))
                break
            w = next(w for w in statics if w <= rest)  # width 1 is always listed
            pieces.append((w, w))
            done += w
        return pieces

    def _run(self, profile: int, ids: np.ndarray, length: int, pointers: list[int], row: int) -> None:
        """One execution: ``ids`` after ``length`` positions; logits/hidden land at ``row``."""
        cudart, io, lay = self._cudart, self.io, self.layout
        ctx, width = self.contexts[profile], int(ids.shape[0])
        h2d = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
        cuda_call(cudart.cudaMemcpyAsync(self._d_ids, ids.ctypes.data, ids.nbytes, h2d, self.stream), "copy ids")
        shapes = [(io.input_ids, (1, width))] + [(past, tuple(lay.past_shape(length))) for past, _ in self._names]
        for name, shape in shapes:
            if not ctx.set_input_shape(name, shape):
                raise BackendError(f"{self.path}: shape {shape} of {name} is outside the engine's profile; "
                                   "rebuild with `python -m export trt` for this context size")
        ctx.set_tensor_address(io.input_ids, self._d_ids)
        offset = lay.new_offset(length)
        for (past, new), ptr in zip(self._names, pointers):
            ctx.set_tensor_address(past, ptr)
            ctx.set_tensor_address(new, ptr + offset)
        ctx.set_tensor_address(io.logits, self._d_logits + row * self.model.vocab_size * 4)
        if io.hidden_states:
            ctx.set_tensor_address(io.hidden_states, self._d_hidden + row * self._hidden_width * 4)
        if not ctx.execute_async_v3(self._stream_handle):
            raise BackendError(f"TensorRT failed running {self.path} at width {width}, past length {length}")

    def forward(self, cache: TrtKVCache, ids: np.ndarray) -> ForwardOutput:
        """Run ``ids`` ([S] int64) after ``cache.length`` committed positions (nothing is committed)."""
        width = int(ids.shape[0])
        self.layout.check(cache.length, width)
        if width > self.max_step:
            raise BackendError(f"{width} new tokens in one call; this engine takes at most {self.max_step} "
                               "(DecoderModel.prefill chunks prompts to fit)")
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        done = 0
        for profile, n in self._pieces(cache.length, width):
            # Each piece's K/V is written in place, so the next piece reads it as past.
            self._run(profile, ids[done:done + n], cache.length + done, cache.pointers, done)
            done += n
        cudart = self._cudart
        d2h = cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
        logits, hidden = output_buffers(self._outputs, self.cached_widths, width, self.model.vocab_size,
                                        self._hidden_width)
        cuda_call(cudart.cudaMemcpyAsync(logits.ctypes.data, self._d_logits, logits.nbytes, d2h, self.stream),
                  "copy logits")
        if hidden is not None:
            cuda_call(cudart.cudaMemcpyAsync(hidden.ctypes.data, self._d_hidden, hidden.nbytes, d2h, self.stream),
                      "copy hidden states")
        cuda_call(cudart.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")
        return ForwardOutput(logits[0], None if hidden is None else hidden[0])
