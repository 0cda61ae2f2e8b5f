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
