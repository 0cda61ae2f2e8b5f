"""The drafter campaign over several runs: `train-drafter --data FILE` trains on every answer the
data engine recorded (generating none), its feature shards grow with the file and refuse other
answers, and a run started from a previous drafter carries that drafter's learning curve on."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from dspark_edge.errors import ExportError
from dspark_edge.manifest import read_manifest
from dspark_export.answers import load_answers
from dspark_export.data_engine import DataOptions, run

MAX_NEW = 16


@pytest.fixture(scope="module")
def recorded(tiny_engine, tmp_path_factory):
    """Answers files of 10 and then 14 of the tiny target's answers, from one data-engine work folder."""
    root = tmp_path_factory.mktemp("campaign")
    base = dict(target_engine=tiny_engine, work=root / "data", prompts=14, copy_prompts=0, max_new_tokens=MAX_NEW,
                batch=4, per_shard=5)
    run(DataOptions(answers=10, output=root / "a10.npz", **base), progress=lambda s: None)
    run(DataOptions(answers=14, output=root / "a14.npz", **base), progress=lambda s: None)
    return root / "a10.npz", root / "a14.npz"


def _pairs(engine, path):
    answers = load_answers(path, read_manifest(engine), MAX_NEW)
    return [answers.pair(i) for i in range(len(answers))]


def _decoder(engine):
    from dspark_edge.decoder import DecoderModel

    return DecoderModel(read_manifest(engine), engine, "fp32")


def test_feature_shards_grow_with_the_answers_and_refuse_others(tiny_engine, recorded, tmp_path):
    from dspark_export.drafter.data import answer_feature_shards, load_shards

    small, large = (_pairs(tiny_engine, p) for p in recorded)
    assert large[:len(small)] == small  # the data engine appends: the first answers stay in place
    folder = tmp_path / "features"
    answer_feature_shards(_decoder(tiny_engine), small, folder, per_shard=4)  # 4 + 4 + 2
    first = (folder / "shard-00000.npz").read_bytes()
    dec = _decoder(tiny_engine)
    paths = answer_feature_shards(dec, large, folder, per_shard=4)  # the short last shard redone, one added
    assert len(paths) == 4 and (folder / "shard-00000.npz").read_bytes() == first
    data = load_shards(paths)
    assert len(data) == len(large)
    for i, (p, a) in enumerate(large):
        lo, hi = data.span(i)
        assert data.tokens[lo:hi].tolist() == p + a and int(data.prompt_lens[i]) == len(p)
    assert data.aux.shape[0] == data.tokens.size
    other = [(p, a[:-1] + [(a[-1] + 1) % 100]) if i == 1 else (p, a) for i, (p, a) in enumerate(large)]
    with pytest.raises(ExportError, match="other answers than the answers file"):
        answer_feature_shards(dec, other, folder, per_shard=4)


def _train(engine, tiny_hf, data, work, output, **kw):
    from dspark_export.drafter.build import TrainDrafterOptions, train_drafter

    msgs: list[str] = []
    opts = dict(target_engine=engine, output=output, work=work, source=str(tiny_hf), data=data, prompts=1,
                max_new_tokens=MAX_NEW, text_tokens=0, copy_prompts=0, layers=1, slots=3, draft_vocab=150,
                markov_rank=8, steps=4, seqs_per_step=4, anchors=6)
    return train_drafter(TrainDrafterOptions(**{**opts, **kw}), progress=msgs.append), msgs


def _curve(folder):
    return [json.loads(line) for line in (folder / "learning_curve.jsonl").read_text().splitlines()]


