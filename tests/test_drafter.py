"""The DSpark drafter: backbone masks, the Markov/confidence step, calibration, ONNX export, and
an end-to-end train → install → speculative generation on the tiny model."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dspark_edge.drafters.dspark import sequential_step  # noqa: E402
from dspark_export.drafter import calibrate  # noqa: E402
from dspark_export.drafter.data import Sequences  # noqa: E402
from dspark_export.drafter.model import DraftConfig, DSparkDraft  # noqa: E402
from dspark_export.drafter.train import anchor_weights, forward_batch, make_batch  # noqa: E402

V, H = 120, 32
CFG = DraftConfig(hidden_size=H, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64, num_layers=2,
                  feature_layers=(1, 2), slots=4, draft_vocab=100, markov_rank=8)


def _model(seed: int = 0) -> DSparkDraft:
    torch.manual_seed(seed)
    emb = torch.randn(V, H)
    m = DSparkDraft(CFG, emb, torch.randn(V, H), torch.arange(100))
    torch.nn.init.normal_(m.markov_out.weight, std=0.3)
    return m.eval()


def _data(n: int = 3, length: int = 40, seed: int = 0, lengths: list[int] | None = None) -> Sequences:
    """``n`` random sequences of ``length`` tokens (or of ``lengths``), each with a 5-token prompt."""
    rng = np.random.default_rng(seed)
    lengths = [length] * n if lengths is None else lengths
    t = sum(lengths)
    return Sequences(tokens=rng.integers(0, V, t).astype(np.int32),
                     offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                     prompt_lens=np.full(len(lengths), 5, np.int32),
                     aux=rng.standard_normal((t, CFG.feature_dim)).astype(np.float16),
                     top_ids=rng.integers(0, V, (t, 4)).astype(np.int32),
                     top_logp=np.log(np.full((t, 4), 0.2)).astype(np.float16))


def _to_draft(model):
    return model.to_draft.numpy()


def test_block_sees_only_its_context_and_its_own_slots():
    model, data = _model(), _data()
    rng = np.random.default_rng(0)
    anchors = [[10, 25, 30]]
    batch = make_batch(data, [0], 3, CFG.slots, _to_draft(model), rng, fixed_anchors=anchors)
    assert batch["mask"].shape == (1, 1, 3 * CFG.slots, 40 + 3 * CFG.slots)
    with torch.no_grad():
        h0 = forward_batch(model, batch)["lab_logp"].clone()
        # Features at or after the first block's anchor (position 10) must not reach it ...
        batch2 = dict(batch, feats=batch["feats"].clone())
        batch2["feats"][0, 10:] += 5.0
        h1 = forward_batch(model, batch2)["lab_logp"]
    s = CFG.slots
    assert torch.allclose(h0[0, :s], h1[0, :s], atol=1e-5)
    assert not torch.allclose(h0[0, s:], h1[0, s:], atol=1e-3)  # ... but do reach later blocks
    # Another block's anchor token does not reach this block; the block's own anchor does.
    batch3 = dict(batch, anchors=batch["anchors"].clone())
    batch3["anchors"][0, 2] = (batch3["anchors"][0, 2] + 7) % V
    with torch.no_grad():
        h3 = forward_batch(model, batch3)["lab_logp"]
    assert torch.allclose(h0[0, :2 * s], h3[0, :2 * s], atol=1e-5)
    assert not torch.allclose(h0[0, 2 * s:], h3[0, 2 * s:], atol=1e-3)


def test_a_grown_drafter_computes_what_it_computed_before_and_trains_its_new_layer():
    """``grow``: the appended layer starts as the identity (the same outputs, bit for bit up to
    the order of float additions), and one optimizer step later it is no longer the identity."""
    model, data = _model(), _data()
    batch = make_batch(data, [0, 1], 3, CFG.slots, _to_draft(model), np.random.default_rng(0),
                       fixed_anchors=[[10, 25, 30], [6, 20, 33]])
    with torch.no_grad():
        before = forward_batch(model, batch)
    model.grow(1)
    assert model.cfg.num_layers == 3 and len(model.layers) == 3
    assert all(layer.cfg.num_layers == 3 for layer in model.layers)
    assert torch.equal(model.layers[2].q.weight, model.layers[1].q.weight)
    assert not model.layers[2].o.weight.any() and not model.layers[2].down.weight.any()
    with torch.no_grad():
        after = forward_batch(model, batch)
    for k in ("lab_logp", "tv", "conf_logit"):
        assert torch.allclose(before[k], after[k], atol=1e-6), k
    model.train()
    q0, gate0 = model.layers[2].q.weight.detach().clone(), model.layers[2].gate.weight.detach().clone()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    for _ in range(2):  # the first step moves o and down, the second then reaches q, k, v, gate, up
        loss = -forward_batch(model, batch)["lab_logp"].mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    new = model.layers[2]
    assert new.o.weight.any() and new.down.weight.any()
    assert not torch.equal(new.q.weight, q0) and not torch.equal(new.gate.weight, gate0)
    with pytest.raises(ValueError):
        model.grow(-1)


def test_a_widened_drafter_computes_what_it_computed_before_and_learns_its_new_stream():
    """``widen``: a drafter reading streams (1, 3) made to read (1, 2, 3) keeps its context
    columns for 1 and 3 in their new places and starts stream 2's at zero, so on features whose
    stream 2 is anything it computes what it did; one optimizer step later stream 2 counts."""
    torch.manual_seed(0)
    cfg = dataclasses.replace(CFG, feature_layers=(1, 3))
    model = DSparkDraft(cfg, torch.randn(V, H), torch.randn(V, H), torch.arange(100)).eval()
    data = _data()
    rng = np.random.default_rng(1)
    wide = dataclasses.replace(data, aux=np.concatenate(
        [data.aux[:, :H], rng.standard_normal((data.aux.shape[0], H)).astype(np.float16), data.aux[:, H:]], 1))
    anchors = [[10, 25, 30], [6, 20, 33]]
    batch = make_batch(data, [0, 1], 3, cfg.slots, _to_draft(model), np.random.default_rng(0), fixed_anchors=anchors)
    with torch.no_grad():
        before = forward_batch(model, batch)
    old_fc = model.fc.weight.detach().clone()
    model.widen((1, 2, 3))
    assert model.cfg.feature_layers == (1, 2, 3) and model.fc.weight.shape == (H, 3 * H)
    assert all(layer.cfg.feature_layers == (1, 2, 3) for layer in model.layers)
    assert torch.equal(model.fc.weight[:, :H], old_fc[:, :H]) and torch.equal(model.fc.weight[:, 2 * H:], old_fc[:, H:])
    assert not model.fc.weight[:, H:2 * H].any()
    batch = make_batch(wide, [0, 1], 3, cfg.slots, _to_draft(model), np.random.default_rng(0), fixed_anchors=anchors)
    with torch.no_grad():
        after = forward_batch(model, batch)
    for k in ("lab_logp", "tv", "conf_logit"):
        assert torch.allclose(before[k], after[k], atol=1e-5), k
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    loss = -forward_batch(model, batch)["lab_logp"].mean()
    loss.backward()
    opt.step()
    assert model.fc.weight[:, H:2 * H].any()
    with pytest.raises(ValueError, match="would be dropped"):
        model.widen((1, 2))


def test_runtime_walk_starts_each_round_after_the_last_accepted_draft():
    from dspark_export.drafter.train import runtime_walk

    # rounds at positions 0 (2 accepted), 3 (1), 5 (0); then 6 is past the end. Second answer: 0, 1 (3).
    out = runtime_walk([np.array([2, 0, 5, 1, 0, 0]), np.array([0, 3, 1, 1])], slots=4)
    assert out["rounds"] == 5
    assert out["tau"] == pytest.approx(1 + (2 + 1 + 0 + 0 + 3) / 5)
    assert out["reach"] == pytest.approx([3 / 5, 2 / 5, 1 / 5, 0.0])
    assert runtime_walk([], slots=2) == {"tau": 1.0, "rounds": 0, "reach": [0.0, 0.0]}


def test_every_position_rounds_line_up_with_the_answer_positions():
    """``per_sequence`` holds one entry per answer position, the used blocks' accepted drafts in
    order and 0 at the unused ones, and the walk over it agrees with the blocks it visits."""
    from dspark_export.drafter.train import held_out_rounds, runtime_walk, validate_runtime

    model, data = _model(), _data(n=3)
    per: list = []
    acc, _, _ = held_out_rounds(model, data, [0, 2], CFG.slots, anchors=None, per_sequence=per)
    assert [p.size for p in per] == [40 - 5 - 1] * 2
    assert sorted(np.concatenate(per)[np.concatenate(per) > 0]) == sorted(acc[acc > 0])
    assert runtime_walk(per, CFG.slots)["rounds"] <= sum(p.size for p in per)
    assert validate_runtime(model, data, [0, 2], CFG.slots) == runtime_walk(per, CFG.slots)


def test_held_out_walk_reports_progress_and_the_same_rounds():
    """The calibration stage's walk tells a progress callback how far it is (count, rate, time
    left) and says when it is done; reporting changes none of the rounds it returns."""
    from dspark_export.drafter.train import held_out_rounds

    model, data = _model(), _data(n=3)
    lines: list[str] = []
    quiet = held_out_rounds(model, data, [0, 1, 2], CFG.slots, anchors=None)
    told = held_out_rounds(model, data, [0, 1, 2], CFG.slots, anchors=None, progress=lines.append, every_s=0.0)
    assert all(np.array_equal(a, b) for a, b in zip(quiet, told))
    assert [line.split(" ")[0] for line in lines] == ["1/3", "2/3", "3/3"]
    assert "ETA" in lines[0] and lines[-1].startswith("3/3 held-out answers in ")


def test_held_out_walk_batches_answers_without_changing_the_rounds():
    """Several answers' chunks in one drafter call (``rows``) give the rounds one chunk a call
    gives, in the same order: answers of different lengths (one over two 64-anchor chunks, one
    with no answer position at all), every position and fixed anchors alike."""
    from dspark_export.drafter.train import held_out_rounds

    # prompt 5 each: 34, 144, 0, 17, 91 answer positions
    model, data = _model(), _data(seed=3, lengths=[40, 150, 6, 23, 97])
    ids = [1, 0, 2, 4, 3]
    for anchors in (None, 24):
        walks = []
        for rows in (1, 3, 8):
            per: list = []
            out = held_out_rounds(model, data, ids, CFG.slots, anchors=anchors, per_sequence=per, rows=rows)
            walks.append((out, per))
        (acc, z, n_valid), per = walks[0]
        assert acc.size > 0
        for (acc_b, z_b, n_valid_b), per_b in walks[1:]:
            assert np.array_equal(acc_b, acc) and np.array_equal(n_valid_b, n_valid)
            assert np.allclose(z_b, z, atol=1e-4)
            assert len(per_b) == len(per) and all(np.array_equal(p, q) for p, q in zip(per, per_b))
        if anchors is None:
            assert [p.size for p in per] == [144, 34, 0, 91, 17]
    with pytest.raises(ValueError, match="rows"):
        held_out_rounds(model, data, ids, CFG.slots, rows=0)


def test_short_blocks_mask_their_extra_slots():
    model, data = _model(), _data()
    rng = np.random.default_rng(0)
    batch = make_batch(data, [1], 4, CFG.slots, _to_draft(model), rng, short_block=2, short_share=1.0)
    valid = batch["valid"].reshape(4, CFG.slots)
    assert valid[:, 2:].sum() == 0 and valid[:, :2].all()
    m = batch["mask"][0, 0, :, 40:].reshape(4, CFG.slots, 4, CFG.slots)
    assert not m[0, 0, 0, 2:].any() and m[0, 0, 0, :2].all()


def test_hard_anchors_favour_tokens_the_target_was_unsure_of():
    data = _data(n=1, length=40)
    top = np.full((40, 4), np.log(0.99), np.float32)
    top[[9, 19, 29], 0] = np.log(0.05)  # the tokens at 10, 20, 30 were unlikely to the target
    data.top_logp = top.astype(np.float16)
    cand = np.arange(5, 39)
    assert anchor_weights(data, 0, cand, 0.0) is None  # the default draws exactly as before
    w = anchor_weights(data, 0, cand, 0.5)
    assert w.shape == cand.shape and np.isclose(w.sum(), 1.0) and (w > 0).all()
    hard = np.isin(cand, [10, 20, 30])  # uniform: 3/34 of the mass
    assert w[hard].sum() > 0.45 and np.allclose(w[~hard], w[~hard][0])
    with pytest.raises(ValueError, match="hard_share"):
        anchor_weights(data, 0, cand, 1.0)
    model, rng = _model(), np.random.default_rng(0)
    picks = np.concatenate([make_batch(data, [0], 3, CFG.slots, _to_draft(model), rng, hard_share=0.5)["pos"][0, ::CFG.slots].numpy()
                            for _ in range(200)])
    share = np.isin(picks, [10, 20, 30]).mean()
    assert share > 0.3  # uniform draws would give 3/34 ≈ 0.09


def test_markov_step_equals_a_reference_loop():
    model = _model()
    rng = np.random.default_rng(1)
    u = rng.standard_normal((CFG.slots, 100)).astype(np.float32)
    h = rng.standard_normal((CFG.slots, H)).astype(np.float32)
    w1 = model.markov_in.weight.detach().numpy()
    w2 = model.markov_out.weight.detach().numpy().T
    cw, cb = model.conf.weight.detach().numpy()[0].astype(np.float64), float(model.conf.bias.detach())
    drafts, z = sequential_step(u, h, 7, w1, w2, cw, cb, lambda j, lg, cand: int(np.argmax(lg)))
    prev = torch.tensor(7)
    for k in range(CFG.slots):  # PyTorch, one position at a time
        with torch.no_grad():
            bias, row = model.markov(prev)
            logits = torch.from_numpy(u[k]) + bias
            zk = model.confidence_logit(torch.from_numpy(h[k]), row)
        assert int(logits.argmax()) == drafts[k]
        assert abs(float(zk) - z[k]) < 1e-4
        prev = logits.argmax()


def test_markov_top_k_adds_the_bias_to_the_largest_base_logits_only():
    model = _model()
    rng = np.random.default_rng(3)
    u = rng.standard_normal((CFG.slots, 100)).astype(np.float32)
    h = rng.standard_normal((CFG.slots, H)).astype(np.float32)
    w1 = model.markov_in.weight.detach().numpy()
    w2 = rng.standard_normal((w1.shape[1], 100)).astype(np.float32)  # a strong bias: top-k matters
    cw, cb = model.conf.weight.detach().numpy()[0].astype(np.float64), 0.0
    greedy = lambda j, lg, cand: int(np.argmax(lg))  # noqa: E731
    full, z_full = sequential_step(u, h, 7, w1, w2, cw, cb, greedy)
    assert np.array_equal(sequential_step(u, h, 7, w1, w2, cw, cb, greedy, top_k=100)[0], full)  # k = Vd: all
    drafts, z = sequential_step(u, h, 7, w1, w2, cw, cb, greedy, top_k=5)
    prev = 7
    for k in range(CFG.slots):  # the reference: the full biased logits, masked to the 5 largest base logits
        logits = u[k] + w1[prev] @ w2
        keep = np.argsort(u[k])[-5:]
        assert drafts[k] == keep[np.argmax(logits[keep])]
        prev = drafts[k]
    assert np.allclose(z[0], z_full[0])  # the first confidence reads the anchor alone
    assert not np.array_equal(drafts, full)  # with this bias, the narrow search proposes other drafts


def test_the_largest_values_are_found_exactly_whatever_the_threshold_draws():
    """``largest``: each row's k largest values, the set ``argpartition`` finds (equal values at
    the k-th place aside), by a sampled threshold or, when too few values pass it, the whole row."""
    from dspark_edge.drafters.dspark import largest

    rng = np.random.default_rng(5)
    for n, k in ((8192, 256), (32000, 64), (8192, 2000), (600, 256), (100, 5)):
        u = rng.standard_normal((6, n)).astype(np.float32)
        u[1] = np.exp(3 * u[1])  # a skewed row, as logits are
        for r, idx in zip(u, largest(u, k)):
            assert idx.size == k and set(idx.tolist()) == set(np.argpartition(r, -k)[-k:].tolist())
    # every sampled position holds one of the largest values: few pass the threshold, the row is partitioned
    row = rng.standard_normal(8192).astype(np.float32)
    row[::4] += 100.0
    assert set(largest(row[None], 256)[0].tolist()) == set(np.argpartition(row, -256)[-256:].tolist())
    ties = np.zeros((2, 4096), np.float32)  # all equal: any k of them
    ties[1, :10] = 1.0
    for r, idx in zip(ties, largest(ties, 128)):
        assert idx.size == 128 and np.array_equal(np.sort(r[idx]), np.sort(r)[-128:])


def test_confidence_depends_on_the_previous_draft_only():
    model = _model()
    rng = np.random.default_rng(2)
    u, h = rng.standard_normal((4, 100)).astype(np.float32), rng.standard_normal((4, H)).astype(np.float32)
    args = (model.markov_in.weight.detach().numpy(), model.markov_out.weight.detach().numpy().T,
            model.conf.weight.detach().numpy()[0].astype(np.float64), 0.1)
    a = sequential_step(u, h, 3, *args, choose=lambda j, lg, cand: [5, 6, 7, 8][j])
    b = sequential_step(u, h, 3, *args, choose=lambda j, lg, cand: [5, 6, 9, 8][j])  # x_3 differs
    assert np.allclose(a[1][:3], b[1][:3])  # c_1..c_3 are known before x_3 is drawn
    assert not np.isclose(a[1][3], b[1][3])  # c_4 reads x_3


def test_calibration_reduces_ece_on_a_miscalibrated_set():
    rng = np.random.default_rng(0)
    n, slots = 4000, 4
    true_logit = rng.normal(1.0, 1.5, (n, slots))
    p = calibrate.sigmoid(true_logit)
    accepted_each = rng.random((n, slots)) < p
    accepted = np.cumprod(accepted_each, axis=1).sum(1)
    z = true_logit * 3.0  # overconfident by a factor of 3
    temps = calibrate.fit_temperatures(z, accepted)
    rep = calibrate.report(z, accepted, temps)
    for pos in rep["positions"]:
        assert pos["ece_after"] < pos["ece_before"]
        assert pos["ece_after"] < 0.03
    assert 2.0 < temps[0] < 4.5
    assert 0.5 < rep["positions"][0]["auroc"] <= 1.0
    temps, biases = calibrate.fit_calibration(z, accepted)
    assert 2.0 < temps[0] < 4.5 and abs(biases[0]) < 0.3  # nothing to shift: the bias stays near 0
    assert all(p["ece_after"] < 0.03 for p in calibrate.report(z, accepted, temps, biases)["positions"])


def test_calibration_with_a_bias_fixes_a_shift_that_temperature_cannot():
    """Confidences shifted (true logit = z - 1.5): temperature alone leaves a large ECE, the
    bias removes it, and the calibrated confidences keep their spread (the scheduler needs it)."""
    rng = np.random.default_rng(1)
    n, slots = 6000, 3
    z = rng.normal(0.5, 1.5, (n, slots))
    accepted = np.cumprod(rng.random((n, slots)) < calibrate.sigmoid(z - 1.5), axis=1).sum(1)
    t_only = calibrate.report(z, accepted, calibrate.fit_temperatures(z, accepted))
    temps, biases = calibrate.fit_calibration(z, accepted)
    rep = calibrate.report(z, accepted, temps, biases)
    assert t_only["positions"][0]["ece_after"] > 0.05
    assert all(p["ece_after"] < 0.02 for p in rep["positions"])
    assert -2.0 < biases[0] < -1.0 and 0.7 < temps[0] < 1.4
    a1 = calibrate.survival(z, temps, biases)[:, 0]
    assert np.percentile(a1, 90) - np.percentile(a1, 10) > 0.4
    assert rep["biases"] == [float(b) for b in biases]


def test_auroc_and_ece_reference_values():
    assert calibrate.auroc(np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1])) == 0.75
    assert calibrate.ece(np.array([0.2, 0.2, 0.9]), np.array([0.0, 1.0, 1.0])) == pytest.approx((2 * 0.3 + 0.1) / 3)


def test_onnx_round_matches_pytorch_at_long_context(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    from dspark_export.drafter.onnx_export import export_onnx, reference_round

    model = _model()
    path = tmp_path / "d.onnx"
    export_onnx(model, path)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    total = 900
    feats = torch.from_numpy(rng.standard_normal((total, CFG.feature_dim)).astype(np.float32))
    past = {f"past_{kv}.{i}": np.zeros((2, 0, 8), np.float32) for i in range(2) for kv in ("key", "value")}
    n, checked = 0, 0
    steps = [700] + [int(x) for x in rng.integers(1, 5, 60)]
    for m in steps:
        if n + m > total:
            break
        anchor = int(rng.integers(0, V))
        slots = 4 if m % 2 else 3
        out = sess.run(None, {"features": feats[n:n + m].numpy(), "anchor_embedding": model.embed[anchor][None].numpy(),
                              "block_positions": np.arange(n + m, n + m + slots, dtype=np.int64), **past})
        n += m
        past = {f"past_{kv}.{i}": out[2 + 2 * i + (kv == "value")] for i in range(2) for kv in ("key", "value")}
        if checked < 6 or n > total - 10:
            ref_l, ref_h = reference_round(model, feats[:n], anchor, n, slots)
            assert np.abs(out[0] - ref_l).max() < 1e-3, f"round at context {n}"
            # One position off must be visible: the check can fail.
            off_l, _ = reference_round(model, feats[:n - 1], anchor, n - 1, slots)
            assert np.abs(out[0] - off_l).max() > 1e-3
            checked += 1
    assert n > 700 and past["past_key.0"].shape[1] == n


def test_train_and_install_write_a_complete_drafter(tiny_with_drafter):
    from dspark_edge.manifest import read_manifest, verify_files

    engine, weights, msgs = tiny_with_drafter
    assert any("ETA" in m for m in msgs)  # progress on long work
    assert any(m.strip().startswith("text shard 1/") for m in msgs)
    meta = json.loads((weights / "drafter.json").read_text())
    assert "teacher-forced tokens" in meta["training"]["data"] and "fingerprint" in meta["training"]["data"]
    # 4 asked; the tiny target's 512-token context drops those whose prompt and answer do not fit
    assert re.search(r"answers to [1-4] copy tasks", meta["training"]["data"])
    assert any(m.strip().startswith("copy data shard 1/1") for m in msgs)
    rep = json.loads((weights / "calibration.json").read_text())
    assert len(rep["temperatures"]) == 3 and len(rep["positions"]) == 3 and len(rep["biases"]) == 3
    assert (weights / "reliability.png").stat().st_size > 1000
    m = read_manifest(engine)
    assert m.drafter is not None and m.drafter.slots == 3 and len(m.drafter.biases) == 3
    assert m.widths("drafter", "fp32") == (2, 4) and m.widths("drafter", "int8") == (2, 4)
    assert m.widths("drafter", "fp16") == (2, 4)
    assert {v.precision: v.device for v in m.variants_for("drafter")} == {"fp32": "any", "int8": "any", "fp16": "gpu"}
    validation = json.loads(m.drafter.provenance["validation"])
    assert validation["fp16"]["max_abs_logit_diff"] < 0.05
    assert validation["fp32"]["rounds"] >= 3 and validation["fp32"]["top1_agreement"] == 1.0
    assert "/fc/MatMul" in validation["int8"]["fp32_matmuls"]
    verify_files(m, engine)
    assert not [p for p in engine.iterdir() if p.name.startswith(".")]  # no staging left behind


def test_resume_after_finish_does_not_retrain(tiny_with_drafter, tiny_hf):
    from dspark_export.drafter.build import TrainDrafterOptions, train_drafter

    engine, weights, _ = tiny_with_drafter
    msgs = []
    train_drafter(TrainDrafterOptions(
        target_engine=engine, output=weights, work=weights.parent / "work", source=str(tiny_hf), prompts=10,
        max_new_tokens=24, text_tokens=300, copy_prompts=4, layers=1, slots=3, draft_vocab=200, markov_rank=8,
        steps=8, seqs_per_step=4, anchors=6), progress=msgs.append)
    assert any("resumed at step 8" in m for m in msgs)
    assert not any("text shard" in m or "copy data shard" in m for m in msgs)  # the shards were kept
    assert not any(m.strip().startswith("step ") for m in msgs)


def test_int8_drafter_keeps_the_feature_projection_and_last_layer_in_fp32(tiny_with_drafter):
    """Per-tensor activation quantization of the target's hidden states (outlier channels)
    wipes the other channels out; those MatMuls must stay FP32, the rest be quantized."""
    import onnx

    engine, _, _ = tiny_with_drafter
    (graph,) = engine.glob("drafter-*/int8/model.onnx")
    nodes = onnx.load(str(graph)).graph.node
    float_mm = {n.name for n in nodes if n.op_type == "MatMul"}
    assert "/fc/MatMul" in float_mm and "/layers.0/down/MatMul" in float_mm  # the tiny drafter has one layer
    assert any(n.op_type in ("MatMulInteger", "DynamicQuantizeMatMul") for n in nodes)  # the rest is INT8
    # The LM head rows too: an initializer the quantizer made int8, no FP32 copy left anywhere.
    model = onnx.load(str(graph))
    types = {t.name: t.data_type for t in model.graph.initializer}
    assert types.get("head_t_quantized") == onnx.TensorProto.INT8 and "head_t" not in types, sorted(types)
    # The only 2-D FP32 constants are the rotary rotation ([head_dim, head_dim] of ±1 and 0).
    consts = [a.t for n in model.graph.node if n.op_type == "Constant" for a in n.attribute
              if len(a.t.dims) == 2 and a.t.data_type == onnx.TensorProto.FLOAT]
    from dspark_edge.manifest import read_manifest
    head_dim = read_manifest(engine).drafter.head_dim
    assert consts and all(list(t.dims) == [head_dim] * 2 for t in consts), [list(t.dims) for t in consts]
    assert all(set(np.unique(onnx.numpy_helper.to_array(t))) == {-1.0, 0.0, 1.0} for t in consts)


@pytest.mark.parametrize("precision", ["fp32", "int8", "fp16"])
def test_dspark_speculation_is_exact_greedy(tiny_with_drafter, precision):
    import dspark_edge

    engine, _, _ = tiny_with_drafter
    plain = dspark_edge.load(engine, "fp32")
    spec = dspark_edge.load(engine, "fp32", drafter=f"dspark:{precision}", scheduler=False)
    for prompt in ["The quick brown fox", "def add(a, b):", "Speculative decoding"]:
        a = plain.generate(prompt, max_new_tokens=40, ignore_eos=True)
        b = spec.generate(prompt, max_new_tokens=40, ignore_eos=True, min_survival=0.0)
        assert b.token_ids == a.token_ids
        assert b.stats.drafter == "dspark" and b.stats.draft_n > 0 and b.stats.drafter_disabled is None
    # Sampling runs through the drafter's q and stays reproducible for a seed.
    s1 = spec.generate("The quick", max_new_tokens=30, temperature=0.8, seed=3, ignore_eos=True)
    s2 = spec.generate("The quick", max_new_tokens=30, temperature=0.8, seed=3, ignore_eos=True)
    assert s1.token_ids == s2.token_ids and len(s1.token_ids) == 30


def test_only_the_drafter_session_stops_spinning(tiny_with_drafter):
    """The target keeps spinning threads (waking them per operator costs ~20 % a pass); the
    drafter's must not spin after its short pass, or they take the target's cores."""
    import dspark_edge

    def spinning(session):
        return session.get_session_options().get_session_config_entry("session.intra_op.allow_spinning")

    engine, _, _ = tiny_with_drafter
    spec = dspark_edge.load(engine, "fp32", drafter="dspark", scheduler=False)
    assert spinning(spec.target.session.session) == "1" and spinning(spec.drafter.session) == "0"
    spec.close()


def _cycling(inner):
    """The real scheduler, but the verify width switches every round."""
    import itertools

    from forced_width import ForcedWidthScheduler

    rounds = itertools.count(1)

    def width(confidence):
        widths = [w for w in (4, 1, 2, 3) if w - 1 <= len(confidence)]
        return widths[next(rounds) % len(widths)]

    return ForcedWidthScheduler(inner, width, "test: cycling")


def test_exact_while_the_scheduler_switches_variants_every_round(tiny_with_drafter):
    import dspark_edge
    from dspark_edge.telemetry import FakeReader

    engine, _, _ = tiny_with_drafter
    plain = dspark_edge.load(engine, "fp32")
    spec = dspark_edge.load(engine, "fp32", drafter="dspark", telemetry=FakeReader())
    assert spec.scheduler is not None and spec.profile_status in ("missing", "stale", "ok", "throttled")
    spec.scheduler = _cycling(spec.scheduler)
    for prompt in ["The quick brown fox", "def add(a, b):"]:
        a = plain.generate(prompt, max_new_tokens=48, ignore_eos=True)
        b = spec.generate(prompt, max_new_tokens=48, ignore_eos=True)
        assert b.token_ids == a.token_ids
        assert len(b.stats.widths) >= 3  # it really switched
    spec.close()


def test_scheduler_unloads_the_drafter_under_memory_pressure(tiny_with_drafter):
    import dspark_edge
    from dspark_edge.telemetry import FakeReader

    engine, _, _ = tiny_with_drafter
    reader = FakeReader()
    spec = dspark_edge.load(engine, "fp32", drafter="dspark", telemetry=reader)
    plain = dspark_edge.load(engine, "fp32")
    reader.set(mem_available_mb=100.0)
    spec._sampler.latest = reader.read()
    r = spec.generate("The quick brown fox", max_new_tokens=20, ignore_eos=True)
    assert "memory" in (r.stats.drafter_disabled or "") and spec.drafter is None
    assert r.token_ids == plain.generate("The quick brown fox", max_new_tokens=20, ignore_eos=True).token_ids
    reader.set(mem_available_mb=4000.0)
    spec._sampler.latest = reader.read()
    r2 = spec.generate("The quick brown fox", max_new_tokens=20, ignore_eos=True)
    assert spec.drafter is not None and r2.stats.drafter_disabled is None
    spec.close()


def test_drafter_refuses_a_foreign_target(tiny_with_drafter, tiny_hf, tmp_path):
    from dspark_edge.errors import ExportError
    from dspark_export.drafter.install import install_drafter

    engine, weights, _ = tiny_with_drafter
    other = tmp_path / "w"
    shutil.copytree(weights, other)
    meta = json.loads((other / "drafter.json").read_text())
    meta["target"]["source_sha256"] = "0" * 64
    (other / "drafter.json").write_text(json.dumps(meta))
    before = (engine / "manifest.json").read_bytes()
    with pytest.raises(ExportError, match="trained against a target"):
        install_drafter(engine, other, blocks=(2, 4), source=str(tiny_hf), progress=lambda m: None)
    assert (engine / "manifest.json").read_bytes() == before


def test_training_prompts_are_disjoint_from_the_benchmark():
    from pathlib import Path

    from dspark_export.drafter.prompts import training_prompts

    bench = Path(__file__).resolve().parent.parent / "dspark_edge" / "data" / "prompts.jsonl"
    bench_texts = {m["content"] for line in bench.read_text().splitlines() if line.strip()
                   for m in json.loads(line)["messages"]}
    train_texts = {m["content"] for r in training_prompts() for m in r["messages"]}
    assert len(train_texts) > 500 and not (bench_texts & train_texts)


def test_sampling_follows_the_target_with_the_dspark_drafter_and_switching_widths(tiny_with_drafter):
    import dspark_edge
    from dspark_edge.telemetry import FakeReader
    from test_speculative_tiny import _chi2_rejects, _exact_joint

    engine, _, _ = tiny_with_drafter
    spec = dspark_edge.load(engine, "fp32", drafter="dspark", telemetry=FakeReader())
    spec.scheduler = _cycling(spec.scheduler)
    prompt = "The quick brown fox The quick brown"
    exact = _exact_joint(spec, spec.encode_prompt(prompt), top_k=4)
    assert not _chi2_rejects(spec, prompt, exact, 3000, 4)
    spec.close()


def test_coupled_sampling_with_the_dspark_drafter_equals_plain(tiny_with_drafter):
    """sampling="coupled": the DSpark drafter picks each draft with the target's noise for that
    position, and the answer is plain decoding's for the seed while the widths switch."""
    import dspark_edge
    from dspark_edge.telemetry import FakeReader

    engine, _, _ = tiny_with_drafter
    plain = dspark_edge.load(engine, "fp32")
    spec = dspark_edge.load(engine, "fp32", drafter="dspark", telemetry=FakeReader())
    spec.scheduler = _cycling(spec.scheduler)
    for seed in range(3):
        kw = dict(max_new_tokens=20, temperature=0.8, top_k=8, seed=seed, ignore_eos=True, sampling="coupled")
        ref = plain.generate("The quick brown fox The quick brown", **kw)
        r = spec.generate("The quick brown fox The quick brown", **kw)
        assert r.token_ids == ref.token_ids and r.stats.draft_n > 0
    spec.close()


