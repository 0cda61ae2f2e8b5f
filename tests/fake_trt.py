"""Stand-ins for TensorRT and cuda-python that run on the CPU, so the TensorRT backend's own
logic (profile choice, shapes, tensor addresses, the in-place KV append, copies, frees) is
exercised here. "Device memory" is host memory; an "engine" is a JSON plan naming the portable
ONNX graph and its profiles, and executing a context runs that graph with ONNX Runtime on
exactly the shapes and addresses the backend bound, so a wrong offset or shape changes the
answer. Nothing here is TensorRT's behaviour beyond the calls the backend makes."""

from __future__ import annotations

import ctypes
import json
import sys
import types
from pathlib import Path

import numpy as np

DTYPES = {"FLOAT": np.float32, "HALF": np.float16, "INT64": np.int64}


class Memory:
    def __init__(self) -> None:
        self.blocks: dict[int, ctypes.Array] = {}
        self.freed = 0

    def malloc(self, n: int) -> int:
        buf = (ctypes.c_char * n)()
        ptr = ctypes.addressof(buf)
        self.blocks[ptr] = buf
        return ptr

    def free(self, ptr: int) -> None:
        if self.blocks.pop(int(ptr), None) is not None:
            self.freed += 1

    def view(self, ptr: int, shape, dtype) -> np.ndarray:
        count = int(np.prod(shape)) if len(shape) else 1
        if count == 0:
            return np.zeros(shape, dtype=dtype)
        raw = (ctypes.c_char * (count * np.dtype(dtype).itemsize)).from_address(ptr)
        return np.frombuffer(raw, dtype=dtype).reshape(shape)


def make_cudart(mem: Memory, gpu=("Fake GPU", 8, 7)) -> types.ModuleType:
    rt = types.ModuleType("cuda.bindings.runtime")

    class cudaError_t(int):
        cudaSuccess = 0

    class cudaMemcpyKind:
        cudaMemcpyHostToDevice = 1
        cudaMemcpyDeviceToHost = 2

    ok = cudaError_t(0)
    rt.cudaError_t = cudaError_t
    rt.cudaMemcpyKind = cudaMemcpyKind
    rt.cudaGetErrorName = lambda err: (ok, b"cudaErrorFake")
    rt.cudaSetDevice = lambda i: (ok,)
    props = types.SimpleNamespace(name=gpu[0].encode(), major=gpu[1], minor=gpu[2])
    rt.cudaGetDeviceProperties = lambda i: (ok, props)
    rt.cudaStreamCreate = lambda: (ok, 7)
    rt.cudaStreamDestroy = lambda s: (ok,)
    rt.cudaStreamSynchronize = lambda s: (ok,)
    rt.cudaMalloc = lambda n: (ok, mem.malloc(n))
    rt.cudaFree = lambda p: (mem.free(p), (ok,))[1]
    rt.cudaMemset = lambda p, v, n: (ctypes.memset(p, v, n), (ok,))[1]
    rt.cudaMemcpyAsync = lambda dst, src, n, kind, stream: (ctypes.memmove(dst, src, n), (ok,))[1]
    rt.cudaMemGetInfo = lambda: (ok, 1 << 30, 1 << 31)
    return rt


class FakeContext:
    def __init__(self, engine: "FakeEngine") -> None:
        self.engine, self.profile, self.shapes, self.addresses = engine, None, {}, {}
        self.device_memory = None

    def set_optimization_profile_async(self, i: int, stream: int) -> bool:
        assert isinstance(stream, int)
        self.profile = i
        return True

    def set_device_memory(self, ptr: int, size: int) -> None:
        self.device_memory = (ptr, size)

    def set_input_shape(self, name: str, shape) -> bool:
        lo, _, hi = self.engine.plan["profiles"][self.profile]["shapes"][name]
        shape = tuple(shape)
        if not all(a <= s <= b for a, s, b in zip(lo, shape, hi)):
            raise AssertionError(f"{name} shape {shape} outside profile {self.profile} range {lo}..{hi}")
        self.shapes[name] = shape
        return True

    def set_tensor_address(self, name: str, ptr: int) -> bool:
        self.addresses[name] = int(ptr)
        return True

    def execute_async_v3(self, stream: int) -> bool:
        eng = self.engine
        feeds = {}
        for inp in eng.session.get_inputs():
            dtype = np.int64 if inp.type == "tensor(int64)" else DTYPES[eng.kv_type]
            feeds[inp.name] = eng.memory.view(self.addresses[inp.name], self.shapes[inp.name], dtype).copy()
        outs = eng.session.run(None, feeds)
        for meta, value in zip(eng.session.get_outputs(), outs):
            dst = eng.memory.view(self.addresses[meta.name], value.shape, value.dtype)
            dst[...] = value
        eng.runs.append({"profile": self.profile, "new": self.shapes["input_ids"][1],
                         "past": self.shapes["past_key.0"][1],
                         "new_key_offset": self.addresses["new_key.0"] - self.addresses["past_key.0"]})
        return True


