"""DeepSpec-format DSpark checkpoints imported into an engine folder: the runtime's drafts equal
the format's own forward (written in dspark_export/drafter/deepspec.py) at short and long
context, speculation stays exact, and a checkpoint that does not fit is refused by name with
nothing written."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from deepspec_checkpoint import write_deepspec_checkpoint

CONFIDENCE_TOLERANCE = 1e-3  # calibrated probability; the anchor's embedding row is stored in FP16


def _snapshot(engine):
    return sorted(p.name for p in engine.iterdir()), (engine / "manifest.json").read_bytes()


@pytest.fixture(scope="module")
def imported(tiny_engine, tiny_hf, tmp_path_factory):
    from dspark_export.drafter.install import install_drafter

    engine = tmp_path_factory.mktemp("deepspec") / "engine"
    shutil.copytree(tiny_engine, engine)
    ckpt = write_deepspec_checkpoint(engine.parent / "ckpt", tiny_hf)
    msgs: list[str] = []
    install_drafter(engine, ckpt, precisions=("fp32", "int8"), progress=msgs.append)
    return engine, ckpt, msgs


def _reference(ckpt):
    from dspark_export.drafter import deepspec

    cfg = deepspec.read_config(ckpt)
    return deepspec.Reference(cfg, deepspec.read_weights(ckpt, cfg))


def test_import_lists_every_block_up_to_the_checkpoints_and_validates(imported):
    from dspark_edge.manifest import read_manifest, verify_files

    engine, _, msgs = imported
    m = read_manifest(engine)
    assert m.drafter.slots == 3 and m.drafter.draft_vocab == m.model.vocab_size
    assert m.widths("drafter", "fp32") == (2, 3, 4)  # block_size 3 → widths 2..4 the target lists
    validation = json.loads(m.drafter.provenance["validation"])
    assert validation["deepspec"]["drafts_identical"] == validation["deepspec"]["rounds"] >= 3
    assert validation["fp32"]["top1_agreement"] == 1.0
    assert m.drafter.provenance["format"] == "DeepSpec Qwen3DSparkModel"
    assert any("DeepSpec forward: drafts identical" in s for s in msgs)
    verify_files(m, engine)


@pytest.mark.parametrize("lengths", [(16, 40), (300, 301, 640), (1100, 1103)])
def test_runtime_drafts_equal_the_deepspec_forward(imported, lengths):
    """Incremental rounds through the installed graph and the runtime's sequential step, against
    the reference from scratch: a position off by one only shows as the context grows."""
    from dspark_edge.drafters.base import DraftRequest
    from dspark_edge.drafters.dspark import DSparkDrafter, sigmoid
    from dspark_edge.manifest import read_manifest

    engine, ckpt, _ = imported
    ref = _reference(ckpt)
    drafter = DSparkDrafter(engine, read_manifest(engine), "fp32")
    rng = np.random.default_rng(len(lengths))
    feats = rng.standard_normal((max(lengths) + 1, drafter.feature_dim)).astype(np.float32)
    tokens = rng.integers(3, 300, max(lengths) + 1).tolist()
    drafter.begin(tokens[:1])
    seen = 0
    for n in lengths:
        req = DraftRequest(context=tokens[:n + 1], max_tokens=3, temperature=0.0, top_k=0, top_p=1.0,
                           new_hidden=feats[seen:n])
        got = drafter.propose(req, rng)
        seen = n
        want, z = ref.propose(feats[:n], tokens[n])
        assert got.tokens.tolist() == want.tolist()
        # 1e-3: the engine keeps the anchor's input-embedding row in FP16 (embedding.npy)
        assert np.abs(got.confidence - sigmoid(z)).max() < CONFIDENCE_TOLERANCE


@pytest.mark.parametrize("options", [{"with_markov": False}, {"markov_rank": 0, "with_markov": False}])
def test_confidence_without_the_markov_input_and_without_a_markov_head(tiny_engine, tiny_hf, tmp_path, options):
    from dspark_edge.drafters.base import DraftRequest
    from dspark_edge.drafters.dspark import DSparkDrafter, sigmoid
    from dspark_edge.manifest import read_manifest
    from dspark_export.drafter.install import install_drafter

    engine = tmp_path / "engine"
    shutil.copytree(tiny_engine, engine)
    ckpt = write_deepspec_checkpoint(tmp_path / "ckpt", tiny_hf, seed=3, **options)
    install_drafter(engine, ckpt, precisions=("fp32",), progress=lambda m: None)
    drafter = DSparkDrafter(engine, read_manifest(engine), "fp32")
    rng = np.random.default_rng(0)
    feats = rng.standard_normal((50, drafter.feature_dim)).astype(np.float32)
    tokens = rng.integers(3, 300, 51).tolist()
    drafter.begin(tokens[:1])
    got = drafter.propose(DraftRequest(context=tokens, max_tokens=3, temperature=0.0, top_k=0, top_p=1.0,
                                       new_hidden=feats), rng)
    want, z = _reference(ckpt).propose(feats, tokens[50])
    assert got.tokens.tolist() == want.tolist() and np.abs(got.confidence - sigmoid(z)).max() < CONFIDENCE_TOLERANCE


@pytest.mark.parametrize("options", [{"draft_vocab": 96}, {"confidence_head": False},
                                     {"draft_vocab": 96, "confidence_head": False, "markov_rank": 0}])
def test_d2t_vocabularies_and_drafters_without_a_confidence_head(tiny_engine, tiny_hf, tmp_path, options):
    """A reduced draft vocabulary (d2t) and a drafter without a confidence head import: drafts
    equal the reference's (anchors outside the draft vocabulary included, which read their own
    Markov row), confidences too (the head's, or the draft distribution's largest probability),
    and greedy speculation stays the target's own output."""
    import dspark_edge
    from dspark_edge.drafters.base import DraftRequest
    from dspark_edge.drafters.dspark import DSparkDrafter, sigmoid
    from dspark_edge.manifest import read_manifest
    from dspark_export.drafter.install import install_drafter

    engine = tmp_path / "engine"
    shutil.copytree(tiny_engine, engine)
    ckpt = write_deepspec_checkpoint(tmp_path / "ckpt", tiny_hf, seed=4, **options)
    install_drafter(engine, ckpt, precisions=("fp32",), progress=lambda m: None)
    manifest = read_manifest(engine)
    assert manifest.drafter.draft_vocab == options.get("draft_vocab", manifest.model.vocab_size)
    assert manifest.drafter.confidence == ("head" if options.get("confidence_head", True) else "draft_probability")
    drafter = DSparkDrafter(engine, manifest, "fp32")
    ref = _reference(ckpt)
    outside = sorted(set(range(3, 300)) - set(drafter.vocab_ids.tolist()))
    rng = np.random.default_rng(1)
    feats = rng.standard_normal((121, drafter.feature_dim)).astype(np.float32)
    tokens = rng.integers(3, 300, 121).tolist()
    if outside:
        tokens[40], tokens[80] = outside[0], outside[-1]  # anchors outside the draft vocabulary
    drafter.begin(tokens[:1])
    seen = 0
    for n in (20, 40, 80, 120):
        got = drafter.propose(DraftRequest(context=tokens[:n + 1], max_tokens=3, temperature=0.0, top_k=0, top_p=1.0,
                                           new_hidden=feats[seen:n]), rng)
        seen = n
        want, z = ref.propose(feats[:n], tokens[n])
        assert got.tokens.tolist() == want.tolist()
        assert np.isin(got.tokens, drafter.vocab_ids).all()
        assert np.abs(got.confidence - sigmoid(z)).max() < CONFIDENCE_TOLERANCE
    plain = dspark_edge.load(engine, "fp32")
    spec = plain.twin(drafter)
    for prompt in ("The quick brown fox", "def add(a, b):"):
        want_ids = plain.generate(prompt, max_new_tokens=24, ignore_eos=True).token_ids
        assert spec.generate(prompt, max_new_tokens=24, ignore_eos=True, draft_tokens=3).token_ids == want_ids