def test_training_on_recorded_answers_and_a_campaign_curve(tiny_engine, tiny_hf, recorded, tmp_path):
    small, large = recorded
    first, msgs = _train(tiny_engine, tiny_hf, small, tmp_path / "w1", tmp_path / "d1")
    assert any("features for the 10 answers" in m for m in msgs)
    assert not any("target answers" in m for m in msgs)  # nothing was generated
    assert any("held-out answers in" in m for m in msgs) and any("fitting the confidence" in m for m in msgs)
    meta = json.loads((first / "drafter.json").read_text())
    assert meta["training"]["sequences"] == 10 and "a10.npz" in meta["training"]["data"]
    curve = _curve(first)
    assert [r["run"] for r in curve] == [1] and curve[-1]["steps"] == 4 and curve[-1]["sequences_drawn"] == 16
    assert curve[-1]["train_answers"] + curve[-1]["held_out_answers"] == 10
    assert curve[-1]["tau"] == pytest.approx(meta["training"]["validation"][-1]["tau"], abs=1e-4)
    # The next run: more answers, started from the first drafter; its curve goes on from the first's.
    second, _ = _train(tiny_engine, tiny_hf, large, tmp_path / "w2", tmp_path / "d2", steps=3, init_from=first)
    curve2 = _curve(second)
    assert curve2[:len(curve)] == curve
    assert curve2[-1]["run"] == 2 and curve2[-1]["run_step"] == 3 and curve2[-1]["steps"] == 7
    assert curve2[-1]["sequences_drawn"] == 28
    assert curve2[-1]["train_answers"] + curve2[-1]["held_out_answers"] == 14
    assert np.array_equal(np.load(first / "weights.npz")["vocab_ids"], np.load(second / "weights.npz")["vocab_ids"])
    # Extended in its work folder after it overwrote its start: the curve it started from is kept.
    third, _ = _train(tiny_engine, tiny_hf, large, tmp_path / "w2", first, steps=5, init_from=first)
    curve3 = _curve(third)
    assert curve3[:len(curve)] == curve and [r["run"] for r in curve3[len(curve):]] == [2, 2]
    assert curve3[-1]["steps"] == 9 and curve3[-1]["run_step"] == 5


def test_a_run_on_the_new_answers_only_keeps_the_held_out_set(tiny_engine, tiny_hf, recorded, tmp_path):
    """--data-from N: features for answers N… and the held-out ones only; the held-out set is the
    one a run over every answer validates on."""
    from dspark_export.drafter.data import count_sequences
    from dspark_export.drafter.train import HELD_OUT

    small, large = recorded
    first, _ = _train(tiny_engine, tiny_hf, small, tmp_path / "w1", tmp_path / "d1")
    full, _ = _train(tiny_engine, tiny_hf, large, tmp_path / "wf", tmp_path / "df", steps=2, init_from=first)
    new, msgs = _train(tiny_engine, tiny_hf, large, tmp_path / "wn", tmp_path / "dn", steps=2, init_from=first,
                       data_from=10)
    held = json.loads((tmp_path / "wf" / HELD_OUT).read_text())["held_out"]
    assert json.loads((tmp_path / "wn" / HELD_OUT).read_text())["held_out"] == held
    chosen = sorted(set(held) | set(range(10, 14)))
    assert any(f"answers 10–13 and the {len(held)} held-out" in m for m in msgs), msgs
    assert count_sequences(sorted((tmp_path / "wn" / "answers").glob("shard-*.npz"))) == len(chosen)
    last = _curve(new)[-1]
    assert last["held_out_answers"] == len(held) == _curve(full)[-1]["held_out_answers"]
    assert last["train_answers"] == len([i for i in range(10, 14) if i not in held])
    meta = json.loads((new / "drafter.json").read_text())
    assert "trained on those at 10–13" in json.dumps(meta, ensure_ascii=False)
    # bench/drafter_heldout.py reads the run back: its held-out answers, and with trained=True the
    # answers it trained on, as positions in the loaded shards (the chosen answers in file order).
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from drafter_heldout import campaign_sets

    data, sets = campaign_sets(tmp_path / "wn", trained=True)
    assert "trained" not in campaign_sets(tmp_path / "wn")[1]
    assert [chosen[i] for i in sets["all"]] == sorted(held)
    assert [chosen[i] for i in sets["trained"]] == [i for i in range(10, 14) if i not in held]
    pairs = _pairs(tiny_engine, large)
    for i in sets["trained"]:
        lo, hi = data.span(int(i))
        assert data.tokens[lo:hi].tolist() == sum(pairs[chosen[i]], [])
    for bad in (14, -1):
        with pytest.raises(ExportError, match="--data-from"):
            _train(tiny_engine, tiny_hf, large, tmp_path / "wb", tmp_path / "db", init_from=first, data_from=bad)
    with pytest.raises(ExportError, match="without --data"):
        _train(tiny_engine, tiny_hf, None, tmp_path / "wb", tmp_path / "db", data_from=3)


