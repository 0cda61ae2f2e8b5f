"""The target's input embedding table stored on its own and memory-mapped, and a DSpark
drafter whose LM head is that table reading it instead of holding a copy: the graphs compute
what they did, one mapping serves every session, and a damaged table is a project error."""

from __future__ import annotations

import json
import mmap
import shutil

import numpy as np
import pytest
from deepspec_checkpoint import write_deepspec_checkpoint
from tiny_model import make_tiny_hf

PROMPT = "Speculative decoding drafts tokens"


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """A tied tiny target (its FP32 graph as the builder writes it gathers from a transposed
    LM head) with a full-vocabulary DeepSpec drafter installed with the shared head."""
    from dspark_export import ExportOptions, export_target
    from dspark_export.drafter.install import install_drafter

    root = tmp_path_factory.mktemp("tied")
    hf = make_tiny_hf(root / "hf", tied=True)
    engine = root / "engine"
    export_target(ExportOptions(source=str(hf), output=engine, precisions=("fp32", "int8"), widths=(1, 2, 3, 4)))
    ckpt = write_deepspec_checkpoint(root / "ckpt", hf)
    msgs: list[str] = []
    install_drafter(engine, ckpt, precisions=("fp32", "int8"), progress=msgs.append)
    return engine, hf, ckpt, msgs


def _mapped(a: np.ndarray) -> bool:
    """Whether ``a`` is a view into a memory-mapped file."""
    while isinstance(a, np.ndarray):
        a = a.base
    return isinstance(a.obj if isinstance(a, memoryview) else a, mmap.mmap)


def _graph(path):
    import onnx

    return onnx.load(str(path), load_external_data=False).graph


def test_the_tied_targets_graphs_gather_from_a_table_file_equal_to_the_embedding(tied):
    import torch
    from transformers import AutoModelForCausalLM

    from dspark_edge.manifest import read_manifest

    engine, hf, _, _ = tied
    m = read_manifest(engine)
    assert {(t.graph, t.file) for t in m.embedding_tables} == {
        ("target/fp32/model.onnx", "target/fp32/embed_tokens.npy"),
        ("target/int8/model.onnx", "target/int8/embed_tokens.npy")}
    g = _graph(engine / "target/fp32/model.onnx")
    gather = next(n for n in g.node if n.op_type == "Gather" and "input_ids" in n.input)
    assert gather.input[0] in {i.name for i in g.initializer}  # no Transpose of the head in between
    assert not any(n.op_type == "Transpose" and n.output[0] == gather.input[0] for n in g.node)
    ref = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).model.embed_tokens.weight.detach().numpy()
    for t in m.embedding_tables:
        assert np.array_equal(np.load(engine / t.file), ref)
    assert all(v.passed and v.greedy_tokens_matched == v.greedy_tokens_compared for v in m.validation
               if v.precision == "fp32")


def test_every_target_session_computes_with_one_mapping_of_the_table(tied, monkeypatch):
    import dspark_edge
    import dspark_edge.decoder

    engine = tied[0]
    fp32 = dspark_edge.load(engine, "fp32")
    int8 = dspark_edge.load(engine, "int8")
    a = fp32.target.session.session.dspark_initializers[0]["model.embed_tokens.weight"]
    b = int8.target.session.session.dspark_initializers[0]["model.embed_tokens.weight"]
    assert a is b and _mapped(a) and not a.flags.writeable
    mapped = fp32.generate(PROMPT, max_new_tokens=16, ignore_eos=True).token_ids
    # a session that reads the table itself, through the graph's external data entry into the
    # .npy file (what a provider other than the CPU's does), decodes the same tokens
    monkeypatch.setattr(dspark_edge.decoder, "session_initializers", lambda *a: {})
    own = dspark_edge.load(engine, "fp32")
    assert own.target.session.session.dspark_initializers[0] == {}
    assert own.generate(PROMPT, max_new_tokens=16, ignore_eos=True).token_ids == mapped


