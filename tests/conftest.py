"""Shared fixtures: a tiny model exported once per session, and (slow) the embedded default."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tiny_model import make_tiny_hf

TINY_WIDTHS = (1, 2, 3, 4)


def _cache_root(tmp_path_factory) -> Path:
    """DSPARK_TEST_CACHE keeps exported engines between local runs; CI uses a fresh temp dir."""
    env = os.environ.get("DSPARK_TEST_CACHE")
    if env:
        path = Path(env)
        path.mkdir(parents=True, exist_ok=True)
        return path
    return tmp_path_factory.mktemp("engines")


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory) -> Path:
    return make_tiny_hf(tmp_path_factory.mktemp("tiny") / "hf")


@pytest.fixture(scope="session")
def tiny_engine(tmp_path_factory, tiny_hf) -> Path:
    from dspark_export import ExportOptions, export_target

    out = tmp_path_factory.mktemp("tiny-engine") / "engine"
    export_target(ExportOptions(source=str(tiny_hf), output=out, precisions=("fp32", "int8"),
                                      widths=TINY_WIDTHS))
    return out


@pytest.fixture()
def engine_copy(tiny_engine, tmp_path) -> Path:
    """A private copy of the tiny engine, for tests that change an engine folder."""
    import shutil

    dst = tmp_path / "engine"
    shutil.copytree(tiny_engine, dst)
    return dst


@pytest.fixture(scope="session")
def tiny_torch(tiny_hf):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_hf, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def default_engine(tmp_path_factory) -> Path:
    """The embedded default exported once (FP32; INT8 for self-drafting; INT4 from the GGUF's
    own blocks), default widths."""
    from dspark_export import ExportOptions, export_target
    from dspark_export.gguf_blocks import INT4_GGUF_BLOCKS
    from dspark_edge.manifest import INT4_OUTPUT_KEY
    from dspark_export.sources import default_gguf_path, source_digest, resolve_source

    try:
        default_gguf_path()
    except Exception as exc:  # the package is part of the test environment; say so loudly
        pytest.fail(f"embedded default model unavailable: {exc}")
    out = _cache_root(tmp_path_factory) / "smollm2-135m-fp32"
    if (out / "manifest.json").is_file():
        from dspark_edge.manifest import read_manifest

        m = read_manifest(out)
        if m.model.source_sha256 == source_digest(resolve_source("default")) and \
                {"int8", "int4"} <= set(m.precisions("target")) and m.exporter.get("int4_weights") == INT4_GGUF_BLOCKS \
                and m.exporter.get(INT4_OUTPUT_KEY) == "fp32":
            return out
    export_target(ExportOptions(source="default", output=out, precisions=("fp32", "int8", "int4"), overwrite=True))
    return out


def _export_draft(tmp_path_factory, tiny_hf, tiny_engine, name, keep_layers):
    from dspark_export import ExportOptions, export_target

    out = tmp_path_factory.mktemp(name) / "engine"
    export_target(ExportOptions(source=str(tiny_hf), output=out, precisions=("fp32",), widths=(1,),
                                role="draft_model", keep_layers=keep_layers, target_engine=tiny_engine))
    return out


@pytest.fixture(scope="session")
def tiny_draft_self(tmp_path_factory, tiny_hf, tiny_engine) -> Path:
    """The target's own weights as a draft model: greedy drafts are (almost) always accepted."""
    return _export_draft(tmp_path_factory, tiny_hf, tiny_engine, "draft-self", None)


@pytest.fixture(scope="session")
def tiny_draft_poor(tmp_path_factory, tiny_hf, tiny_engine) -> Path:
    """The target's first layer only: a deliberately poor drafter."""
    return _export_draft(tmp_path_factory, tiny_hf, tiny_engine, "draft-poor", 1)


@pytest.fixture(scope="session")
def tiny_portable(tmp_path_factory, tiny_hf) -> Path:
    """The tiny model as a portable graph (standard operators, append KV layout): FP32, FP16, INT8 QDQ."""
    from dspark_export import ExportOptions, export_target

    out = tmp_path_factory.mktemp("tiny-portable") / "engine"
    export_target(ExportOptions(source=str(tiny_hf), output=out, precisions=("fp32", "fp16", "int8"),
                                widths=TINY_WIDTHS, graph="portable"))
    return out


@pytest.fixture(scope="session")
def tiny_with_drafter(tmp_path_factory, tiny_hf, tiny_engine):
    """A tiny drafter trained by train-drafter (200-token draft vocabulary) and installed."""
    import shutil

    from dspark_export.drafter.build import TrainDrafterOptions, train_drafter
    from dspark_export.drafter.install import install_drafter

    root = tmp_path_factory.mktemp("dspark")
    engine = root / "engine"
    shutil.copytree(tiny_engine, engine)
    msgs = []
    weights = train_drafter(TrainDrafterOptions(
        target_engine=engine, output=root / "weights", work=root / "work", source=str(tiny_hf), prompts=10,
        max_new_tokens=24, text_tokens=300, copy_prompts=4, layers=1, slots=3, draft_vocab=200, markov_rank=8,
        steps=8, seqs_per_step=4, anchors=6), progress=msgs.append)
    install_drafter(engine, weights, blocks=(2, 4), precisions=("fp32", "int8", "fp16"), source=str(tiny_hf),
                    progress=msgs.append)
    return engine, weights, msgs