def test_a_slice_of_the_answers_draws_its_held_out_set_before_its_end(tiny_engine, tiny_hf, recorded, tmp_path):
    """--data-to M: features for answers N…M-1 and the held-out ones before M; the held-out set is
    the one a run over the first M answers validates on (the stable draw), so a later, larger
    slice keeps it."""
    from dspark_export.drafter.data import count_sequences
    from dspark_export.drafter.train import HELD_OUT, split

    small, large = recorded
    first, _ = _train(tiny_engine, tiny_hf, small, tmp_path / "w1", tmp_path / "d1")
    sliced, msgs = _train(tiny_engine, tiny_hf, large, tmp_path / "ws", tmp_path / "ds", steps=2, init_from=first,
                          data_from=4, data_to=12)
    held = json.loads((tmp_path / "ws" / HELD_OUT).read_text())["held_out"]
    assert held == split(None, answers=12)[1].tolist() and all(i < 12 for i in held)
    assert set(held) <= set(split(None, answers=14)[1].tolist())  # a larger slice keeps them held out
    assert any(f"answers 4–11 and the {len(held)} held-out answers before 12" in m for m in msgs), msgs
    chosen = sorted(set(held) | set(range(4, 12)))
    assert count_sequences(sorted((tmp_path / "ws" / "answers").glob("shard-*.npz"))) == len(chosen)
    assert _curve(sliced)[-1]["train_answers"] == len([i for i in range(4, 12) if i not in held])
    for kw, words in (({"data_from": 4, "data_to": 4}, "exceed --data-from"), ({"data_to": 15}, "holds 14 answers")):
        with pytest.raises(ExportError, match=words):
            _train(tiny_engine, tiny_hf, large, tmp_path / "wb", tmp_path / "db", init_from=first, **kw)
    with pytest.raises(ExportError, match="must come with --data"):
        _train(tiny_engine, tiny_hf, None, tmp_path / "wb", tmp_path / "db", data_to=3)


def test_data_and_answers_together_are_refused(tiny_engine, tmp_path):
    from dspark_export.drafter.build import TrainDrafterOptions

    with pytest.raises(ExportError, match="pass one of them"):
        TrainDrafterOptions(target_engine=tiny_engine, output=tmp_path / "o", work=tmp_path / "w",
                            data=tmp_path / "a.npz", answers=tmp_path / "b.npz")


def test_a_continuing_run_peaks_lower_unless_told(tiny_engine, tmp_path):
    """A new drafter peaks at NEW_LR, a run from a trained one (--init-from) at the lower
    CONTINUE_LR; --lr wins over both (0 included), and a negative one is refused with the fix."""
    from dspark_export.__main__ import build_parser
    from dspark_export.drafter.build import CONTINUE_LR, NEW_LR, TrainDrafterOptions

    assert CONTINUE_LR < NEW_LR
    base = {"target_engine": tiny_engine, "output": tmp_path / "o", "work": tmp_path / "w"}
    assert TrainDrafterOptions(**base).lr == NEW_LR
    assert TrainDrafterOptions(**base, init_from=tmp_path / "d").lr == CONTINUE_LR
    assert TrainDrafterOptions(**base, init_from=tmp_path / "d", lr=5e-4).lr == 5e-4
    assert TrainDrafterOptions(**base, init_from=tmp_path / "d", lr=0.0).lr == 0.0  # given, not defaulted
    for bad in (-1e-4, float("nan")):
        with pytest.raises(ExportError, match="--lr must be 0 or more"):
            TrainDrafterOptions(**base, lr=bad)
    args = build_parser().parse_args(["train-drafter", "--target", "e", "--output", "o"])
    assert args.lr is None  # left to the options, which know whether the run continues a drafter