def test_cli_generates_with_the_dspark_drafter_and_scheduler_knobs(tiny_with_drafter, capsys):
    from dspark_edge.cli import main

    engine, _, _ = tiny_with_drafter
    rc = main(["generate", "--engine", str(engine), "--drafter", "dspark", "--raw", "The quick", "--max-new-tokens",
               "8", "--json", "--sched", "hot_c=70", "--sched", "probe_every=4"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["stats"]["drafter"] == "dspark" and len(out["token_ids"]) == 8
    assert main(["generate", "--engine", str(engine), "--drafter", "dspark", "--raw", "x", "--sched", "hot=1"]) == 2
    assert "KEY one of" in capsys.readouterr().err
    assert main(["inspect", "--engine", str(engine)]) == 0
    text = capsys.readouterr().out
    assert "drafter    dspark" in text and "telemetry" in text and "profile" in text


def test_held_out_split_is_stable_when_data_grows():
    """More prompts later (an extended data step) must not move held-out sequences into training."""
    from dspark_export.drafter.train import split

    def fake(n):
        return Sequences(np.zeros(n, np.int32), np.arange(n + 1, dtype=np.int64), np.zeros(n, np.int32),
                         np.zeros((n, 1), np.float16), np.zeros((n, 1), np.int32), np.zeros((n, 1), np.float16))

    tr_small, val_small = split(fake(512))
    tr_big, val_big = split(fake(920))
    assert set(val_small) <= set(val_big) and not set(val_big) & set(tr_small)
    assert set(tr_big) | set(val_big) == set(range(920)) and not set(tr_big) & set(val_big)
    assert 0.03 < len(val_big) / 920 < 0.09
    assert len(split(fake(3))[1]) >= 1


def test_text_ids_always_train_and_get_their_share():
    from dspark_export.drafter.train import sampling_weights, split

    n = 900
    data = Sequences(np.zeros(n, np.int32), np.arange(n + 1, dtype=np.int64), np.zeros(n, np.int32),
                     np.zeros((n, 1), np.float16), np.zeros((n, 1), np.int32), np.zeros((n, 1), np.float16))
    tr, val = split(data, answers=600)
    assert val.max() < 600 and set(range(600, n)) <= set(tr)
    assert set(tr) | set(val) == set(range(n)) and not set(tr) & set(val)
    assert np.array_equal(val, split(data, answers=600)[1])  # answers keep their held-out draw
    w = sampling_weights(tr, 600, 0.4)
    assert abs(w.sum() - 1) < 1e-9 and abs(w[tr >= 600].sum() - 0.4) < 1e-9
    assert sampling_weights(tr[tr < 600], 600, 0.4) is None  # no text: uniform


def _fake_site(root, bodies):
    for name, body in bodies.items():
        d = root / f"{name}-1.0.dist-info"
        d.mkdir(parents=True)
        (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\n\n{body}", encoding="utf-8")
    return root


def test_package_documents_read_readmes_and_modules_in_a_fixed_interleaved_order(tmp_path):
    from dspark_export.drafter.text import MIN_CHARS, fingerprint, package_documents, prompt_for

    long = "word " * MIN_CHARS
    site = _fake_site(tmp_path / "site", {"alpha": long, "beta": "too short", "dspark_edge": long, "gamma": long})
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "mod_a.py").write_text("x = 1\n" * MIN_CHARS)
    (lib / "tiny.py").write_text("x = 1\n")
    docs = package_documents([site], lib)
    assert [d.name for d in docs] == ["prose:alpha", "code:mod_a", "prose:gamma"]  # this project's own skipped
    assert docs[0].text.startswith("word word")  # the body, not the headers
    assert "alpha" in prompt_for(docs[0])[0]["content"] and "mod_a" in prompt_for(docs[1])[0]["content"]
    again = package_documents([site], lib)
    assert fingerprint(again) == fingerprint(docs)
    (lib / "mod_a.py").write_text("y = 2\n" * MIN_CHARS)
    assert fingerprint(package_documents([site], lib)) != fingerprint(docs)


def test_text_windows_cap_each_document_and_stop_at_the_budget():
    from dspark_export.drafter.text import Document, text_sequences

    class Tok:
        def encode(self, text):
            return [len(w) for w in text.split()]

        def encode_chat(self, messages):
            return [99, 98]

    docs = [Document("prose:a", "w " * 5000), Document("code:b", "ww " * 300)]
    seqs = text_sequences(Tok(), docs, window=100, max_tokens=10_000)
    assert [len(a) for _, a in seqs] == [100] * 8 + [100, 100, 100]  # a: 8 windows at most; b: 300 tokens
    assert all(p == [99, 98] for p, _ in seqs)
    assert sum(len(a) for _, a in text_sequences(Tok(), docs, window=100, max_tokens=250)) == 300


def test_recorded_held_out_set_is_kept_when_data_grows(tmp_path):
    """A run's held-out answers are recorded; an extended run keeps them (whatever rule chose
    them) and holds out new answers by the stable draw; text never is held out."""
    from dspark_export.drafter.train import recorded_split, split

    def fake(n):
        return Sequences(np.zeros(n, np.int32), np.arange(n + 1, dtype=np.int64), np.zeros(n, np.int32),
                         np.zeros((n, 1), np.float16), np.zeros((n, 1), np.int32), np.zeros((n, 1), np.float16))

    tr, val = recorded_split(fake(300), tmp_path, 300)
    assert np.array_equal(val, split(fake(300))[1]) and (tmp_path / "held_out.json").is_file()
    (tmp_path / "held_out.json").write_text(json.dumps({"answers": 300, "held_out": [3, 5, 250]}))
    tr, val = recorded_split(fake(700), tmp_path, 600)  # 300 more answers, then 100 text windows
    assert {3, 5, 250} == set(val[val < 300])
    assert set(val[val >= 300]) == set(split(fake(600))[1][split(fake(600))[1] >= 300])
    assert set(range(600, 700)) <= set(tr) and not set(tr) & set(val) and len(tr) + len(val) == 700


def test_drafter_info_checks_its_calibration():
    import dataclasses

    from dspark_edge.manifest import DrafterInfo

    base = DrafterInfo(kind="dspark", slots=3, draft_vocab=10, markov_rank=2, num_layers=1, num_kv_heads=1,
                       head_dim=4, feature_layers=(1,), temperatures=(1.0, 1.0, 1.0), tables="t.npz",
                       embedding="e.npy", provenance={})
    assert base.biases == ()  # drafters calibrated by temperature alone still load
    assert dataclasses.replace(base, biases=(0.1, -0.2, 0.0)).biases[1] == -0.2
    for bad in [{"biases": (0.1,)}, {"biases": (0.0, float("nan"), 0.0)}, {"temperatures": (1.0, 0.0, 1.0)},
                {"temperatures": (1.0, float("inf"), 1.0)}]:
        with pytest.raises(ValueError):
            dataclasses.replace(base, **bad)


def test_text_shards_made_from_other_windows_are_refused(tmp_path):
    from dspark_edge.errors import ExportError
    from dspark_export.drafter.text import build_text_shards

    assert build_text_shards(None, [], tmp_path) == []  # records the (empty) window set
    with pytest.raises(ExportError, match="delete"):
        build_text_shards(None, [([1, 2], [3, 4])], tmp_path)
    assert not list(tmp_path.glob("text-*.npz"))


def test_copy_prompts_carry_their_text_and_skip_what_is_not_prose():
    from dspark_export.drafter.prompts import code_snippets, copy_prompts, prose_paragraphs
    from dspark_export.drafter.text import Document

    para = ("The river runs through the valley and feeds the farms on both of its banks, which is why the "
            "villages grew along it. Every spring the water rises, and the farmers plant their fields only "
            "after the flood has passed, so the soil is rich and the harvest is large.")
    readme = "\n\n".join(["# Title", para, "- a list item " * 20, "```\ncode = 1\n```", "Short line."])
    assert prose_paragraphs(readme) == [para]
    source = ("def small(x):\n    return x\n\n"
              "def helper(items):\n    out = []\n    for item in items:\n        if item:\n"
              "            out.append(item)\n    return out\n\n"
              "def _private(a):\n    b = a\n    c = b\n    d = c\n    return d\n")
    assert code_snippets(source) == [source.split("\n\n")[1]]
    assert code_snippets("def broken(:\n") == []
    docs = [Document("prose:pkg", readme), Document("code:mod", f'"""{para}"""\n\n' + source)]
    prompts = copy_prompts(docs, 4)
    assert prompts == copy_prompts(docs, 4)  # a fixed order
    texts = [r["messages"][-1]["content"] for r in prompts]
    # one code snippet exists and two paragraphs (README + module docstring): 1 code, then prose
    assert sum(source.split("\n\n")[1] in t for t in texts) == 1
    assert sum(para in t for t in texts) == 2 and len(prompts) == 3
    assert {r["category"] for r in prompts} == {"summ", "code"}


def test_copy_prompts_from_this_machine_are_disjoint_from_the_benchmark():
    from pathlib import Path

    from dspark_export.drafter.prompts import copy_prompts
    from dspark_export.drafter.text import package_documents

    bench = Path(__file__).resolve().parent.parent / "dspark_edge" / "data" / "prompts.jsonl"
    bench_texts = {m["content"] for line in bench.read_text().splitlines() if line.strip()
                   for m in json.loads(line)["messages"]}
    prompts = copy_prompts(package_documents(), 64)
    assert len(prompts) == 64
    assert not bench_texts & {m["content"] for r in prompts for m in r["messages"]}


def test_shards_from_other_inputs_are_refused(tmp_path):
    from dspark_edge.errors import ExportError
    from dspark_export.drafter.data import check_digest

    check_digest(tmp_path, "inputs.sha256", "abc", "delete it")
    check_digest(tmp_path, "inputs.sha256", "abc", "delete it")  # the same inputs: fine
    with pytest.raises(ExportError, match="other inputs; delete it"):
        check_digest(tmp_path, "inputs.sha256", "abd", "delete it")


def test_growing_the_prompt_count_completes_a_short_last_shard(tmp_path, monkeypatch):
    """A run with --prompts 5 writes a last shard of 1 answer (4 a shard); asked for 7 later, that
    shard is rewritten with 3 answers, so no prompt between the two counts is skipped, and the
    full shard before it is kept."""
    from dspark_export.drafter import data

    written: list[tuple[str, int]] = []

    def fake_answers(model, prompt_ids, max_new_tokens, eos_id, pad_id, batch):
        return [[7, 8] for _ in prompt_ids]

    def fake_write(path, decoder, seqs, top_k):
        written.append((path.name, len(seqs)))
        np.savez(path, prompt_lens=np.asarray([len(p) for p, _ in seqs], dtype=np.int32))

    class Tok:
        def encode_chat(self, messages):
            return [1, 2, len(messages[0]["content"])]

    monkeypatch.setattr(data, "generate_answers", fake_answers)
    monkeypatch.setattr(data, "write_shard", fake_write)
    prompts = [{"messages": [{"role": "user", "content": "x" * (i + 1)}]} for i in range(7)]
    paths = data.build_shards(None, None, Tok(), prompts[:5], tmp_path, 0, 0, per_shard=4)
    assert written == [("shard-00000.npz", 4), ("shard-00001.npz", 1)]
    paths = data.build_shards(None, None, Tok(), prompts, tmp_path, 0, 0, per_shard=4)
    assert written[2:] == [("shard-00001.npz", 3)]
    assert data.count_sequences(paths) == 7


@pytest.mark.parametrize("bf16", [False, True])
def test_a_resumed_training_run_continues_bit_for_bit(tmp_path, bf16):
    """Six steps straight, and three steps then a resumed run to six from the checkpoint, give
    identical weights (also under bfloat16 autocast)."""
    from dspark_export.drafter.train import TrainOptions, train

    data = _data(n=6)
    opts = TrainOptions(steps=6, seqs_per_step=2, anchors=3, checkpoint_every=3, validate_every=6, bf16=bf16)
    straight, resumed = _model(1).train(), _model(1).train()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    train(straight, data, np.arange(5), np.arange(5, 6), tmp_path / "a", opts)
    train(resumed, data, np.arange(5), np.arange(5, 6), tmp_path / "b", dataclasses.replace(opts, steps=3))
    again = _model(1).train()  # a fresh process: the model as built, then the checkpoint
    out = train(again, data, np.arange(5), np.arange(5, 6), tmp_path / "b", opts)
    assert out["steps"] == 6
    for (name, a), b in zip(straight.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name
    assert not torch.equal(straight.state_dict()["fc.weight"], _model(1).state_dict()["fc.weight"])  # it trained


def test_a_run_can_start_from_a_previous_drafter(tiny_with_drafter, tiny_hf, tmp_path):
    """--init-from: the new run starts from the folder's weights and draft vocabulary (with a
    zero learning rate it ends exactly where it started)."""
    from dspark_edge.errors import ExportError
    from dspark_export.drafter.build import TrainDrafterOptions, train_drafter

    engine, weights, _ = tiny_with_drafter
    msgs: list[str] = []
    work = tmp_path / "work"  # the fixture's data and vocabulary, without its checkpoint
    shutil.copytree(weights.parent / "work", work, ignore=shutil.ignore_patterns("checkpoint.pt", "train.log"))
    out = train_drafter(TrainDrafterOptions(
        target_engine=engine, output=tmp_path / "next", work=work, source=str(tiny_hf), prompts=10,
        max_new_tokens=24, text_tokens=300, copy_prompts=4, layers=2, slots=3, draft_vocab=150, markov_rank=8,
        steps=10, seqs_per_step=4, anchors=6, lr=0.0, init_from=weights), progress=msgs.append)
    assert any("starting from" in m for m in msgs)
    before, after = np.load(weights / "weights.npz"), np.load(out / "weights.npz")
    assert sorted(before.files) == sorted(after.files)
    for k in before.files:
        assert np.array_equal(before[k], after[k]), k
    with pytest.raises(ExportError, match="another draft vocabulary"):
        train_drafter(TrainDrafterOptions(
            target_engine=engine, output=tmp_path / "x", work=tmp_path / "w", source=str(tiny_hf), prompts=10,
            max_new_tokens=24, text_tokens=300, copy_prompts=4, slots=3, draft_vocab=150, markov_rank=8,
            steps=2, seqs_per_step=4, anchors=6), progress=msgs.append)  # this work folder's own vocabulary ...
        train_drafter(TrainDrafterOptions(
            target_engine=engine, output=tmp_path / "x", work=tmp_path / "w", source=str(tiny_hf), prompts=10,
            max_new_tokens=24, text_tokens=300, copy_prompts=4, slots=3, steps=2, seqs_per_step=4, anchors=6,
            init_from=weights), progress=msgs.append)  # ... is not the folder's


def test_dspark_block_choice_weighs_drafting_time_against_the_yardstick(tiny_with_drafter):
    """With several blocks and the scheduler's yardstick, a round runs the block worth most:
    the wide one when its extra drafts pay for their drafting time, the narrow one when the
    wide widths cost too much or the later slots' confidences are low; the widest still runs
    every BLOCK_REFRESH rounds. Without a yardstick, the block that holds the asked drafts."""
    import dspark_edge
    from dspark_edge.drafters.dspark import BLOCK_REFRESH, DSparkDrafter
    from dspark_edge.manifest import read_manifest
    from dspark_edge.widths import Yardstick

    engine, _, _ = tiny_with_drafter
    d = DSparkDrafter(engine, read_manifest(engine), "fp32")
    assert d.blocks == (2, 4)
    assert d._choose_block(3, None) == 4 and d._choose_block(1, None) == 2
    flat = Yardstick(lambda w: 10.0, (1, 2, 3, 4))
    steep = Yardstick(lambda w: 10.0 if w <= 2 else 1000.0, (1, 2, 3, 4))
    assert d._choose_block(3, flat) == 4  # untimed: each block runs twice first
    for block, conf in ((4, [0.9, 0.9, 0.9]), (4, [0.9, 0.9, 0.9]), (2, [0.9]), (2, [0.9])):
        d._note_round(block, 2.0 if block == 4 else 1.0, np.array(conf), flat)
    assert d._choose_block(3, flat) == 4
    assert d._choose_block(1, flat) == 2  # one draft asked: the narrow block holds it
    d._note_round(4, 2.0, np.array([0.9, 0.9, 0.9]), steep)
    picks = []
    for _ in range(2 * BLOCK_REFRESH):
        picks.append(d._choose_block(3, steep))
        d._note_round(picks[-1], 2.0 if picks[-1] == 4 else 1.0, np.full(picks[-1] - 1, 0.9), steep)
    assert [i for i, b in enumerate(picks) if b == 4] == [BLOCK_REFRESH - 1, 2 * BLOCK_REFRESH - 1]  # the refresh
    for _ in range(30):  # the later slots' confidences fall: their drafting time no longer pays
        d._note_round(4, 2.0, np.array([0.05, 0.05, 0.05]), flat)
    assert d._choose_block(3, flat) == 2

    # In a generation with the scheduler, both blocks run and are timed.
    with dspark_edge.load(engine, "fp32", drafter="dspark") as pipe:
        pipe.generate([{"role": "user", "content": "Count: one two three four five six"}], max_new_tokens=24)
        assert pipe.drafter._block_runs.get(2, 0) >= 2 and pipe.drafter._block_runs.get(4, 0) >= 2
