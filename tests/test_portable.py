"""The portable graph: standard ONNX operators only (what TensorRT parses), the "append" KV
layout bound in place by the ONNX Runtime backend, FP16 and INT8 (QDQ) made from FP32."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import dspark_edge
from dspark_edge.backends.layout import AppendLayout
from dspark_edge.config import GenerationConfig
from dspark_edge.errors import BackendError, ExportError
from dspark_edge.manifest import read_manifest

PROMPT = "The quick brown fox"


def test_manifest_describes_the_portable_graph(tiny_portable):
    m = read_manifest(tiny_portable)
    assert m.io.kv_layout == "append" and m.io.attention_mask is None
    assert m.precisions("target") == ["fp32", "fp16", "int8"]
    devices = {v.precision: v.device for v in m.variants}
    assert devices == {"fp32": "any", "fp16": "gpu", "int8": "any"}
    results = {r.precision: r for r in m.validation}
    assert results["fp32"].passed and results["fp32"].greedy_tokens_matched == results["fp32"].greedy_tokens_compared
    assert results["fp32"].max_abs_logit_diff < 1e-3
    assert results["fp16"].passed and results["fp16"].teacher_forced_top1 >= 0.9


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
def test_graphs_use_standard_operators_only(tiny_portable, precision):
    model = onnx.load(str(tiny_portable / "target" / precision / "model.onnx"), load_external_data=False)
    domains = {n.domain for n in model.graph.node}
    assert domains <= {"", "ai.onnx"}, f"non-standard operator domains {domains}"
    ops = {n.op_type for n in model.graph.node}
    if precision == "int8":
        assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    kv = {i.name: i.type.tensor_type.elem_type for i in model.graph.input if i.name.startswith("past_")}
    want = onnx.TensorProto.FLOAT16 if precision == "fp16" else onnx.TensorProto.FLOAT
    assert set(kv.values()) == {want}
    outs = {o.name: o.type.tensor_type.elem_type for o in model.graph.output}
    assert outs["logits"] == onnx.TensorProto.FLOAT and outs["hidden_states"] == onnx.TensorProto.FLOAT


def test_portable_fp32_equals_the_fused_graph(tiny_portable, tiny_engine):
    """Same weights, two graphs: the same greedy answer."""
    cfg = GenerationConfig(max_new_tokens=24)
    a = dspark_edge.load(tiny_portable, "fp32").generate(PROMPT, cfg)
    b = dspark_edge.load(tiny_engine, "fp32").generate(PROMPT, cfg)
    assert a.token_ids == b.token_ids


def test_a_next_turn_on_the_append_layout_reuses_the_kept_prefix_and_answers_as_from_scratch(tiny_portable):
    with dspark_edge.load(tiny_portable, "fp32", drafter="ngram") as pipe:
        first = pipe.generate(PROMPT, max_new_tokens=16, reuse_prefix=True)
        turn2 = PROMPT + first.text + " and then"
        second = pipe.generate(turn2, max_new_tokens=16, reuse_prefix=True)
        assert second.stats.prompt_reused >= len(first.prompt_ids)
        assert second.token_ids == dspark_edge.load(tiny_portable, "fp32").generate(turn2, max_new_tokens=16).token_ids


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_speculation_is_exact_on_the_append_layout(tiny_portable, precision, k):
    """Drafts rejected and rolled back, the cache appended in place: greedy output equals plain."""
    plain = dspark_edge.load(tiny_portable, precision)
    spec = dspark_edge.load(tiny_portable, precision, drafter="ngram")
    for prompt in (PROMPT, "def add(a, b):\n    return a + b\n" * 3):
        want = plain.generate(prompt, GenerationConfig(max_new_tokens=40)).token_ids
        got = spec.generate(prompt, GenerationConfig(max_new_tokens=40, draft_tokens=k))
        assert got.token_ids == want
        assert got.stats.draft_n_accepted <= got.stats.draft_n
    assert spec.generate(PROMPT * 4, GenerationConfig(max_new_tokens=40, draft_tokens=k)).stats.draft_n > 0


def test_append_cache_continues_exactly_after_rollback(tiny_portable):
    """Run 4 tokens, keep 1, run 3 more: logits equal a fresh run of the kept sequence."""
    from dspark_edge.decoder import DecoderModel

    m = read_manifest(tiny_portable)
    model = DecoderModel(m, tiny_portable, "fp32")
    ids = np.array([5, 9, 17, 33, 40, 41, 42, 43], dtype=np.int64)
    c1 = model.new_cache()
    model.prefill(c1, ids[:4])
    model.step(c1, np.array([60, 61, 62, 63], dtype=np.int64))
    c1.commit(1)
    c1.rollback(4)  # forget it again: position 4 will be overwritten
    out1 = model.step(c1, ids[4:8]).logits.copy()
    c2 = model.new_cache()
    model.prefill(c2, ids[:4])
    out2 = model.step(c2, ids[4:8]).logits
    np.testing.assert_allclose(out1, out2, rtol=0, atol=1e-5)


def test_append_layout_arithmetic():
    lay = AppendLayout(capacity=16, kv_heads=3, head_dim=64, itemsize=2)
    assert lay.position_bytes == 3 * 64 * 2
    assert lay.buffer_bytes == 16 * lay.position_bytes
    assert lay.new_offset(5) == 5 * 384 and lay.past_shape(5) == [1, 5, 3, 64] and lay.new_shape(2) == [1, 2, 3, 64]
    lay.check(14, 2)
    with pytest.raises(BackendError, match="context is full"):
        lay.check(15, 2)


def test_portable_precision_rules(tmp_path, tiny_hf):
    from dspark_export import ExportOptions

    with pytest.raises(ExportError, match="fp16 needs --graph portable"):
        ExportOptions(source=str(tiny_hf), output=tmp_path / "x", precisions=("fp16",))
    with pytest.raises(ExportError, match="int4 needs --graph fused"):
        ExportOptions(source=str(tiny_hf), output=tmp_path / "x", precisions=("int4",), graph="portable")
    with pytest.raises(ExportError, match="graph must be one of"):
        ExportOptions(source=str(tiny_hf), output=tmp_path / "x", graph="tensorrt")


def test_portable_draft_model_drafts_for_a_portable_target(tiny_portable, tiny_hf, tmp_path):
    """A draft model as a portable graph (no hidden-state output), FP16: exact speculation."""
    from dspark_export import ExportOptions, export_target

    out = tmp_path / "draft"
    m = export_target(ExportOptions(source=str(tiny_hf), output=out, precisions=("fp32", "fp16"), widths=(1,),
                                    role="draft_model", keep_layers=2, target_engine=tiny_portable,
                                    graph="portable"))
    assert m.io.hidden_states is None and m.io.kv_layout == "append"
    graph = onnx.load(str(out / "draft_model" / "fp16" / "model.onnx"), load_external_data=False)
    assert [o.name for o in graph.graph.output][:1] == ["logits"] and "hidden_states" not in {
        o.name for o in graph.graph.output}
    plain = dspark_edge.load(tiny_portable, "fp32")
    spec = dspark_edge.load(tiny_portable, "fp32", drafter=str(out))
    want = plain.generate(PROMPT, GenerationConfig(max_new_tokens=30)).token_ids
    got = spec.generate(PROMPT, GenerationConfig(max_new_tokens=30, draft_tokens=3))
    assert got.token_ids == want and got.stats.draft_n > 0