def test_a_damaged_learning_curve_is_refused_with_the_fix(tmp_path):
    from dspark_export.drafter.build import write_learning_curve

    prior = tmp_path / "prior.jsonl"
    prior.write_text('{"run": 1, "steps": 4, "sequences_drawn": 16}\n{"run": 1, "st')
    with pytest.raises(ExportError, match="line 2 is not JSON"):
        write_learning_curve(tmp_path / "c.jsonl", prior, [], 4, 10, 2, "x")
    prior.write_text('{"run": 1, "steps": 4, "sequences_drawn": 16}\n')
    write_learning_curve(tmp_path / "c.jsonl", prior, [{"step": 2, "tau": 1.5, "reach": [0.5]}], 4, 10, 2, "x")
    rows = [json.loads(line) for line in (tmp_path / "c.jsonl").read_text().splitlines()]
    assert rows[-1]["run"] == 2 and rows[-1]["steps"] == 6 and rows[-1]["sequences_drawn"] == 24


CAMPAIGN = Path(__file__).resolve().parent.parent / "drafters" / "smollm2-135m-campaign"


@pytest.mark.slow
@pytest.mark.skipif(not (CAMPAIGN / "weights.npz").is_file(), reason="no campaign drafter is committed")
def test_the_committed_campaign_drafter_is_small_and_starts_the_next_run(default_engine):
    """The checkpoint the next session resumes the campaign from: its trainable weights fit the
    budget, it loads against the embedded default as --init-from does, and its learning curve
    is whole (steps increasing, the last τ the one its drafter.json reports)."""
    from dspark_export.drafter.build import read_init

    assert (CAMPAIGN / "weights.npz").stat().st_size <= 25 * 2**20
    cfg, weights = read_init(CAMPAIGN, default_engine, read_manifest(default_engine))
    assert weights["vocab_ids"].shape == (cfg.draft_vocab,)
    meta = json.loads((CAMPAIGN / "drafter.json").read_text())
    curve = _curve(CAMPAIGN)
    steps = [r["steps"] for r in curve]
    assert steps == sorted(set(steps)) and all(1.0 <= r["tau"] <= cfg.slots + 1 for r in curve)
    assert curve[-1]["tau"] == pytest.approx(meta["training"]["validation"][-1]["tau"], abs=1e-4)
    assert "--data" in meta["training"]["command"]


def test_feature_shards_are_taken_from_an_earlier_work_folder_made_by_this_engine(tiny_engine, recorded, tmp_path):
    """--reuse-features: a shard whose answers an earlier folder already holds is copied, not
    computed; a folder whose features are not this engine's is detected and not used."""
    from dspark_export.drafter.data import Donors, answer_feature_shards

    small, large = (_pairs(tiny_engine, p) for p in recorded)
    dec = _decoder(tiny_engine)
    answer_feature_shards(dec, small, tmp_path / "old" / "answers", per_shard=4)  # 4 + 4 + 2
    said: list[str] = []
    donors = Donors([tmp_path / "old"], dec, 16)
    assert len(donors) == 3
    paths = answer_feature_shards(dec, large, tmp_path / "new" / "answers", per_shard=4, progress=said.append,
                                  donors=donors)
    assert donors.taken == 2 and sum("taken from an earlier work folder" in s for s in said) == 2
    fresh = answer_feature_shards(dec, large, tmp_path / "fresh" / "answers", per_shard=4)
    for mine, computed in zip(paths, fresh):
        with np.load(mine) as a, np.load(computed) as b:
            assert set(a.files) == set(b.files)
            for k in a.files:
                assert np.array_equal(a[k], b[k]), k
    # Another engine's features (here: the old folder's hidden features scaled) are refused at the
    # first shard wanted, and that folder gives nothing more.
    for p in sorted((tmp_path / "old" / "answers").glob("*.npz")):
        with np.load(p) as z:
            arrays = {k: z[k] for k in z.files}
        arrays["aux"] = (arrays["aux"].astype(np.float32) * 1.5).astype(np.float16)
        np.savez(p, **arrays)
    donors = Donors([tmp_path / "old"], dec, 16)
    answer_feature_shards(dec, large, tmp_path / "other" / "answers", per_shard=4, donors=donors)
    assert donors.taken == 0
    with pytest.raises(ExportError, match="not a folder"):
        Donors([tmp_path / "missing"], dec, 16)