class FakeEngine:
    def __init__(self, plan: dict, memory: Memory) -> None:
        import onnxruntime as ort

        self.plan, self.memory, self.runs = plan, memory, []
        so = ort.SessionOptions()
        if plan["precision"] == "int8":  # as the runtime opens a QDQ graph on the CPU provider
            so.add_session_config_entry("session.disable_quant_qdq", "1")
        self.session = ort.InferenceSession(plan["onnx_path"], so, providers=["CPUExecutionProvider"])
        kv = next(i for i in self.session.get_inputs() if i.name.startswith("past_"))
        self.kv_type = "HALF" if kv.type == "tensor(float16)" else "FLOAT"

    @property
    def num_optimization_profiles(self) -> int:
        return len(self.plan["profiles"])

    def get_device_memory_size_for_profile_v2(self, i: int) -> int:
        return 4096

    def create_execution_context(self, strategy) -> FakeContext:
        return FakeContext(self)

    def get_tensor_dtype(self, name: str) -> str:
        return self.kv_type


class FakeBuilder:
    """Records what ``export trt`` asks for; "builds" a JSON plan the fake runtime can run."""

    log: list = []
    fail = False

    def __init__(self, logger) -> None:
        self.record = {"profiles": []}
        FakeBuilder.log.append(self.record)

    def create_network(self, flags: int):
        self.record["flags"] = flags
        return types.SimpleNamespace(path=None)

    def create_builder_config(self):
        builder = self

        class Config:
            def set_memory_pool_limit(self, pool, size):
                builder.record["workspace"] = size

            def create_timing_cache(self, data: bytes):
                builder.record["timing_cache_in"] = bytes(data)
                return types.SimpleNamespace(serialize=lambda: b"cache:" + bytes(data)[:16])

            def set_timing_cache(self, cache, ignore_mismatch):
                self.cache = cache
                return True

            def get_timing_cache(self):
                return self.cache

            def add_optimization_profile(self, profile):
                builder.record["profiles"].append(profile.shapes)
                return len(builder.record["profiles"]) - 1

        return Config()

    def create_optimization_profile(self):
        class Profile:
            def __init__(self) -> None:
                self.shapes: dict = {}

            def set_shape(self, name, lo, opt, hi):
                self.shapes[name] = [list(lo), list(opt), list(hi)]

        return Profile()

    def build_serialized_network(self, network, config):
        if FakeBuilder.fail:
            return None
        onnx_path = self.record["onnx"]
        precision = Path(onnx_path).parent.name
        profiles = [{"width": 0, "shapes": p} for p in self.record["profiles"]]
        return json.dumps({"onnx_path": onnx_path, "precision": precision, "profiles": profiles}).encode()


class FakeParser:
    def __init__(self, network, logger) -> None:
        self.num_errors = 0

    def parse_from_file(self, path: str) -> bool:
        FakeBuilder.log[-1]["onnx"] = path
        return Path(path).is_file()


def install(monkeypatch, memory: Memory, engines: list, version: str = "10.13.0.35", gpu=("Fake GPU", 8, 7)):
    """Put fake ``tensorrt`` and ``cuda.bindings.runtime`` modules in sys.modules."""
    trt = types.ModuleType("tensorrt")
    trt.__version__ = version
    FakeBuilder.log, FakeBuilder.fail = [], False
    trt.Builder = FakeBuilder  # present in real TensorRT, absent from the stubs-only namespace package
    trt.OnnxParser = FakeParser
    trt.Dims = list
    trt.NetworkDefinitionCreationFlag = types.SimpleNamespace(STRONGLY_TYPED=1)
    trt.MemoryPoolType = types.SimpleNamespace(WORKSPACE="workspace")
    trt.DataType = types.SimpleNamespace(HALF="HALF", FLOAT="FLOAT")
    trt.ExecutionContextAllocationStrategy = types.SimpleNamespace(USER_MANAGED="user")

    class Logger:
        WARNING = 2

        def __init__(self, level) -> None:
            pass

    class Runtime:
        def __init__(self, logger) -> None:
            pass

        def deserialize_cuda_engine(self, data: bytes):
            try:
                plan = json.loads(data)
            except ValueError:
                return None
            engine = FakeEngine(plan, memory)
            engines.append(engine)
            return engine

    trt.Logger, trt.Runtime = Logger, Runtime
    cuda = types.ModuleType("cuda")
    bindings = types.ModuleType("cuda.bindings")
    runtime = make_cudart(memory, gpu)
    bindings.runtime = runtime
    cuda.bindings = bindings
    for name, mod in (("tensorrt", trt), ("cuda", cuda), ("cuda.bindings", bindings),
                      ("cuda.bindings.runtime", runtime)):
        monkeypatch.setitem(sys.modules, name, mod)


def write_fake_engines(folder: Path, precisions=("fp16", "int8"), max_context: int = 256,
                       gpu=("Fake GPU", "8.7")) -> None:
    """Add "built" engines (JSON plans the fake runtime reads) to a portable engine folder."""
    from dspark_edge.manifest import read_manifest, write_manifest
    from dspark_export.trt import manifest_with_engines, plan_engines

    m = read_manifest(folder)
    plans = plan_engines(m, precisions, max_context=max_context, folder="trt-fake")
    (folder / "trt-fake").mkdir()
    for p in plans:
        plan = {"onnx_path": str(folder / p.onnx), "precision": p.precision,
                "profiles": [{"width": pr.width, "shapes": {k: [list(x) for x in v] for k, v in pr.shapes.items()}}
                             for pr in p.profiles]}
        (folder / "trt-fake" / f"{p.precision}.engine").write_text(json.dumps(plan))
    (folder / "trt-fake" / "timing.cache").write_bytes(b"")
    built = {p.precision: {"tensorrt": "10.13.0.35", "gpu": gpu[0], "compute_capability": gpu[1]} for p in plans}
    write_manifest(manifest_with_engines(m, folder, plans, built, "trt-fake/timing.cache"), folder)
