"""Exporter: options rejected before any work, and no half-written engine folder, ever."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import dspark_edge
from dspark_edge.errors import ExportError
from dspark_export import ExportOptions, export_target
from dspark_export.target import default_hidden_layers

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("kw, match", [
    (dict(precisions=("fp64",)), "unsupported precision"),
    (dict(precisions=()), "precisions is empty"),
    (dict(widths=(2, 4)), "must include 1"),
    (dict(widths=(1, 0)), r"widths must be integers in \[1, 64\]"),
    (dict(widths=(1, 100)), r"widths must be integers in \[1, 64\]"),
    (dict(precisions=("fp32", "fp32")), "lists one twice"),
])
def test_bad_options_rejected_before_work(tmp_path, kw, match):
    with pytest.raises(ExportError, match=match):
        ExportOptions(source="default", output=tmp_path / "out", **kw)
    assert not (tmp_path / "out").exists()


def test_bad_source_rejected(tmp_path):
    for source, match in [(str(tmp_path / "nope"), "does not exist"), (str(tmp_path), "without config.json")]:
        with pytest.raises(ExportError, match=match):
            export_target(ExportOptions(source=source, output=tmp_path / "out"))
    (tmp_path / "model.bin").write_bytes(b"x")
    with pytest.raises(ExportError, match="not a .gguf"):
        export_target(ExportOptions(source=str(tmp_path / "model.bin"), output=tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_existing_output_needs_overwrite(tmp_path, tiny_engine):
    with pytest.raises(ExportError, match="--overwrite"):
        ExportOptions(source="default", output=tiny_engine)
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "precious.txt").write_text("keep me")
    with pytest.raises(ExportError, match="not an engine folder"):
        ExportOptions(source="default", output=junk, overwrite=True)


def test_hidden_layers_out_of_range_leave_nothing(tmp_path, tiny_hf):
    out = tmp_path / "out"
    with pytest.raises(ExportError, match="out of range"):
        export_target(ExportOptions(source=str(tiny_hf), output=out, hidden_layers=(3,)))
    assert not out.exists()
    assert not list(tmp_path.glob(".out.*"))


def test_graph_does_not_depend_on_the_checkout_commit(tiny_engine):
    """The graph builder would stamp the checkout's git commit into the graph (its environment
    lives inside this repository), changing the graph's hash, and so every device profile's
    engine identity, with every commit."""
    import onnx

    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True,
                          text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    for precision in ("fp32", "int8"):
        graph = onnx.load(str(tiny_engine / "target" / precision / "model.onnx"), load_external_data=False)
        assert graph.producer_name == "onnxruntime-genai"
        assert head.stdout.strip()[:7] not in graph.producer_version, graph.producer_version


def test_default_hidden_layers_spread_and_exclude_ends():
    assert default_hidden_layers(30) == (8, 15, 22)
    assert default_hidden_layers(3) == (1, 2)
    assert all(1 <= i < 4 for i in default_hidden_layers(4))


def _export_and_kill(tiny_hf: Path, out: Path, extra: list[str]) -> None:
    """Start an export in a subprocess and kill -9 it once graph building has begun."""
    proc = subprocess.Popen([sys.executable, "-m", "export", "target", "--source", str(tiny_hf), "--output",
                             str(out), "--precisions", "fp32,int8", *extra], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    partial = out.parent / f".{out.name}.partial-{proc.pid}"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if (partial / "target").exists():
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the export finished before it could be interrupted"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def test_kill_9_leaves_no_engine_folder(tmp_path, tiny_hf):
    out = tmp_path / "engine"
    _export_and_kill(tiny_hf, out, [])
    assert not out.exists()
    assert list(tmp_path.glob(".engine.partial-*")), "the staging folder should be what was left"
    # the next export cleans up after the dead one and succeeds
    export_target(ExportOptions(source=str(tiny_hf), output=out, precisions=("fp32",), widths=(1, 2)))
    assert not list(tmp_path.glob(".engine.partial-*"))
    assert dspark_edge.load(out).generate("The", max_new_tokens=2).token_ids


def test_kill_9_during_overwrite_keeps_previous_folder(tmp_path, tiny_hf, tiny_engine):
    out = tmp_path / "engine"
    shutil.copytree(tiny_engine, out)
    before = (out / "manifest.json").read_bytes()
    _export_and_kill(tiny_hf, out, ["--overwrite"])
    assert (out / "manifest.json").read_bytes() == before
    dspark_edge.load(out)  # still complete: every file matches its sha256


def test_draft_model_distillation_lowers_kl(tmp_path, tiny_hf, tiny_engine):
    from dspark_edge.manifest import read_manifest

    out = tmp_path / "draft"
    export_target(ExportOptions(source=str(tiny_hf), output=out, precisions=("fp32",), widths=(1,),
                                role="draft_model", keep_layers=1, target_engine=tiny_engine,
                                distill_minutes=0.05, distill_min_steps=20))  # 20 steps even on a loaded machine
    info = read_manifest(out).exporter
    assert int(info["distill_steps"]) >= 20
    assert float(info["distill_last_kl"]) < float(info["distill_first_kl"])
    dspark_edge.load(tiny_engine, drafter=out).generate("The", max_new_tokens=4)


def test_distillation_needs_a_smaller_draft(tmp_path):
    with pytest.raises(ExportError, match="keep-layers"):
        ExportOptions(source="default", output=tmp_path / "d", role="draft_model", distill_minutes=1)


def test_draft_with_another_tokenizer_rejected_at_export(tmp_path, tiny_hf, tiny_engine):
    import json as _json

    other = tmp_path / "target"
    shutil.copytree(tiny_engine, other)
    m = _json.loads((other / "manifest.json").read_text())
    for f in m["files"]:
        if f["path"] == "tokenizer.json":
            f["sha256"] = "0" * 64
    (other / "manifest.json").write_text(_json.dumps(m))
    out = tmp_path / "draft"
    with pytest.raises(ExportError, match="different tokenizer.json"):
        export_target(ExportOptions(source=str(tiny_hf), output=out, precisions=("fp32",), widths=(1,),
                                    role="draft_model", keep_layers=1, target_engine=other))
    assert not out.exists() and not list(tmp_path.glob(".draft.*"))


def test_export_logs_carry_no_progress_bar_redraws(tiny_hf, tmp_path):
    """Into a file or pipe, the export says its steps one line each: no carriage-return redraws
    of the libraries' progress bars."""
    p = subprocess.run([sys.executable, "-m", "export", "target", "--source", str(tiny_hf), "--output",
                        str(tmp_path / "engine"), "--precisions", "fp32", "--widths", "1,2", "--no-validate"],
                       cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    assert "[1/" in p.stderr and "\r" not in p.stderr


def test_int4_from_a_hugging_face_folder_is_re_quantized_and_says_so(tmp_path, tiny_hf):
    """Only a GGUF source has 4-bit blocks of its own; from a folder the builder re-quantizes and
    the manifest says which. (Not validated: 4-bit rounding flips most argmaxes of a tiny random
    model, whose logits are nearly flat.)"""
    from dspark_edge.manifest import read_manifest

    out = tmp_path / "q4"
    export_target(ExportOptions(source=str(tiny_hf), output=out, precisions=("int4",), widths=(1, 2), validate=False))
    m = read_manifest(out)
    assert m.precisions("target") == ["int4"] and not (out / "target" / "fp32").exists()
    assert m.exporter["int4_weights"].startswith("re-quantized") and "int4_matmuls_4bit" not in m.exporter
    with dspark_edge.load(out, "int4") as pipe:
        assert len(pipe.generate("hello", max_new_tokens=4, ignore_eos=True).token_ids) == 4


def test_int4_activations_are_refused_where_they_shape_nothing(tmp_path, tiny_hf):
    """--int4-activations shapes only an int4 graph made from a GGUF's own blocks: without int4,
    or from a Hugging Face folder (re-quantized), it is refused before anything is written."""
    with pytest.raises(ExportError, match="add int4 to --precisions"):
        ExportOptions(source=str(tiny_hf), output=tmp_path / "a", precisions=("fp32",), int4_activations="int8x3")
    with pytest.raises(ExportError, match="int4 activations must be one of"):
        ExportOptions(source=str(tiny_hf), output=tmp_path / "a", precisions=("int4",), int4_activations="int9")
    with pytest.raises(ExportError, match="re-quantized by the model builder"):
        export_target(ExportOptions(source=str(tiny_hf), output=tmp_path / "b", precisions=("int4",),
                                    int4_activations="int8x2", validate=False))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
