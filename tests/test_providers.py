"""ONNX Runtime GPU providers, checked without a GPU: where the KV cache lives for each
provider, a provider onnxruntime drops at session creation is an error (or a logged fallback
when allowed), provider options from the CLI, and one onnxruntime build per environment."""

from __future__ import annotations

import logging

import pytest

from dspark_edge.backends import BackendOptions
from dspark_edge.backends import ort as ort_backend
from dspark_edge.cli import provider_options
from dspark_edge.errors import BackendError, ConfigError


@pytest.mark.parametrize("providers,options,device", [
    (("CPUExecutionProvider",), (), ("cpu", 0)),
    (("CUDAExecutionProvider", "CPUExecutionProvider"), (), ("cuda", 0)),
    (("CUDAExecutionProvider", "CPUExecutionProvider"), ({"device_id": "1"}, {}), ("cuda", 1)),
    (("TensorrtExecutionProvider", "CUDAExecutionProvider"), ({"device_id": "2"}, {}), ("cuda", 2)),
])
def test_kv_cache_lives_on_the_first_providers_device(providers, options, device):
    opts = BackendOptions(providers=providers, provider_options=options)
    assert ort_backend.kv_device(providers, opts) == device


def test_kv_device_falls_back_to_options_device_id():
    opts = BackendOptions(providers=("CUDAExecutionProvider",), device_id=3)
    assert ort_backend.kv_device(("CUDAExecutionProvider",), opts) == ("cuda", 3)


def test_a_provider_dropped_at_creation_is_an_error():
    with pytest.raises(BackendError, match="could not create CUDAExecutionProvider.*fallback_to_cpu"):
        ort_backend.check_created_providers(["CUDAExecutionProvider", "CPUExecutionProvider"],
                                            ["CPUExecutionProvider"], fallback_to_cpu=False)


def test_a_provider_dropped_at_creation_falls_back_loudly_when_allowed(caplog):
    with caplog.at_level(logging.WARNING):
        ort_backend.check_created_providers(["CUDAExecutionProvider", "CPUExecutionProvider"],
                                            ["CPUExecutionProvider"], fallback_to_cpu=True)
    assert "could not create CUDAExecutionProvider" in caplog.text and "falling back" in caplog.text
    ort_backend.check_created_providers(["CPUExecutionProvider"], ["CPUExecutionProvider"], False)


def test_session_creation_checks_the_providers_it_got(tiny_engine, monkeypatch):
    """onnxruntime dropping a provider (as it does for CUDA without a GPU) reaches the user."""
    import onnxruntime as ort

    real = ort.InferenceSession

    class Dropping(real):  # what onnxruntime-gpu does on a machine without CUDA libraries
        def __init__(self, path, so, providers, provider_options):
            super().__init__(path, so, providers=["CPUExecutionProvider"])

    monkeypatch.setattr(ort, "InferenceSession", Dropping)
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    import dspark_edge

    opts = BackendOptions(providers=("CUDAExecutionProvider", "CPUExecutionProvider"))
    with pytest.raises(BackendError, match="could not create CUDAExecutionProvider"):
        dspark_edge.load(tiny_engine, options=opts)


def test_provider_options_from_the_cli():
    provs = ("CUDAExecutionProvider", "CPUExecutionProvider")
    assert provider_options(provs, []) == ()
    assert provider_options(provs, ["CUDAExecutionProvider:device_id=1", "CUDAExecutionProvider:gpu_mem_limit=2"]) \
        == ({"device_id": "1", "gpu_mem_limit": "2"}, {})
    with pytest.raises(ConfigError, match="PROVIDER:KEY=VALUE"):
        provider_options(provs, ["TensorrtExecutionProvider:trt_fp16_enable=1"])
    with pytest.raises(ConfigError, match="PROVIDER:KEY=VALUE"):
        provider_options(provs, ["CUDAExecutionProvider:device_id"])


def test_two_onnxruntime_builds_are_refused(monkeypatch):
    monkeypatch.setattr(ort_backend, "installed_ort_builds", lambda: ["onnxruntime", "onnxruntime-gpu"])
    ort_backend._check_single_build.cache_clear()
    try:
        with pytest.raises(BackendError, match="onnxruntime and onnxruntime-gpu are both installed"):
            ort_backend._check_single_build()
    finally:
        ort_backend._check_single_build.cache_clear()


def test_tensorrt_provider_gets_explicit_shape_ranges(tiny_portable):
    from dspark_edge.manifest import read_manifest

    m = read_manifest(tiny_portable)
    prof = ort_backend.trt_ep_profile(m.io, m.model, capacity=256, prefill_max=128, opt_context=64)
    kv = f"x{m.model.num_kv_heads}x{m.model.head_dim}"
    assert prof["trt_profile_min_shapes"].startswith("input_ids:1x1,past_key.0:1x0" + kv)
    assert prof["trt_profile_max_shapes"].startswith("input_ids:1x128,past_key.0:1x128" + kv)
    assert prof["trt_profile_opt_shapes"].startswith("input_ids:1x1,past_key.0:1x64" + kv)
    assert prof["trt_profile_max_shapes"].count(",") == 2 * m.model.num_layers
    provs = ("TensorrtExecutionProvider", "CUDAExecutionProvider")
    opts = BackendOptions(providers=provs, provider_options=({"trt_fp16_enable": "1"}, {}))
    out = ort_backend._with_trt_profile(opts, m.io, m.model, 256)
    assert out.provider_options[0]["trt_fp16_enable"] == "1" and "trt_profile_max_shapes" in out.provider_options[0]
    mine = BackendOptions(providers=provs, provider_options=({"trt_profile_min_shapes": "x"}, {}))
    assert ort_backend._with_trt_profile(mine, m.io, m.model, 256) is mine  # the user's ranges win
    cpu = BackendOptions()
    assert ort_backend._with_trt_profile(cpu, m.io, m.model, 256) is cpu
