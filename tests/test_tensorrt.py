"""TensorRT without a GPU: the build plan, the manifest entries, and every error path with
TensorRT absent (this machine has only its type stubs). The GPU half runs in scripts/gpu_check.sh."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import dspark_edge
from dspark_edge.backends.trt import check_engine_matches, require_tensorrt
from dspark_edge.config import GenerationConfig
from dspark_edge.errors import BackendError, ConfigError, EngineError, ExportError, ManifestError
from dspark_edge.manifest import Manifest, TensorRTEngine, Variant, read_manifest, write_manifest
from dspark_export.trt import build_engines, manifest_with_engines, plan_engines

from conftest import TINY_WIDTHS


def test_plan_has_a_static_profile_per_width_and_a_prefill_profile(tiny_portable):
    m = read_manifest(tiny_portable)
    plans = plan_engines(m, ("fp16", "int8"), max_context=256, opt_context=64, prefill_max=32)
    assert [p.precision for p in plans] == ["fp16", "int8"]
    assert plans[0].onnx == "target/fp16/model.onnx" and plans[1].onnx == "target/int8/model.onnx"
    for plan in plans:
        assert plan.widths == (*TINY_WIDTHS, 0)
        kv = (m.model.num_kv_heads, m.model.head_dim)
        for prof in plan.profiles:
            assert len(prof.shapes) == 1 + 2 * m.model.num_layers
            lo, opt, hi = prof.shapes["input_ids"]
            if prof.width:
                assert lo == opt == hi == (1, prof.width)  # static new-token dimension
                new_max = prof.width
            else:
                assert lo == (1, 1) and hi == (1, 32)
                new_max = 32
            for name in (f"past_key.{i}" for i in range(m.model.num_layers)):
                assert prof.shapes[name] == ((1, 0, *kv), (1, 64, *kv), (1, 256 - new_max, *kv))
        assert plan.max_context == 256 and plan.strongly_typed


def test_plan_clamps_to_the_model_and_rejects_bad_requests(tiny_portable, tiny_engine):
    m = read_manifest(tiny_portable)
    assert plan_engines(m, ("fp16",), max_context=10**6)[0].max_context == m.model.max_position_embeddings
    with pytest.raises(ExportError, match="--graph portable"):
        plan_engines(read_manifest(tiny_engine), ("fp16",))
    with pytest.raises(ExportError, match="must be among"):
        plan_engines(m, ("fp32",))
    with pytest.raises(ExportError, match="prefill_max"):
        plan_engines(m, ("fp16",), prefill_max=0)
    assert plan_engines(m, ("fp16",), max_context=64, prefill_max=128)[0].prefill_max == 63
    only32 = dataclasses.replace(m, variants=tuple(v for v in m.variants if v.precision == "fp32"))
    with pytest.raises(ExportError, match="no fp16 portable graph"):
        plan_engines(only32, ("fp16",))


def _fake_built_folder(src, dst):
    """A copy of the portable folder listing two 'built' engines (placeholder bytes)."""
    shutil.copytree(src, dst)
    m = read_manifest(dst)
    plans = plan_engines(m, ("fp16", "int8"), max_context=256, folder="trt-test")
    (dst / "trt-test").mkdir()
    for p in plans:
        (dst / "trt-test" / f"{p.precision}.engine").write_bytes(b"not a real engine " + p.precision.encode())
    (dst / "trt-test" / "timing.cache").write_bytes(b"cache")
    built = {p.precision: {"tensorrt": "10.13.0", "gpu": "NVIDIA Jetson Orin", "compute_capability": "8.7"}
             for p in plans}
    new = manifest_with_engines(m, dst, plans, built, "trt-test/timing.cache")
    write_manifest(new, dst)
    return new


def test_manifest_lists_engines_with_version_and_gpu(tiny_portable, tmp_path):
    new = _fake_built_folder(tiny_portable, tmp_path / "e")
    again = read_manifest(tmp_path / "e")  # strict round trip
    assert again == new
    assert [e.precision for e in new.tensorrt] == ["fp16", "int8"]
    e = new.tensorrt[0]
    assert e.profiles == (*TINY_WIDTHS, 0) and e.gpu == "NVIDIA Jetson Orin" and e.compute_capability == "8.7"
    trt_variants = new.variants_for("target", "fp16", "tensorrt")
    assert sorted(v.width for v in trt_variants) == list(TINY_WIDTHS)
    assert {v.device for v in trt_variants} == {"gpu"} and {v.file for v in trt_variants} == {e.file}
    # One engine (one copy of the weights) serves every width of a precision.
    assert len({v.file for v in new.variants if v.backend == "tensorrt" and v.precision == "int8"}) == 1
    assert new.widths("target", "fp16") == TINY_WIDTHS  # ONNX and TensorRT variants, each width once
    assert any(f.path == "trt-test/timing.cache" for f in new.files)


def test_manifest_rejects_inconsistent_tensorrt_entries(tiny_portable, tmp_path):
    new = _fake_built_folder(tiny_portable, tmp_path / "e")
    with pytest.raises(ValueError, match="tensorrt section does not describe"):
        dataclasses.replace(new, tensorrt=())
    narrow = dataclasses.replace(new.tensorrt[0], profiles=(1, 0))
    with pytest.raises(ValueError, match="profiles"):
        dataclasses.replace(new, tensorrt=(narrow, new.tensorrt[1]))
    with pytest.raises(ValueError, match="distinct"):
        TensorRTEngine(file="x", onnx="y", precision="fp16", profiles=(1, 1), prefill_max=8, max_context=64,
                       tensorrt_version="10", gpu="g", compute_capability="8.7")
    text = json.loads((tmp_path / "e" / "manifest.json").read_text())
    text["tensorrt"][0]["profiles"] = "1,2"
    (tmp_path / "e" / "manifest.json").write_text(json.dumps(text))
    with pytest.raises(ManifestError):
        read_manifest(tmp_path / "e")


def test_loading_a_tensorrt_engine_without_tensorrt_names_the_extra(tiny_portable, tmp_path):
    _fake_built_folder(tiny_portable, tmp_path / "e")
    with pytest.raises(BackendError, match=r"dspark-edge\[tensorrt\]"):
        dspark_edge.load(tmp_path / "e", backend="tensorrt")
    # The ONNX Runtime variants of the same folder still load and run.
    pipe = dspark_edge.load(tmp_path / "e", "fp16")
    assert pipe.generate("The quick", dspark_edge.GenerationConfig(max_new_tokens=4)).token_ids


def test_tensorrt_backend_on_a_folder_without_engines_says_how_to_build(tiny_portable):
    with pytest.raises(ConfigError, match="python -m export trt"):
        dspark_edge.load(tiny_portable, "fp16", backend="tensorrt")
    with pytest.raises(ConfigError, match="not supported|choose one of"):
        dspark_edge.load(tiny_portable, "fp16", backend="openvino")


def test_build_without_tensorrt_fails_first_and_leaves_the_folder_alone(tiny_portable, tmp_path):
    shutil.copytree(tiny_portable, tmp_path / "e")
    before = sorted(p.name for p in (tmp_path / "e").iterdir())
    manifest = (tmp_path / "e" / "manifest.json").read_bytes()
    with pytest.raises(ExportError, match=r"dspark-edge\[tensorrt\]"):
        build_engines(tmp_path / "e", ("fp16",))
    assert sorted(p.name for p in (tmp_path / "e").iterdir()) == before
    assert (tmp_path / "e" / "manifest.json").read_bytes() == manifest


def test_export_trt_cli(tiny_portable, tiny_engine):
    run = lambda *a: subprocess.run([sys.executable, "-m", "export", "trt", *a], capture_output=True, text=True)  # noqa: E731
    p = run("--engine", str(tiny_portable))
    assert p.returncode == 2 and "dspark-edge[tensorrt]" in p.stderr
    p = run("--engine", str(tiny_engine), "--plan")
    assert p.returncode == 2 and "--graph portable" in p.stderr
    p = run("--engine", str(tiny_portable), "--plan", "--precisions", "int8", "--max-context", "128")
    assert p.returncode == 0, p.stderr
    plan = json.loads(p.stdout)
    assert plan["precision"] == "int8" and plan["max_context"] == 128
    assert [pr["width"] for pr in plan["profiles"]] == [*TINY_WIDTHS, "prefill 1..127"]


def test_engine_must_match_tensorrt_version_and_gpu():
    e = TensorRTEngine(file="trt/fp16.engine", onnx="target/fp16/model.onnx", precision="fp16", profiles=(1, 2, 0),
                       prefill_max=128, max_context=2048, tensorrt_version="10.13.0.35", gpu="NVIDIA H200",
                       compute_capability="9.0")
    check_engine_matches(e, "10.13.3", {"gpu": "NVIDIA H200", "compute_capability": "9.0"}, "f")
    with pytest.raises(EngineError, match="built with TensorRT 10.13.0.35, this is 10.8"):
        check_engine_matches(e, "10.8.0", {"gpu": "NVIDIA H200", "compute_capability": "9.0"}, "f")
    with pytest.raises(EngineError, match="compute 9.0.*Orin.*compute 8.7.*export trt"):
        check_engine_matches(e, "10.13.0", {"gpu": "Orin", "compute_capability": "8.7"}, "f")


def test_stub_only_tensorrt_is_reported_as_missing():
    """tensorrt-stubs alone makes ``import tensorrt`` succeed as an empty namespace package."""
    with pytest.raises(BackendError, match=r"type stubs are installed|not installed"):
        require_tensorrt()


def test_import_dspark_edge_loads_no_gpu_library():
    code = ("import sys, dspark_edge, dspark_edge.backends, dspark_edge.pipeline; "
            "bad = [m for m in ('tensorrt', 'cuda', 'cuda.bindings', 'onnxruntime') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr


def test_variant_device_defaults_for_old_manifests(tiny_engine):
    m = read_manifest(tiny_engine)
    assert {v.device for v in m.variants} == {"any"}
    raw = json.loads(m.to_json())
    for v in raw["variants"]:
        v.pop("device")
    raw.pop("tensorrt")
    assert Manifest.from_json(json.dumps(raw)) == m
    assert Variant(role="target", width=1, precision="fp16", backend="tensorrt", file="x").device == "any"


def test_gpu_check_script_stops_with_what_is_missing(tmp_path):
    """On a machine without onnxruntime-gpu / TensorRT the GPU check says what to install (exit 3)."""
    p = subprocess.run(["bash", "scripts/gpu_check.sh", str(tmp_path / "out")], capture_output=True, text=True,
                       env={**__import__("os").environ, "PYTHON": sys.executable})
    assert p.returncode == 3, p.stdout + p.stderr
    assert "[gpu-check]" in p.stderr and ("missing" in p.stderr or "CUDAExecutionProvider" in p.stderr)
    # Every missing piece at once, in the summary too (this CPU onnxruntime has no CUDA provider;
    # the tests' environment holds TensorRT's stubs only).
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["passed"] is False and summary["steps"] == {"prereq": {"exit": 3, "seconds": 0}}
    assert any("no CUDAExecutionProvider" in m for m in summary["missing"])
    assert any("tensorrt" in m.lower() for m in summary["missing"]), summary["missing"]


def test_gpu_bench_runs_interleaved_on_any_backend(tiny_portable, tmp_path):
    """The GPU benchmark script, pointed at CPU configurations: plain vs n-gram, exact, JSON out;
    a configuration that cannot load is reported, not hidden."""
    out = tmp_path / "bench.json"
    p = subprocess.run([sys.executable, "bench/gpu_bench.py", "--engine", str(tiny_portable),
                        "--config", "cpu32=onnxruntime:fp32", "--config", "cpu8=onnxruntime:int8",
                        "--config", "trt=tensorrt:fp16", "--limit", "2", "--max-new-tokens", "12",
                        "--json", str(out)], capture_output=True, text=True)
    assert p.returncode == 1  # the TensorRT configuration failed to load
    report = json.loads(out.read_text())
    assert set(report["configs"]) == {"cpu32", "cpu8"} and "python -m export trt" in report["errors"]["trt"]
    for c in report["configs"].values():
        assert c["exact_prompts"] == "2/2" and c["plain_tokens_per_s"] > 0 and c["speculative_tokens_per_s"] > 0
    assert report["configs"]["cpu32"]["plain_vs_cpu32"] == 1.0


def test_inspect_lists_backends_gpu_variants_and_engines(tiny_portable, tmp_path):
    _fake_built_folder(tiny_portable, tmp_path / "e")
    p = subprocess.run([sys.executable, "-m", "dspark_edge", "inspect", "--engine", str(tmp_path / "e")],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "portable (standard operators, KV layout append)" in p.stdout
    assert "target     fp16  onnxruntime widths [1, 2, 3, 4]  target/fp16/model.onnx  [GPU]" in p.stdout
    assert "target     fp16  tensorrt    widths [1, 2, 3, 4]  trt-test/fp16.engine  [GPU]" in p.stdout
    assert "built for NVIDIA Jetson Orin (compute 8.7)" in p.stdout and "'prefill'" in p.stdout


# -- the TensorRT backend's logic on CPU stand-ins (tests/fake_trt.py) -------------------------

@pytest.fixture
def fake_trt(tiny_portable, tmp_path, monkeypatch):
    import fake_trt

    folder = tmp_path / "e"
    shutil.copytree(tiny_portable, folder)
    fake_trt.write_fake_engines(folder)
    memory, engines = fake_trt.Memory(), []
    fake_trt.install(monkeypatch, memory, engines)
    return folder, memory, engines


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_tensorrt_backend_logic_matches_onnxruntime_on_the_same_graph(fake_trt, precision):
    """The engine stand-in runs the very ONNX graph ONNX Runtime runs, on the shapes and addresses
    the TensorRT backend bound: equal tokens prove the bindings, the in-place append and the
    rollback right; speculation through it stays exact."""
    folder, memory, engines = fake_trt
    cfg = GenerationConfig(max_new_tokens=30)
    prompt = "def add(a, b):\n    return a + b\n" * 6  # > the widest width: prefill profile + chunks
    want = dspark_edge.load(folder, precision).generate(prompt, cfg).token_ids
    plain = dspark_edge.load(folder, precision, backend="tensorrt")
    assert plain.target.session.providers == ("TensorRT",)
    assert plain.generate(prompt, cfg).token_ids == want
    spec = dspark_edge.load(folder, precision, backend="tensorrt", drafter="ngram")
    for k in (None, 1, 2, 3):
        got = spec.generate(prompt, GenerationConfig(max_new_tokens=30, draft_tokens=k))
        assert got.token_ids == want, k
    assert got.stats.draft_n > 0
    runs = [r for e in engines for r in e.runs]
    profiles = engines[-1].plan["profiles"]
    widths = [p["width"] for p in profiles]
    pos_bytes = 2 * 16 * (2 if precision == "fp16" else 4)  # kv heads × head dim × item size
    for r in runs:
        width = widths[r["profile"]]
        assert width == r["new"] or (width == 0 and r["new"] not in widths)  # static profile when one exists
        assert r["new_key_offset"] == r["past"] * pos_bytes  # appended right after the committed prefix
    assert any(widths[r["profile"]] == 0 for r in runs) and {2, 3, 4} <= {r["new"] for r in runs}


def test_tensorrt_backend_frees_device_memory_and_checks_the_gpu(fake_trt, monkeypatch):
    import gc

    import fake_trt as fake

    folder, memory, engines = fake_trt
    pipe = dspark_edge.load(folder, "fp16", backend="tensorrt")
    pipe.generate("The quick", GenerationConfig(max_new_tokens=4))
    assert memory.blocks
    del pipe
    gc.collect()
    assert not memory.blocks and memory.freed > 0  # KV buffers, scratch and I/O buffers all freed
    fake.install(monkeypatch, memory, engines, gpu=("Other GPU", 9, 0))
    with pytest.raises(EngineError, match="built for Fake GPU .*this GPU is Other GPU"):
        dspark_edge.load(folder, "fp16", backend="tensorrt")
    fake.install(monkeypatch, memory, engines, version="10.8.0")
    with pytest.raises(EngineError, match="built with TensorRT 10.13.0.35, this is 10.8.0"):
        dspark_edge.load(folder, "fp16", backend="tensorrt")


def test_tensorrt_backend_rejects_a_corrupted_engine(fake_trt):
    folder, _, _ = fake_trt
    engine = next(folder.glob("trt-fake/fp16.engine"))
    engine.write_bytes(b"x" * engine.stat().st_size)  # same size, so only deserialization can tell
    with pytest.raises(EngineError, match="could not deserialize"):
        dspark_edge.load(folder, "fp16", backend="tensorrt", verify_hashes=False)


def test_export_trt_builds_lists_and_runs_engines(tiny_portable, tmp_path, monkeypatch):
    """``export trt`` end to end on the stand-ins: what it asks the builder for, the manifest and
    files it writes, engines the backend then runs exactly, a rebuild that reuses the timing
    cache and replaces the old engines, and a failed build that leaves everything as it was."""
    import fake_trt
    from dspark_edge.manifest import verify_files

    folder = tmp_path / "e"
    shutil.copytree(tiny_portable, folder)
    memory, engines = fake_trt.Memory(), []
    fake_trt.install(monkeypatch, memory, engines)
    msgs = []
    m = build_engines(folder, ("fp16", "int8"), max_context=256, opt_context=64, progress=msgs.append)
    assert [e.precision for e in m.tensorrt] == ["fp16", "int8"] and read_manifest(folder) == m
    verify_files(m, folder)  # engines and timing cache listed with their sha256
    builds = fake_trt.FakeBuilder.log
    assert [Path(b["onnx"]).relative_to(folder).as_posix() for b in builds] == \
        ["target/fp16/model.onnx", "target/int8/model.onnx"]
    assert all(b["flags"] == 1 << 1 for b in builds)  # strongly typed, no precision flags
    ids = [p["input_ids"] for p in builds[0]["profiles"]]
    assert ids[:len(TINY_WIDTHS)] == [[[1, w], [1, w], [1, w]] for w in TINY_WIDTHS]  # static per width
    assert ids[-1][0] == [1, 1] and ids[-1][2] == [1, 128]  # the prefill profile
    assert any("building the fp16 TensorRT engine" in x for x in msgs)
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]
    cfg = GenerationConfig(max_new_tokens=20)
    want = dspark_edge.load(folder, "fp16").generate("The quick brown fox", cfg).token_ids
    spec = dspark_edge.load(folder, "fp16", backend="tensorrt", drafter="ngram")
    assert spec.generate("The quick brown fox", cfg).token_ids == want
    old = m.tensorrt[0].file.split("/")[0]
    m2 = build_engines(folder, ("fp16",), max_context=256)
    assert fake_trt.FakeBuilder.log[-1]["timing_cache_in"].startswith(b"cache:")  # the earlier cache reused
    assert not (folder / old).exists() and [e.precision for e in m2.tensorrt] == ["fp16"]
    assert not m2.variants_for("target", "int8", "tensorrt")
    before = (folder / "manifest.json").read_bytes()
    fake_trt.FakeBuilder.fail = True
    with pytest.raises(ExportError, match="failed to build"):
        build_engines(folder, ("fp16",), max_context=256)
    assert (folder / "manifest.json").read_bytes() == before
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]
    verify_files(read_manifest(folder), folder)


def test_tensorrt_prompt_chunk_near_the_end_of_the_context_is_split(tiny_portable, tmp_path, monkeypatch):
    """The prefill profile covers past ≤ max_context − prefill_max; a chunk later than that runs
    as consecutive static-width pieces, each reading the K/V the previous one wrote in place."""
    import fake_trt
    from dspark_edge.decoder import DecoderModel

    folder = tmp_path / "e"
    shutil.copytree(tiny_portable, folder)
    fake_trt.write_fake_engines(folder, ("fp16",), max_context=64)  # prefill profile: past ≤ 1
    memory, engines = fake_trt.Memory(), []
    fake_trt.install(monkeypatch, memory, engines)
    m = read_manifest(folder)
    assert m.tensorrt[0].prefill_max == 63
    trt_model = DecoderModel(m, folder, "fp16", backend="tensorrt")
    ort_model = DecoderModel(m, folder, "fp16")
    ids = np.arange(5, 5 + 30, dtype=np.int64)
    outs = []
    for model in (trt_model, ort_model):
        cache = model.new_cache()
        model.prefill(cache, ids[:10])
        out = model.session.forward(cache, ids[10:21])  # 11 tokens at past 10: pieces 4+4+3
        outs.append(out.logits.copy())
    np.testing.assert_allclose(outs[0], outs[1], atol=1e-3)
    runs = engines[-1].runs[-3:]
    assert [(r["new"], r["past"]) for r in runs] == [(4, 10), (4, 14), (3, 18)]
    with pytest.raises(BackendError, match="at most 63"):
        trt_model.session.forward(trt_model.new_cache(), np.zeros(64, dtype=np.int64))


def test_gpu_check_summary(tiny_portable, tmp_path):
    """What scripts/gpu_check.sh writes at the end, from its steps and the files they left."""
    import fake_trt

    engine = tmp_path / "e"
    shutil.copytree(tiny_portable, engine)
    fake_trt.write_fake_engines(engine, ("fp16",))
    out = tmp_path / "out"
    out.mkdir()
    (out / "gpu.csv").write_text("name, driver_version, memory.total [MiB]\nNVIDIA H200, 570.1, 143771 MiB\n")
    (out / "gpu_tests.xml").write_text('<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="7" '
                                       'failures="0" errors="0" skipped="1"/></testsuites>')
    (out / "bench.json").write_text(json.dumps({"configs": {"trt-fp16": {"speedup": 1.4}}, "errors": {}}))
    run = lambda *steps: subprocess.run(  # noqa: E731
        [sys.executable, "bench/gpu_summary.py", "--out", str(out), "--engine", str(engine), "--seconds", "300",
         *[a for s in steps for a in ("--step", s)]], capture_output=True, text=True)
    p = run("export=0:90", "trt=0:120", "tests=0:60", "bench=0:30")
    assert p.returncode == 0, p.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["passed"] and summary["tests"] == {"tests": 7, "failures": 0, "errors": 0, "skipped": 1}
    assert summary["steps"]["trt"] == {"exit": 0, "seconds": 120} and "H200" in summary["gpu"]
    assert summary["bench"]["trt-fp16"]["speedup"] == 1.4 and summary["engines"][0]["precision"] == "fp16"
    assert run("export=0:90", "trt=1:5").returncode == 1  # a failed step fails the check
    (out / "gpu_tests.xml").write_text('<testsuites><testsuite tests="7" failures="2" errors="0" '
                                       'skipped="0"/></testsuites>')
    assert run("export=0:90", "trt=0:5", "tests=0:60").returncode == 1  # failures in the report count


def test_gpu_scripts_report_bad_input(tiny_portable, tmp_path):
    run = lambda *a: subprocess.run([sys.executable, *a], capture_output=True, text=True)  # noqa: E731
    p = run("bench/gpu_bench.py", "--engine", str(tiny_portable), "--prompts", str(tmp_path / "none.jsonl"))
    assert p.returncode == 2 and "prompt file" in p.stderr and "Traceback" not in p.stderr
    p = run("bench/gpu_summary.py", "--out", str(tmp_path / "none"), "--engine", str(tiny_portable), "--seconds", "1")
    assert p.returncode == 2 and "is not a folder" in p.stderr
    p = run("bench/experiments/int8_sensitivity.py", "--engine", str(tmp_path / "none"))
    assert p.returncode == 2 and "does not exist" in p.stderr and "Traceback" not in p.stderr
