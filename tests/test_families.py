"""Targets of the paper's family: a Qwen3 decoder (per-head q/k norms) exports on the portable
graph too, the exporter keeps the source's tokenizer.json byte for byte, and a source without a
chat template is exported with a warning."""

from __future__ import annotations

import logging

import pytest

from tiny_model import make_tiny_hf

WIDTHS = (1, 2, 4)


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    return make_tiny_hf(tmp_path_factory.mktemp("qwen3") / "hf", seed=5, arch="qwen3")


@pytest.mark.parametrize("graph", ["portable", "fused"])
def test_a_qwen3_target_exports_on_both_graphs_and_matches_pytorch(tiny_qwen3, tmp_path, graph):
    import torch
    from transformers import AutoModelForCausalLM

    import dspark_edge
    from dspark_edge.manifest import read_manifest
    from dspark_export import ExportOptions, export_target

    out = tmp_path / "engine"
    export_target(ExportOptions(source=str(tiny_qwen3), output=out, precisions=("fp32",), widths=WIDTHS, graph=graph))
    m = read_manifest(out)
    assert m.model.architecture.lower().startswith("qwen3")
    (v,) = m.validation
    assert v.passed and v.greedy_tokens_matched == v.greedy_tokens_compared
    # The engine's tokenizer file is the source's, byte for byte.
    assert (out / "tokenizer.json").read_bytes() == (tiny_qwen3 / "tokenizer.json").read_bytes()
    pipe = dspark_edge.load(out, "fp32")
    r = pipe.generate("The quick brown fox", max_new_tokens=12, ignore_eos=True)
    ref = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref.generate(torch.tensor([r.prompt_ids]), max_new_tokens=12, do_sample=False,
                            min_new_tokens=12)[0, len(r.prompt_ids):].tolist()
    assert list(r.token_ids) == want


def test_the_portable_graph_refuses_a_family_it_does_not_implement(tiny_qwen3):
    import types

    from dspark_edge.errors import ExportError
    from dspark_export.portable import check_supported

    fake = types.SimpleNamespace(config=types.SimpleNamespace(model_type="gemma3"))
    with pytest.raises(ExportError, match="not 'gemma3'.*--graph fused"):
        check_supported(fake)


def test_a_source_without_a_chat_template_exports_with_a_warning(tmp_path, caplog):
    from dspark_edge.manifest import read_manifest
    from dspark_export import ExportOptions, export_target

    src = make_tiny_hf(tmp_path / "hf", chat_template=False)
    with caplog.at_level(logging.WARNING, logger="dspark_export.tokenizer"):
        export_target(ExportOptions(source=str(src), output=tmp_path / "engine", precisions=("fp32",), widths=(1, 2),
                                    validate=False))
    assert "no chat template" in caplog.text
    assert read_manifest(tmp_path / "engine").tokenizer.chat_template_file is None