@pytest.mark.parametrize("damage, message", [
    ("float", "d2t holds torch.float32"),
    ("outside", "outside the target's vocabulary"),
    ("twice", "same target id"),
])
def test_a_bad_d2t_table_is_refused_with_nothing_written(tiny_hf, engine_copy, tmp_path, damage, message):
    from safetensors.torch import load_file, save_file

    from dspark_edge.errors import ExportError
    from dspark_export.drafter.install import install_drafter

    ckpt = write_deepspec_checkpoint(tmp_path / "ckpt", tiny_hf, draft_vocab=96)
    path = ckpt / "model.safetensors"
    w = load_file(str(path))
    if damage == "float":
        w["d2t"] = w["d2t"].float()
    elif damage == "outside":
        w["d2t"][-1] = 10_000
    else:
        w["d2t"][1] = w["d2t"][0] - 1  # draft ids 0 and 1 both map to target id d2t[0]
    save_file(w, str(path))
    before = _snapshot(engine_copy)
    with pytest.raises(ExportError, match=message):
        install_drafter(engine_copy, ckpt, precisions=("fp32",), progress=lambda m: None)
    assert _snapshot(engine_copy) == before


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_speculation_with_an_imported_drafter_is_exact_greedy(imported, precision):
    import dspark_edge

    engine, _, _ = imported
    plain = dspark_edge.load(engine, "fp32")
    spec = dspark_edge.load(engine, "fp32", drafter=f"dspark:{precision}", scheduler=False)
    for prompt in ("The quick brown fox", "def add(a, b):"):
        want = plain.generate(prompt, max_new_tokens=40, ignore_eos=True).token_ids
        got = spec.generate(prompt, max_new_tokens=40, ignore_eos=True, draft_tokens=3)
        assert got.token_ids == want and got.stats.rounds < 40  # it drafted, and output is the target's


