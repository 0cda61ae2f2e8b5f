"""Drafters trained here written in DeepSpec's checkpoint format: the layout DeepSpec's loader
needs (strict load into a module of its layout), the same drafts and confidences under the
format's own forward, and a round trip through the importer with the same drafts."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from deepspec_mirror import Qwen3DSparkLayout


def _full_vocabulary_drafter(tiny_hf, seed=0):
    """A random drafter over the tiny target's whole vocabulary, its rows in a shuffled order."""
    import torch
    from safetensors.torch import load_file

    from dspark_export.drafter.model import DraftConfig, DSparkDraft

    c = json.loads((tiny_hf / "config.json").read_text())
    t = load_file(str(tiny_hf / "model.safetensors"))
    v = c["vocab_size"]
    cfg = DraftConfig(hidden_size=c["hidden_size"], num_heads=c["num_attention_heads"],
                      num_kv_heads=c["num_key_value_heads"], head_dim=c["hidden_size"] // c["num_attention_heads"],
                      intermediate_size=c["intermediate_size"], num_layers=1, feature_layers=(1, 2),
                      rms_eps=c["rms_norm_eps"], rope_theta=float(c.get("rope_theta", 10000.0)), slots=3,
                      draft_vocab=v, markov_rank=8, qk_norm=True)
    g = torch.Generator().manual_seed(seed)
    model = DSparkDraft(cfg, t["model.embed_tokens.weight"].float(), t["lm_head.weight"].float(),
                        torch.randperm(v, generator=g), t["model.norm.weight"].float())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model.eval(), c


def _project_round(model, feats, anchor):
    """The drafter's greedy drafts (target ids) and raw confidence logits, this project's way."""
    import torch

    from dspark_edge.drafters.dspark import sequential_step
    from dspark_export.drafter.onnx_export import reference_round, tables

    tab = tables(model)
    u, h = reference_round(model, torch.from_numpy(feats), anchor, feats.shape[0], model.cfg.slots)
    idx, z = sequential_step(u, h, int(model.to_draft[anchor]), tab["markov_in"], tab["markov_out"],
                             tab["conf_w"].astype(np.float64), float(tab["conf_b"][0]),
                             lambda j, logits, cand: int(np.argmax(logits)))
    return tab["vocab_ids"][idx], z


def test_a_full_vocabulary_drafter_writes_deepspecs_own_format(tiny_hf, tmp_path):
    import torch
    from safetensors.torch import load_file

    from dspark_export.drafter import deepspec
    from dspark_export.drafter.deepspec_export import write_deepspec

    model, target_cfg = _full_vocabulary_drafter(tiny_hf)
    out = write_deepspec(model, target_cfg, tmp_path / "ckpt", mask_token_id=5, anchors=16,
                         temperatures=[1.1, 1.2, 1.3], biases=[0.0, 0.1, -0.1], provenance={"test": "yes"})
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and "draft_vocab_size" not in config
    assert config["target_layer_ids"] == [0, 1] and config["block_size"] == 3 and config["mask_token_id"] == 5
    weights = load_file(str(out / "model.safetensors"))
    layout = Qwen3DSparkLayout(config)
    layout.load_state_dict(weights, strict=True)  # DeepSpec's loader: no missing, no unexpected keys
    assert torch.equal(weights["embed_tokens.weight"][5], model.mask_embed.detach())
    ref = deepspec.Reference(deepspec.read_config(out), deepspec.read_weights(out, deepspec.read_config(out)))
    rng = np.random.default_rng(0)
    for n in (12, 40, 200):
        feats = rng.standard_normal((n, model.cfg.feature_dim)).astype(np.float32)
        anchor = int(rng.integers(20, 300))
        want, want_z = _project_round(model, feats, anchor)
        got, z = ref.propose(feats, anchor)
        assert got.tolist() == want.tolist()
        assert np.abs(z - want_z).max() < 1e-4
    assert deepspec.read_calibration(out, deepspec.read_config(out)) == ([1.1, 1.2, 1.3], [0.0, 0.1, -0.1])


def test_train_drafter_writes_a_d2t_checkpoint_that_imports_to_the_same_drafts(tiny_with_drafter, tmp_path):
    """train-drafter's OUTPUT/deepspec (a 200-token draft vocabulary: the d2t form) imported
    into another copy of the engine drafts exactly what the drafter installed from its own
    folder drafts, with the same calibrated confidences."""
    from dspark_edge.drafters.base import DraftRequest
    from dspark_edge.drafters.dspark import DSparkDrafter
    from dspark_edge.manifest import read_manifest
    from dspark_export.drafter.install import install_drafter

    engine, weights, msgs = tiny_with_drafter
    ckpt = weights / "deepspec"
    config = json.loads((ckpt / "config.json").read_text())
    assert config["draft_vocab_size"] == 200 and any("DeepSpec checkpoint" in m for m in msgs)
    other = tmp_path / "engine"
    shutil.copytree(engine, other)
    install_drafter(other, ckpt, blocks=(2, 4), precisions=("fp32",), progress=lambda m: None)
    mine = DSparkDrafter(engine, read_manifest(engine), "fp32")
    theirs = DSparkDrafter(other, read_manifest(other), "fp32")
    assert read_manifest(other).drafter.temperatures == read_manifest(engine).drafter.temperatures
    rng = np.random.default_rng(2)
    feats = rng.standard_normal((161, mine.feature_dim)).astype(np.float32)
    tokens = rng.integers(3, 380, 161).tolist()
    for d in (mine, theirs):
        d.begin(tokens[:1])
    seen = 0
    for n in (10, 50, 100, 160):
        req = DraftRequest(context=tokens[:n + 1], max_tokens=3, temperature=0.0, top_k=0, top_p=1.0,
                           new_hidden=feats[seen:n])
        a, b = mine.propose(req, rng), theirs.propose(req, rng)
        seen = n
        assert a.tokens.tolist() == b.tokens.tolist()
        assert np.abs(a.confidence - b.confidence).max() < 1e-3  # the anchor's rows are kept in FP16


def test_the_cli_writes_a_checkpoint_and_refuses_an_old_architecture(tiny_with_drafter, tiny_hf, tmp_path, capsys):
    from dspark_export.__main__ import main

    engine, weights, _ = tiny_with_drafter
    out = tmp_path / "out"
    assert main(["deepspec", "--target", str(engine), "--weights", str(weights), "--output", str(out),
                 "--source", str(tiny_hf), "--mask-token-id", "7"]) == 0
    assert json.loads((out / "config.json").read_text())["mask_token_id"] == 7
    assert main(["deepspec", "--target", str(engine), "--weights", str(weights), "--output", str(tmp_path / "x"),
                 "--source", str(tiny_hf), "--mask-token-id", "100000"]) == 2
    assert "outside the vocabulary" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_a_drafter_without_qk_norms_is_refused(tiny_hf, tmp_path):
    import dataclasses

    from dspark_edge.errors import ExportError
    from dspark_export.drafter.deepspec_export import deepspec_tensors
    from dspark_export.drafter.model import DSparkDraft

    model, _ = _full_vocabulary_drafter(tiny_hf)
    old = DSparkDraft(dataclasses.replace(model.cfg, qk_norm=False), model.embed, model.embed, model.vocab_ids)
    with pytest.raises(ExportError, match="q/k norms"):
        deepspec_tensors(old, 5)