def test_a_missing_reuse_folder_is_refused_before_the_work_folder_is_touched(tiny_engine, tiny_hf, recorded, tmp_path):
    with pytest.raises(ExportError, match="--reuse-features .*missing: not a folder"):
        _train(tiny_engine, tiny_hf, recorded[0], tmp_path / "w", tmp_path / "d", reuse_features=(tmp_path / "missing",))
    assert not (tmp_path / "w").exists() and not (tmp_path / "d").exists()


def test_a_run_widens_the_drafter_it_starts_from_to_the_streams_the_engine_exposes(tiny_engine, tiny_hf, recorded,
                                                                                    tmp_path):
    """A drafter trained on an engine exposing stream 2 starts a run on one exposing 1 and 2:
    with a zero learning rate its context projection comes out with stream 2's columns where
    they were and stream 1's zero; the widened drafter installs into the wider engine, and the
    narrow one is refused there with the fix named."""
    from dspark_export import ExportOptions, export_target
    from dspark_export.drafter.install import install_drafter

    assert tuple(read_manifest(tiny_engine).hidden_state_layers) == (1, 2)
    narrow_engine = tmp_path / "narrow"
    export_target(ExportOptions(source=str(tiny_hf), output=narrow_engine, precisions=("fp32",), widths=(1, 2, 4),
                                hidden_layers=(2,), validate=False), progress=lambda s: None)
    small, large = recorded
    first, _ = _train(narrow_engine, tiny_hf, small, tmp_path / "w1", tmp_path / "d1")
    wide, msgs = _train(tiny_engine, tiny_hf, large, tmp_path / "w2", tmp_path / "d2", steps=2, lr=0.0,
                        init_from=first)
    assert any("widened from target streams [2] to [1, 2]" in m for m in msgs)
    meta = json.loads((wide / "drafter.json").read_text())
    assert meta["config"]["feature_layers"] == [1, 2] and meta["target"]["hidden_state_layers"] == [1, 2]
    before, after = np.load(first / "weights.npz"), np.load(wide / "weights.npz")
    h = before["fc.weight"].shape[0]
    assert after["fc.weight"].shape == (h, 2 * h)
    assert not after["fc.weight"][:, :h].any() and np.array_equal(after["fc.weight"][:, h:], before["fc.weight"])
    for k in before.files:
        if k != "fc.weight":
            assert np.array_equal(before[k], after[k]), k
    engine = tmp_path / "engine"
    shutil.copytree(tiny_engine, engine)
    with pytest.raises(ExportError, match="re-export the target with --hidden-layers 2 .*widens"):
        install_drafter(engine, first, blocks=(2,), precisions=("fp32",), source=str(tiny_hf), progress=msgs.append)
    install_drafter(engine, wide, blocks=(2,), precisions=("fp32",), source=str(tiny_hf), progress=msgs.append)
    assert tuple(read_manifest(engine).drafter.feature_layers) == (1, 2)