def test_a_drafter_whose_head_is_the_table_reads_it_instead_of_holding_it(tied):
    from dspark_edge.manifest import read_manifest

    engine, _, _, msgs = tied
    m = read_manifest(engine)
    assert m.drafter.head == "target_table"
    # its input embeddings are the table too: anchors read their FP32 rows there, no copy written
    assert m.drafter.embedding == "target/fp32/embed_tokens.npy"
    assert not list(engine.glob("drafter-*/embedding.npy"))
    folder = engine / m.variants_for("drafter", "fp32")[0].file
    fp32 = _graph(folder)
    v, h = m.model.vocab_size, m.model.hidden_size
    assert "head_table" in [i.name for i in fp32.input]
    assert not any(list(i.dims) in ([v, h], [h, v]) for i in fp32.initializer)
    int8 = _graph(engine / m.variants_for("drafter", "int8")[0].file)
    assert "head_table" not in [i.name for i in int8.input]  # INT8 keeps its own quantized head
    validation = json.loads(m.drafter.provenance["validation"])
    assert validation["fp32"]["top1_agreement"] == 1.0 and validation["fp32"]["max_abs_logit_diff"] < 1e-4
    assert any("not held twice" in s for s in msgs)


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_speculation_with_the_shared_head_is_exact_and_reads_the_targets_mapping(tied, precision):
    import dspark_edge

    engine = tied[0]
    plain = dspark_edge.load(engine, precision).generate(PROMPT, max_new_tokens=40, ignore_eos=True).token_ids
    pipe = dspark_edge.load(engine, precision, drafter="dspark:fp32", scheduler=False)
    out = pipe.generate(PROMPT, max_new_tokens=40, ignore_eos=True, draft_tokens=3)
    assert out.token_ids == plain and out.stats.draft_n > 0
    shared = pipe.target.session.session.dspark_initializers[0]["model.embed_tokens.weight"]
    assert pipe.drafter.head_table is shared


def test_own_head_keeps_a_copy_in_the_graph(tied, tmp_path):
    from dspark_edge.manifest import read_manifest
    from dspark_export.drafter.install import install_drafter

    src, _, ckpt, _ = tied
    engine = tmp_path / "engine"
    shutil.copytree(src, engine)
    install_drafter(engine, ckpt, precisions=("fp32",), progress=lambda s: None, share_head=False)
    m = read_manifest(engine)
    assert m.drafter.head == "own"
    assert "head_table" not in [i.name for i in _graph(engine / m.variants_for("drafter", "fp32")[0].file).input]


def test_an_untied_targets_drafter_keeps_its_head(tiny_engine, tiny_hf, tmp_path):
    """The tests' default tiny target is untied: its drafter's head (the target's LM head) is not
    the embedding table, so nothing is shared, though the table has a file of its own."""
    from dspark_edge.manifest import read_manifest
    from dspark_export.drafter.install import install_drafter

    engine = tmp_path / "engine"
    shutil.copytree(tiny_engine, engine)
    assert read_manifest(engine).embedding_tables
    install_drafter(engine, write_deepspec_checkpoint(tmp_path / "ckpt", tiny_hf), precisions=("fp32",),
                    progress=lambda s: None)
    m = read_manifest(engine)
    assert m.drafter.head == "own" and m.drafter.embedding == "target/fp32/embed_tokens.npy"