def _config_change(key, value):
    def change(cfg):
        if value is None:
            cfg.pop(key)
        else:
            cfg[key] = value
    return change


@pytest.mark.parametrize("change, message", [
    (_config_change("markov_head_type", "gated"), "markov_head_type 'gated' is not supported"),
    (_config_change("markov_head_type", "rnn"), "markov_head_type 'rnn' is not supported"),
    (_config_change("draft_vocab_size", 500), "draft_vocab_size 500 exceeds vocab_size 384"),
    (_config_change("hidden_size", 96), "hidden size 96"),
    (_config_change("vocab_size", 500), "vocabulary 500"),
    (_config_change("num_target_layers", 5), r"target layers \(num_target_layers\) 5"),
    (_config_change("mask_token_id", 384), "mask_token_id 384 is outside the vocabulary"),
    (_config_change("target_layer_ids", [0]), r"--hidden-layers 1\b"),
    (_config_change("target_layer_ids", [-1, 1]), "cannot expose"),
    (_config_change("draft_vocab_size", 128), r"missing \['d2t'\]"),
    (_config_change("architectures", ["Gemma4DSparkModel"]), "only Qwen3DSparkModel"),
    (_config_change("rope_scaling", {"rope_type": "yarn", "factor": 4.0}), "RoPE scaling 'yarn'"),
    (_config_change("block_size", None), "lacks 'block_size'"),
    (_config_change("block_size", "7"), "block_size must be an integer"),
])
def test_a_checkpoint_that_does_not_fit_is_refused_with_nothing_written(tiny_hf, engine_copy, tmp_path, change,
                                                                        message):
    from dspark_edge.errors import ExportError
    from dspark_export.drafter.install import install_drafter

    ckpt = write_deepspec_checkpoint(tmp_path / "ckpt", tiny_hf)
    cfg = json.loads((ckpt / "config.json").read_text())
    change(cfg)
    (ckpt / "config.json").write_text(json.dumps(cfg))
    before = _snapshot(engine_copy)
    with pytest.raises(ExportError, match=message):
        install_drafter(engine_copy, ckpt, precisions=("fp32",), progress=lambda m: None)
    assert _snapshot(engine_copy) == before


def test_the_reexport_command_in_the_error_names_every_option_to_keep(tiny_hf, engine_copy, tmp_path):
    from dspark_edge.errors import ExportError
    from dspark_export.drafter.install import install_drafter

    ckpt = write_deepspec_checkpoint(tmp_path / "ckpt", tiny_hf, target_layer_ids=(1,))
    with pytest.raises(ExportError) as err:
        install_drafter(engine_copy, ckpt, precisions=("fp32",), progress=lambda m: None)
    text = str(err.value)
    assert f"--source {tiny_hf}" in text and "--precisions fp32,int8" in text and "--widths 1,2,3,4" in text
    assert text.endswith("--hidden-layers 2")


@pytest.mark.parametrize("damage, message", [
    ("truncate", "damaged or truncated"),
    ("drop", r"missing \['layers.0.mlp.up_proj.weight'\]"),
    ("extra", r"unexpected \['markov_head.gate_proj.weight'\]"),
    ("shape", r"fc.weight has shape \(64, 64\)"),
    ("nan", "NaN or infinite"),
])
def test_damaged_weights_are_refused_with_nothing_written(tiny_hf, engine_copy, tmp_path, damage, message):
    import torch
    from safetensors.torch import load_file, save_file

    from dspark_edge.errors import ExportError
    from dspark_export.drafter.install import install_drafter

    ckpt = write_deepspec_checkpoint(tmp_path / "ckpt", tiny_hf)
    path = ckpt / "model.safetensors"
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:
        w = load_file(str(path))
        if damage == "drop":
            del w["layers.0.mlp.up_proj.weight"]
        elif damage == "extra":
            w["markov_head.gate_proj.weight"] = torch.zeros(8, 8)
        elif damage == "shape":
            w["fc.weight"] = torch.zeros(64, 64)
        else:
            w["norm.weight"][0] = float("nan")
        save_file(w, str(path))
    before = _snapshot(engine_copy)
    with pytest.raises(ExportError, match=message):
        install_drafter(engine_copy, ckpt, precisions=("fp32",), progress=lambda m: None)
    assert _snapshot(engine_copy) == before