def test_a_run_can_grow_the_drafter_it_starts_from(tiny_engine, tiny_hf, recorded, tmp_path):
    """--add-layers: the run starts from the folder's drafter with a layer appended (as the
    identity: with a zero learning rate the old tensors come out unchanged and the new layer's
    output projections zero); the grown drafter installs; its work folder refuses to resume
    with another shape, and --add-layers without --init-from is refused."""
    from dspark_export.drafter.build import TrainDrafterOptions
    from dspark_export.drafter.install import install_drafter

    small, large = recorded
    first, _ = _train(tiny_engine, tiny_hf, small, tmp_path / "w1", tmp_path / "d1")
    grown, msgs = _train(tiny_engine, tiny_hf, large, tmp_path / "w2", tmp_path / "d2", steps=2, lr=0.0,
                         init_from=first, add_layers=1)
    assert any("grown to 2 layers" in m for m in msgs)
    assert json.loads((grown / "drafter.json").read_text())["config"]["num_layers"] == 2
    before, after = np.load(first / "weights.npz"), np.load(grown / "weights.npz")
    assert set(before.files) < set(after.files)
    for k in before.files:
        assert np.array_equal(before[k], after[k]), k
    assert not after["layers.1.o.weight"].any() and not after["layers.1.down.weight"].any()
    assert np.array_equal(after["layers.1.q.weight"], before["layers.0.q.weight"])
    engine = tmp_path / "engine"
    shutil.copytree(tiny_engine, engine)
    install_drafter(engine, grown, blocks=(2, 4), precisions=("fp32",), source=str(tiny_hf), progress=msgs.append)
    assert read_manifest(engine).drafter.num_layers == 2
    with pytest.raises(ExportError, match="another shape"):  # the work folder holds a 2-layer checkpoint
        _train(tiny_engine, tiny_hf, large, tmp_path / "w2", tmp_path / "d3", steps=3, init_from=first)
    with pytest.raises(ExportError, match="without --init-from"):
        TrainDrafterOptions(target_engine=tiny_engine, output=tmp_path / "o", work=tmp_path / "w", add_layers=1)


def test_an_even_subset_spans_the_set_in_order():
    """bench/drafter_heldout.py's ``evenly``: the subset every held-out bench script validates on."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from drafter_heldout import evenly

    ids = np.arange(100, 110)
    assert evenly(ids, 3).tolist() == [100, 104, 109]
    assert evenly(ids, 50).tolist() == ids.tolist() and evenly(ids, 1).tolist() == [100]
    assert evenly(np.zeros(0, dtype=int), 4).size == 0


def test_train_arms_parses_what_each_arm_sets_and_refuses_the_rest():
    """bench/train_arms.py: arms are KEY=VALUE pairs typed by TrainOptions' fields; unknown keys,
    bad values, the fields the script fixes and a new_scale without streams=all are refused."""
    import dataclasses
    import sys

    from dspark_edge.errors import ConfigError
    from dspark_export.drafter.train import TrainOptions

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from train_arms import parse_arms

    fields = {f.name: f.default for f in dataclasses.fields(TrainOptions)}
    arms = parse_arms("bf16=0; bf16=1, alpha_ce=0.5,alpha_tv=0.5; streams=all,new_scale=0.1,anchors=24", fields)
    assert arms == [("bf16=0", {"bf16": False}), ("bf16=1, alpha_ce=0.5,alpha_tv=0.5",
                                                   {"bf16": True, "alpha_ce": 0.5, "alpha_tv": 0.5}),
                    ("streams=all,new_scale=0.1,anchors=24", {"streams": "all", "new_scale": 0.1, "anchors": 24})]
    for bad, said in (("foo=1", "unknown key 'foo'"), ("bf16=2", "0 or 1"), ("alpha_ce=x", "not a number"),
                      ("anchors=2.5", "not a whole number"), ("steps=3", "unknown key 'steps'"), ("streams=some", "own or all"),
                      ("new_scale=0.1", "needs streams=all"), ("bf16", "not KEY=VALUE"), (" ; ", "names no arm")):
        with pytest.raises(ConfigError, match=said):
            parse_arms(bad, fields)