def _rewrite_manifest(engine, change):
    path = engine / "manifest.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_a_damaged_table_file_is_a_project_error(tied, tmp_path):
    import dspark_edge
    from dspark_edge.errors import EngineError
    from dspark_edge.manifest import file_entry

    engine = tmp_path / "engine"
    shutil.copytree(tied[0], engine)
    table = engine / "target/fp32/embed_tokens.npy"
    good = np.load(table)
    table.write_bytes(table.read_bytes()[: table.stat().st_size // 2])
    with pytest.raises(EngineError, match="embed_tokens.npy"):
        dspark_edge.load(engine, "fp32")
    # the same size, another shape, and a manifest that agrees with the file: refused by shape
    np.save(table, good.reshape(good.shape[0] * 2, -1))
    entry = file_entry(engine, "target/fp32/embed_tokens.npy")
    _rewrite_manifest(engine, lambda d: [f.update(sha256=entry.sha256, size=entry.size) for f in d["files"]
                                         if f["path"] == entry.path])
    with pytest.raises(EngineError, match="not the float32"):
        dspark_edge.load(engine, "fp32")


def test_the_manifest_refuses_a_shared_head_without_a_table(tied, tmp_path):
    from dspark_edge.errors import ManifestError
    from dspark_edge.manifest import read_manifest

    engine = tmp_path / "engine"
    shutil.copytree(tied[0], engine)
    _rewrite_manifest(engine, lambda d: d.update(embedding_tables=[]))
    with pytest.raises(ManifestError, match="embedding table"):
        read_manifest(engine)
    _rewrite_manifest(engine, lambda d: d.update(embedding_tables=[
        {"graph": "target/fp32/model.onnx", "initializer": "x", "file": "target/fp32/elsewhere.npy"}]))
    with pytest.raises(ManifestError, match="not listed in files"):
        read_manifest(engine)


def test_the_markov_tables_are_mapped_and_a_damaged_file_is_refused(tied, tmp_path, monkeypatch):
    from dspark_edge.drafters import dspark
    from dspark_edge.drafters.dspark import DSparkDrafter
    from dspark_edge.errors import EngineError
    from dspark_edge.manifest import file_entry, read_manifest

    engine = tmp_path / "engine"
    shutil.copytree(tied[0], engine)
    m = read_manifest(engine)
    assert m.drafter.markov is not None
    full = DSparkDrafter(engine, m, "fp32", markov_top_k=None)
    narrow = DSparkDrafter(engine, m, "fp32", markov_top_k=8)
    assert _mapped(narrow.w1) and _mapped(narrow.embedding)
    # W2 is an FP32 copy: whole for biasing the whole draft vocabulary, as W2ᵀ's contiguous rows
    # (the candidates a slot gathers) with a top-k
    assert not np.may_share_memory(narrow.w2, narrow.w1) and not np.may_share_memory(full.w2, full.w1)
    assert full.w2.dtype == narrow.w2.dtype == np.float32
    assert full.w2.flags.c_contiguous and narrow.w2.T.flags.c_contiguous
    assert np.array_equal(full.w2, narrow.w2)
    # beyond the copy's cap, a top-k reads W2's candidate rows in the mapping, FP16 as stored
    monkeypatch.setattr(dspark, "MARKOV_COPY_MAX_BYTES", narrow.w2.nbytes - 1)
    mapped = DSparkDrafter(engine, m, "fp32", markov_top_k=8)
    assert np.may_share_memory(mapped.w2, mapped.w1) and np.array_equal(mapped.w2.astype(np.float32), narrow.w2)
    assert DSparkDrafter(engine, m, "fp32", markov_top_k=None).w2.flags.c_contiguous  # biasing whole: still copied
    markov = engine / m.drafter.markov
    good = np.load(markov)
    np.save(markov, good[:, : good.shape[1] // 2].copy())
    entry = file_entry(engine, m.drafter.markov)
    _rewrite_manifest(engine, lambda d: [f.update(sha256=entry.sha256, size=entry.size) for f in d["files"]
                                         if f["path"] == entry.path])
    with pytest.raises(EngineError, match="Markov tables"):
        DSparkDrafter(engine, read_manifest(engine), "fp32")


def test_the_markov_tables_are_half_precision_unless_asked_or_out_of_range(tied, tmp_path):
    """FP16 by default (the install report counts the DeepSpec validation rounds it changed),
    FP32 on request or when a weight lies beyond FP16's range; both load and read the same rows."""
    from dspark_edge.drafters.dspark import DSparkDrafter
    from dspark_edge.manifest import read_manifest
    from dspark_export.drafter.install import _markov_dtype, install_drafter

    engine, _, ckpt, _ = tied
    m = read_manifest(engine)
    half = np.load(engine / m.drafter.markov)
    assert half.dtype == np.float16
    report = json.loads(m.drafter.provenance["validation"])["deepspec"]
    assert 0 <= report["drafts_identical_fp16_markov"] <= report["rounds"]
    copy = tmp_path / "engine"
    shutil.copytree(engine, copy)
    install_drafter(copy, ckpt, precisions=("fp32",), progress=lambda s: None, markov_dtype="float32")
    m32 = read_manifest(copy)
    full = np.load(copy / m32.drafter.markov)
    assert full.dtype == np.float32 and np.array_equal(full.astype(np.float16), half)
    d32, d16 = DSparkDrafter(copy, m32, "fp32"), DSparkDrafter(engine, m, "fp32")
    assert d32.w1.dtype == np.float32 and d16.w1.dtype == np.float16
    assert np.array_equal(d32.w1.astype(np.float16), d16.w1)
    said: list[str] = []
    big = {"markov_in": np.array([[1.0, -7e4]], np.float32), "markov_out": np.zeros((1, 1), np.float32)}
    assert _markov_dtype(big, "float16", said.append) == "float32" and "FP16's range" in said[0]
    assert _markov_dtype({**big, "markov_in": big["markov_in"] / 10}, "float16", said.append) == "float16"
    assert _markov_dtype(big, "float32", said.append) == "float32"


def test_a_shared_head_on_a_device_provider_warns(tied, monkeypatch, caplog):
    """On a GPU provider the host table would be copied to the device every round: said at load."""
    import dspark_edge.backends.ort as ort_backend
    import dspark_edge.drafters.dspark as dspark_mod
    from dspark_edge.manifest import read_manifest

    real = ort_backend.open_session

    class OnDevice:
        def __init__(self, session):
            self._s = session

        def get_providers(self):
            return ["CUDAExecutionProvider", "CPUExecutionProvider"]

        def __getattr__(self, name):
            return getattr(self._s, name)

    monkeypatch.setattr(ort_backend, "open_session", lambda *a, **k: OnDevice(real(*a, **k)))
    engine = tied[0]
    with caplog.at_level("WARNING", logger="dspark_edge.drafters.dspark"):
        dspark_mod.DSparkDrafter(engine, read_manifest(engine), "fp32")
    assert "--own-head" in caplog.text