def test_the_cli_imports_a_checkpoint(tiny_hf, engine_copy, tmp_path, capsys):
    from dspark_edge.manifest import read_manifest
    from dspark_export.__main__ import main

    ckpt = write_deepspec_checkpoint(tmp_path / "ckpt", tiny_hf)
    assert main(["drafter", "--target", str(engine_copy), "--weights", str(ckpt), "--blocks", "4",
                 "--precisions", "fp32"]) == 0
    assert read_manifest(engine_copy).widths("drafter", "fp32") == (4,)
    ckpt2 = write_deepspec_checkpoint(tmp_path / "ckpt2", tiny_hf, markov_head_type="gated")
    assert main(["drafter", "--target", str(engine_copy), "--weights", str(ckpt2)]) == 2
    assert "error:" in capsys.readouterr().err


def test_generate_with_an_imported_drafter_traces_drafts_and_the_prompt(imported, tmp_path):
    """`generate --drafter dspark --draft-tokens N --trace` on an imported drafter: each round's
    proposed drafts and the prompt's ids are in the trace, so a round can be replayed."""
    import subprocess
    import sys

    from dspark_edge.metrics import read_trace

    engine, ckpt, _ = imported
    trace = tmp_path / "t.jsonl"
    p = subprocess.run([sys.executable, "-m", "dspark_edge", "generate", "--engine", str(engine), "--drafter",
                        "dspark", "--draft-tokens", "3", "--trace", str(trace), "--raw", "--max-new-tokens", "16",
                        "The quick brown fox"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    recs = read_trace(trace)
    rounds = [r for r in recs if r["type"] == "round"]
    (summary,) = [r for r in recs if r["type"] == "summary"]
    assert summary["stats"]["drafter"] == "dspark" and summary["prompt_ids"] and rounds
    assert all(len(r["drafts"]) == r["drafted"] for r in rounds) and rounds[0]["drafted"] == 3
    # replay the first round: the reference drafts from the prompt alone give the recorded drafts
    import dspark_edge

    pipe = dspark_edge.load(engine, "fp32")
    ids = summary["prompt_ids"] + [summary["token_ids"][0]]
    rows: list = []
    pipe.target.prefill(pipe.target.new_cache(), np.asarray(ids[:-1], dtype=np.int64), hidden_sink=rows)
    want, _ = _reference(ckpt).propose(np.concatenate(rows), ids[-1])
    assert rounds[0]["drafts"] == want.tolist()


@pytest.mark.parametrize("sampling", [None, "rejection", "coupled"])
def test_markov_top_k_keeps_speculation_lossless(imported, sampling):
    """A drafter searching only the top-k base logits proposes other drafts; greedy output is
    still the target's, and sampled drafts come from a distribution over those k alone."""
    import dspark_edge
    from dspark_edge.drafters.base import DraftRequest
    from dspark_edge.drafters.dspark import DSparkDrafter
    from dspark_edge.manifest import read_manifest

    engine, _, _ = imported
    manifest = read_manifest(engine)
    narrow = DSparkDrafter(engine, manifest, "fp32", markov_top_k=4)
    assert DSparkDrafter(engine, manifest, "fp32").markov_top_k is None  # "auto": a 384-token vocabulary in full
    rng = np.random.default_rng(0)
    feats = rng.standard_normal((30, narrow.feature_dim)).astype(np.float32)
    tokens = rng.integers(3, 300, 31).tolist()
    narrow.begin(tokens[:1])
    req = DraftRequest(context=tokens, max_tokens=3, temperature=1.0, top_k=0, top_p=1.0, new_hidden=feats,
                       coupled_seed=5 if sampling == "coupled" else None)
    d = narrow.propose(req, rng)
    assert d.q.shape == (3, manifest.model.vocab_size) and np.allclose(d.q.sum(1), 1.0)
    assert ((d.q > 0).sum(1) <= 4).all() and all(d.q[i, t] > 0 for i, t in enumerate(d.tokens))
    if sampling is None:
        plain = dspark_edge.load(engine, "fp32")
        spec = plain.twin(narrow)  # the same target session, drafting with the narrow drafter
        want = plain.generate("The quick brown fox", max_new_tokens=32, ignore_eos=True).token_ids
        got = spec.generate("The quick brown fox", max_new_tokens=32, ignore_eos=True, draft_tokens=3)
        assert got.token_ids == want
