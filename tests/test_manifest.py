"""manifest.json: strict round trip and rejection of bad content, missing and corrupted files."""

from __future__ import annotations

import json

import pytest

import dspark_edge
from dspark_edge.errors import EngineError, ManifestError
from dspark_edge.manifest import MANIFEST_NAME, Manifest, read_manifest, verify_files


def _edit(engine, fn):
    path = engine / MANIFEST_NAME
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


def test_round_trip_is_exact(tiny_engine):
    m = read_manifest(tiny_engine)
    again = Manifest.from_json(m.to_json())
    assert again == m
    assert json.loads(again.to_json()) == json.loads((tiny_engine / MANIFEST_NAME).read_text())


@pytest.mark.parametrize("edit, match", [
    (lambda d: d.update(surprise=1), r"unknown key\(s\) \['surprise'\]"),
    (lambda d: d["model"].update(colour="red"), r"model: unknown key"),
    (lambda d: d["variants"][0].update(width=0), r"variants\[0\].*width must be >= 1"),
    (lambda d: d["variants"][0].update(width="2"), r"variants\[0\]\.width: expected an integer"),
    (lambda d: d["variants"][0].update(precision="int3"), r"precision: 'int3' is not one of"),
    (lambda d: d["variants"][0].update(file="nope.onnx"), r"not listed in files"),
    (lambda d: d.update(hidden_state_layers=[0]), r"outside \[1,"),
    (lambda d: d["tokenizer"].update(eos_ids=[]), r"eos_ids"),
    (lambda d: d.pop("model"), r"missing required key 'model'"),
    (lambda d: d.update(schema_version=99), r"newer than this dspark_edge"),
    (lambda d: d["files"][0].update(path="../../etc/passwd"), r"inside the engine folder"),
])
def test_bad_manifest_rejected_with_field_path(engine_copy, edit, match):
    _edit(engine_copy, edit)
    with pytest.raises(ManifestError, match=match):
        dspark_edge.load(engine_copy)


def test_not_json(engine_copy):
    (engine_copy / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        read_manifest(engine_copy)


def test_missing_folder_and_manifest(tmp_path):
    with pytest.raises(EngineError, match="does not exist"):
        dspark_edge.load(tmp_path / "nowhere")
    with pytest.raises(ManifestError, match="manifest.json is missing|is missing"):
        dspark_edge.load(tmp_path)


def test_missing_graph_file(engine_copy):
    (engine_copy / "target" / "fp32" / "model.onnx").unlink()
    with pytest.raises(EngineError, match="model.onnx is missing"):
        dspark_edge.load(engine_copy)


def test_truncated_weights(engine_copy):
    data = engine_copy / "target" / "fp32" / "model.onnx.data"
    data.write_bytes(data.read_bytes()[:1000])
    with pytest.raises(EngineError, match="truncated"):
        dspark_edge.load(engine_copy)


def test_sha_mismatch(engine_copy):
    data = engine_copy / "target" / "fp32" / "model.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(EngineError, match="sha256"):
        dspark_edge.load(engine_copy)
    # skipping the hash check is possible, sizes are still checked
    verify_files(read_manifest(engine_copy), engine_copy, check_hashes=False)


def test_corrupted_graph_with_matching_manifest(engine_copy):
    """A garbled ONNX file whose manifest entry was updated still fails with a clear error."""
    from dspark_edge.manifest import file_entry, write_manifest
    from dataclasses import replace

    graph = engine_copy / "target" / "fp32" / "model.onnx"
    graph.write_bytes(b"\x00garbage" * 100)
    m = read_manifest(engine_copy)
    files = tuple(file_entry(engine_copy, f.path) if f.path == "target/fp32/model.onnx" else f for f in m.files)
    write_manifest(replace(m, files=files), engine_copy)
    with pytest.raises(EngineError, match="could not load"):
        dspark_edge.load(engine_copy)


def test_kv_names_need_the_layer_placeholder():
    import dataclasses

    from dspark_edge.manifest import GraphIO
    from dspark_export.portable import PORTABLE_IO

    assert PORTABLE_IO.kv_names(2)[1] == (PORTABLE_IO.past_value.format(layer=0),
                                          PORTABLE_IO.present_value.format(layer=0))
    for key in ("past_key", "past_value", "present_key", "present_value"):
        with pytest.raises(ValueError, match="must contain"):
            dataclasses.replace(PORTABLE_IO, **{key: "no_placeholder"})
    assert isinstance(PORTABLE_IO, GraphIO)
