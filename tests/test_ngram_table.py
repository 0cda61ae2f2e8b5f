"""The n-gram drafter's corpus table: building, checking, looking up, and drafting from it."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import dspark_edge
from tiny_model import fake_answer_work
from dspark_edge import ConfigError
from dspark_edge.errors import ExportError
from dspark_edge.drafters import DraftRequest, NgramDrafter, NgramTable
from dspark_edge.drafters.ngram_table import FILE_NAME, context_key
from dspark_edge.errors import EngineError
from dspark_export.ngram_table import count_continuations, table_arrays


def req(ctx, k=4):
    return DraftRequest(context=ctx, max_tokens=k, temperature=0.0, top_k=0, top_p=1.0)


def make_table(sequences, max_n=3, meta=None) -> NgramTable:
    return NgramTable.from_arrays(table_arrays(count_continuations(sequences, max_n)), meta or {"format": 2})


def test_context_key_is_stable_and_length_aware():
    # Shipped tables store these hashes: the function must not change within a format.
    assert context_key([5]) == 0x100000001B3 + 6
    assert context_key([1, 2]) != context_key([2, 1])
    assert context_key([0]) != context_key([0, 0])
    keys = {context_key(list(t)) for t in np.random.default_rng(0).integers(0, 50_000, size=(5000, 3))}
    assert len(keys) == 5000


def test_counts_answers_only_and_picks_the_most_frequent():
    # prompt [9, 9] then answers; "1 2" is followed by 3 twice and by 4 once.
    table = make_table([([9, 9, 1, 2, 3], 2), ([9, 9, 1, 2, 3], 2), ([1, 2, 4], 0)], max_n=2)
    assert table.lookup([7, 1, 2]) == (3, 2, pytest.approx(2 / 3, abs=1e-3), 3)  # "1 2" seen 3 times
    assert table.lookup([2]) == (3, 1, pytest.approx(2 / 3, abs=1e-3), 3)
    assert table.lookup([9]) == (1, 1, 1.0, 2)  # a prompt token as context, an answer token as continuation
    assert table.lookup([42]) is None


def test_ties_go_to_the_smallest_id():
    table = make_table([([1, 8], 0), ([1, 5], 0)], max_n=1)
    assert table.lookup([1])[0] == 5


def test_continue_from_chains_lookups():
    table = make_table([([1, 2, 3, 4, 5, 6], 0)], max_n=3)
    d = table.continue_from([0, 1, 2], 4)
    assert d.tokens == [3, 4, 5, 6] and d.context_lengths == [2, 3, 3, 3] and d.counts == [1, 1, 1, 1]
    assert table.continue_from([0, 1, 2], 4, min_n=3).tokens == []  # "0 1 2" is unknown


def test_drafter_uses_the_table_when_the_conversation_has_no_match():
    table = make_table([([10, 11, 12, 13, 14], 0)] * 3)
    d = NgramDrafter(table=table)
    d.begin([50, 51, 10])
    draft = d.propose(req([50, 51, 10, 11], 3), np.random.default_rng(0))
    assert list(draft.tokens) == [12, 13, 14] and draft.q is None
    assert d.name == "ngram+table"
    # without the table the same context gives nothing
    plain = NgramDrafter()
    plain.begin([50, 51, 10])
    assert len(plain.propose(req([50, 51, 10, 11], 3), np.random.default_rng(0))) == 0


def test_long_conversation_match_beats_table_and_table_beats_one_token_match():
    table = make_table([([1, 2, 3, 30, 31], 0)] * 3)
    d = NgramDrafter(table=table)
    # "2 3" occurred earlier in the conversation, followed by 7 8: a 2-token match wins.
    d.begin([2, 3, 7, 8, 1, 2])
    assert list(d.propose(req([2, 3, 7, 8, 1, 2, 3], 2), np.random.default_rng(0)).tokens) == [7, 8]
    # Only "3" occurred earlier (a 1-token match); the table knows "2 3" → its continuation wins.
    d.begin([3, 7, 8, 1, 2])
    assert list(d.propose(req([3, 7, 8, 1, 2, 3], 2), np.random.default_rng(0)).tokens) == [30, 31]
    # With table_min_n=1 the conversation's 1-token match is kept.
    d1 = NgramDrafter(table=table, table_min_n=1)
    d1.begin([3, 7, 8, 1, 2])
    assert list(d1.propose(req([3, 7, 8, 1, 2, 3], 2), np.random.default_rng(0)).tokens) == [7, 8]
    with pytest.raises(ConfigError):
        NgramDrafter(table=table, table_min_n=0)


def test_table_confidence_is_learned_per_bucket():
    # "1 2" → 3 always (share 1.0); "5 6" → 7 or 8 (share 0.5): different buckets, different priors.
    table = make_table([([1, 2, 3], 0)] * 4 + [([5, 6, 7], 0), ([5, 6, 8], 0)])
    d = NgramDrafter(table=table)
    d.begin([0])
    sure = d.propose(req([0, 1, 2], 1), np.random.default_rng(0)).confidence[0]
    unsure = d.propose(req([0, 5, 6], 1), np.random.default_rng(0)).confidence[0]
    assert sure > unsure
    for _ in range(30):  # the confident bucket keeps failing
        d.propose(req([0, 1, 2], 1), np.random.default_rng(0))
        d.feedback(1, 0, [99])
    assert d.propose(req([0, 1, 2], 1), np.random.default_rng(0)).confidence[0] < 0.15
    assert d.propose(req([0, 5, 6], 1), np.random.default_rng(0)).confidence[0] == pytest.approx(unsure)
    d.begin([0])  # statistics restart with each generation
    assert d.propose(req([0, 1, 2], 1), np.random.default_rng(0)).confidence[0] == pytest.approx(sure)


def test_feedback_counts_only_the_drafts_verified():
    table = make_table([([1, 2, 3, 4, 5], 0)] * 3)
    d = NgramDrafter(table=table)
    d.begin([0])
    d.propose(req([0, 1, 2], 3), np.random.default_rng(0))
    d.feedback(3, 1, [3, 9])  # first accepted, second rejected, third never judged
    tried = sum(t.tried for t in d.table_stats.values())
    accepted = sum(t.accepted for t in d.table_stats.values())
    assert (tried, accepted) == (2, 1)


def _fake_work(tmp_path, sequences):
    return fake_answer_work(tmp_path / "work", sequences)


def test_export_builds_installs_and_the_pipeline_stays_exact(engine_copy, tmp_path, capsys):
    from dspark_export.__main__ import main

    plain = dspark_edge.load(engine_copy)
    prompts = ["The quick brown fox", "Once upon a time", "1 2 3 4"]
    answers = [plain.generate(p, max_new_tokens=24, ignore_eos=True) for p in prompts]
    work = _fake_work(tmp_path, [(plain.tokenizer.encode(p), list(r.token_ids)) for p, r in zip(prompts, answers)])
    assert main(["ngram-table", "--target", str(engine_copy), "--work", str(work)]) == 0
    assert (engine_copy / FILE_NAME).is_file()
    assert not [p for p in engine_copy.iterdir() if "partial" in p.name]
    meta = NgramTable.load(engine_copy / FILE_NAME).meta
    assert meta["answers"] == 3 and meta["answer_tokens"] == sum(len(r.token_ids) for r in answers)

    spec = dspark_edge.load(engine_copy, drafter="ngram", scheduler=False)
    assert spec.drafter.name == "ngram+table"
    assert dspark_edge.load(engine_copy, drafter="ngram:prompt").drafter.table is None
    for p, r in zip(prompts + ["A different prompt"], answers + [None]):
        want = r.token_ids if r else plain.generate(p, max_new_tokens=24, ignore_eos=True).token_ids
        got = spec.generate(p, max_new_tokens=24, ignore_eos=True, draft_tokens=3)
        assert got.token_ids == want
    # the table's own answers are drafted back: most of the second answer comes from drafts
    again = spec.generate(prompts[1], max_new_tokens=24, ignore_eos=True, draft_tokens=3)
    assert again.stats.draft_n_accepted >= 8

    from dspark_edge.cli import main as cli_main

    assert cli_main(["inspect", "--engine", str(engine_copy), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["ngram_table"]
    assert shown["contexts"] == NgramTable.load(engine_copy / FILE_NAME).entries and shown["answers"] == 3

    # --from installs a copy into another engine folder; the bytes are the table's
    other = tmp_path / "other"
    shutil.copytree(engine_copy, other)
    (other / FILE_NAME).unlink()
    assert main(["ngram-table", "--target", str(other), "--from", str(engine_copy / FILE_NAME)]) == 0
    assert (other / FILE_NAME).read_bytes() == (engine_copy / FILE_NAME).read_bytes()


def test_table_for_another_tokenizer_is_refused(engine_copy, tmp_path, capsys):
    from dspark_export.__main__ import main

    work = _fake_work(tmp_path, [([1, 2], [3, 4, 5])])
    table_file = tmp_path / "t.npz"
    assert main(["ngram-table", "--target", str(engine_copy), "--work", str(work), "--output", str(table_file)]) == 0
    with np.load(table_file) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(str(arrays.pop("meta")))
    meta["tokenizer_sha256"] = "0" * 64
    bad = tmp_path / "bad.npz"
    np.savez(bad, meta=np.asarray(json.dumps(meta)), **arrays)
    assert main(["ngram-table", "--target", str(engine_copy), "--from", str(bad)]) == 2
    assert "another tokenizer" in capsys.readouterr().err
    assert not (engine_copy / FILE_NAME).exists()  # nothing installed
    shutil.copy(bad, engine_copy / FILE_NAME)  # put there by hand: loading names the problem
    with pytest.raises(ConfigError, match="another tokenizer"):
        dspark_edge.load(engine_copy, drafter="ngram")


def test_damaged_tables_are_named(tmp_path):
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a table")
    with pytest.raises(EngineError, match="not a readable n-gram table"):
        NgramTable.load(junk)
    keys = np.asarray([5, 3], dtype=np.int64)
    meta = {"format": 1, "context_lengths": [1]}
    unsorted = tmp_path / "unsorted.npz"
    np.savez(unsorted, meta=np.asarray(json.dumps(meta)), keys_1=keys, next_1=np.zeros(2, np.int32),
             share_1=np.ones(2, np.float16))
    with pytest.raises(EngineError, match="not a sorted table"):
        NgramTable.load(unsorted)
    future = tmp_path / "future.npz"
    np.savez(future, meta=np.asarray(json.dumps({**meta, "format": 99})), keys_1=keys[::-1].copy(),
             next_1=np.zeros(2, np.int32), share_1=np.ones(2, np.float16))
    with pytest.raises(EngineError, match="format 99"):
        NgramTable.load(future)


def test_cli_errors_name_the_fix(engine_copy, tmp_path, capsys):
    from dspark_export.__main__ import main

    assert main(["ngram-table", "--target", str(engine_copy), "--work", str(tmp_path / "nothing")]) == 2
    assert "train-drafter" in capsys.readouterr().err
    assert main(["ngram-table", "--target", str(engine_copy), "--from", str(tmp_path / "x.npz"),
                 "--output", str(tmp_path / "y.npz")]) == 2
    assert "--from" in capsys.readouterr().err
    assert main(["ngram-table", "--target", str(engine_copy), "--from", str(tmp_path / "x.npz"),
                 "--min-count", "2"]) == 2
    assert "--min-count" in capsys.readouterr().err
    assert main(["ngram-table", "--target", str(engine_copy), "--from", str(tmp_path / "x.npz")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not (engine_copy / FILE_NAME).exists()
    work = _fake_work(tmp_path, [([1], [2, 3])])
    blocked = tmp_path / "a-folder.npz"
    (blocked / "kept").mkdir(parents=True)  # the output path is a folder: the write fails, it stays
    assert main(["ngram-table", "--target", str(engine_copy), "--work", str(work), "--output", str(blocked)]) == 2
    assert "is a folder" in capsys.readouterr().err and (blocked / "kept").is_dir()  # refused before counting
    assert not [q for q in tmp_path.iterdir() if "partial" in q.name]
    nested = tmp_path / "new" / "folder" / "t.npz"  # missing parent folders are made
    assert main(["ngram-table", "--target", str(engine_copy), "--work", str(work), "--output", str(nested)]) == 0
    assert NgramTable.load(nested).meta["answers"] == 1


def test_replay_bench_counts_rounds_like_the_pipeline():
    """bench/ngram_replay.py: every round commits the accepted drafts plus one token, so the
    rounds add up to the answer; the table's drafts shorten a repetitive answer's rounds."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from ngram_replay import replay

    answer = [10, 11, 12, 13, 14, 15] * 3
    answers = [{"id": "a", "category": "x", "prompt": [1, 2], "answer": answer}]
    table = make_table([([1, 2] + answer, 2)], max_n=3)
    plain = replay(NgramDrafter, answers, 3)
    with_table = replay(lambda: NgramDrafter(table=table), answers, 3)
    for r in (plain, with_table):
        assert r["tau"] == pytest.approx(len(answer) / r["rounds"], abs=1e-3)
    assert with_table["rounds"] < plain["rounds"]
    judged = sum(b["drafts"] for b in with_table["table_reliability"].values())
    assert judged > 0 and not plain["table_reliability"]


def test_build_counts_the_first_answers_and_the_copy_tasks(engine_copy, tmp_path):
    from dspark_export.ngram_table import build_table

    work = _fake_work(tmp_path, [([1], [2, 3]), ([1], [4, 5]), ([1], [6, 7])])
    copy = _fake_work(tmp_path / "c", [([9], [8, 8, 8])])
    (copy / "data").rename(work / "copy")
    (work / "copy" / "shard-00001.tmp.npz").write_bytes(b"being written")  # not complete: not read
    out = build_table(engine_copy, work, prompts=2, output=tmp_path / "t.npz", progress=lambda m: None)
    table = NgramTable.load(out)
    assert table.meta["answers"] == 3 and table.meta["answer_tokens"] == 2 + 2 + 3
    assert table.lookup([1])[0] == 2 and table.lookup([6]) is None  # the third answer (1 → 6 7) is left out
    assert table.lookup([9])[0] == 8
    # --min-count 2: only contexts seen twice or more ("1" twice, "8" twice, "9 8" once: dropped)
    out = build_table(engine_copy, work, prompts=2, output=tmp_path / "t2.npz", progress=lambda m: None, min_count=2)
    table = NgramTable.load(out)
    assert table.meta["min_count"] == 2 and table.lookup([1])[0] == 2 and table.lookup([8])[0] == 8
    assert table.lookup([9]) is None
    for bad in (0, 65536):
        with pytest.raises(ExportError, match="--min-count"):
            build_table(engine_copy, work, output=tmp_path / "t3.npz", progress=lambda m: None, min_count=bad)


def test_the_array_count_equals_the_reference_count():
    """``count_table`` (what building a table runs) gives the arrays of the dictionary count,
    ties, empty and prompt-only answers, an answer start past the end and capped counts included;
    with ``min_count`` it keeps exactly the contexts seen that often."""
    from dspark_export.ngram_table import count_table

    rng = np.random.default_rng(0)
    seqs = [(rng.integers(0, 30, int(rng.integers(1, 60))).tolist(), int(rng.integers(0, 20))) for _ in range(300)]
    seqs += [([1] * 70_000, 0), ([], 0), ([5], 0), ([1, 2, 3], 3), ([4, 7, 4, 8], 1)]  # 4 → 7 and 4 → 8: a tie
    want = table_arrays(count_continuations(seqs, 4))
    got = count_table(seqs, 4)
    assert want.keys() == got.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and np.array_equal(got[k], want[k]), k
    assert count_table([], 2)["keys_2"].size == 0
    pruned = count_table(seqs, 4, min_count=3)
    assert 0 < sum(pruned[f"keys_{n}"].size for n in range(1, 5)) < sum(want[f"keys_{n}"].size for n in range(1, 5))
    for n in range(1, 5):
        keep = want[f"count_{n}"] >= 3
        for k in ("keys", "next", "share", "count"):
            assert np.array_equal(pruned[f"{k}_{n}"], want[f"{k}_{n}"][keep])


def test_counts_are_capped_and_format_1_tables_still_load(tmp_path):
    arrays = table_arrays(count_continuations([([1] * 70_000, 0)], 1))  # "1" seen 69,999 times
    assert arrays["count_1"].dtype == np.uint16 and arrays["count_1"].max() == 65535
    # A format 1 file (no counts, no calibration): read, counts reported as 0, confidences online.
    old = {k: v for k, v in table_arrays(count_continuations([([1, 2, 3], 0)] * 3, 2)).items()
           if not k.startswith("count_")}
    path = tmp_path / "old.npz"
    np.savez(path, meta=np.asarray(json.dumps({"format": 1, "context_lengths": [1, 2]})), **old)
    table = NgramTable.load(path)
    assert table.counts is None and table.lookup([1, 2]) == (3, 2, 1.0, 0) and table.calibration is None
    d = NgramDrafter(table=table)
    assert d.weights is None and d.observed_confidence
    d.begin([0])
    assert list(d.propose(req([0, 1, 2], 1), np.random.default_rng(0)).tokens) == [3]
    assert d.last_features is None  # no model to feed: its inputs are not computed


def test_draft_features_layout():
    from dspark_edge.drafters.ngram import FEATURES, draft_features

    x = draft_features(True, [4, 3, 2, 1, 1], [1.0, 0.5, 0.25, 1.0, 1.0], [100, 3, 0, 1, 1],
                       [True, False, False, False, True], on_track=True)
    assert x.shape == (5, len(FEATURES))
    col = {name: i for i, name in enumerate(FEATURES)}
    assert (x[:, col["bias"]] == 1).all()
    assert x[:, col["position 1"]].tolist() == [1, 0, 0, 0, 0] and x[:, col["position 4+"]].tolist() == [0, 0, 0, 1, 1]
    assert x[:, col["table n=4+"]].tolist() == [1, 0, 0, 0, 0] and x[:, col["table n=1"]].tolist() == [0, 0, 0, 1, 1]
    assert x[0, col["table log count / 5"]] == pytest.approx(np.log1p(100) / 5)
    assert x[1, col["table share x log count / 5"]] == pytest.approx(0.5 * np.log1p(3) / 5)
    assert x[:, col["other source agrees"]].tolist() == [1, 0, 0, 0, 1]
    assert (x[:, col["on track"]] == 1).all() and x[:, col["on track x position 1"]].tolist() == [1, 0, 0, 0, 0]
    assert not x[:, col["conversation n=1"]:col["conversation n=4+"] + 1].any()
    conv = draft_features(False, [2, 2], [], [], [False, False], on_track=None)
    assert conv[:, col["conversation n=2"]].tolist() == [1, 1] and (conv[:, col["no previous proposal"]] == 1).all()
    assert not conv[:, col["table n=1"]:col["table share x log count / 5"] + 1].any()


def test_on_track_reads_the_previous_proposal_past_the_accepted_drafts():
    table = make_table([([1, 2, 3, 4, 5, 6, 7], 0)] * 3)
    d = NgramDrafter(table=table, record_features=True)  # no calibration: the inputs only on request
    d.begin([0])
    on_track = 17  # "on track" column
    d.propose(req([0, 1, 2], 4), np.random.default_rng(0))  # proposes 3 4 5 6 after "0 1 2"
    assert d.last_features[0, 18] == 1  # the first proposal has no previous one
    d.feedback(2, 2, [0, 1, 2, 3, 4])  # 3 4 accepted; the target's own next token is 5: predicted
    d.propose(req([0, 1, 2, 3, 4, 5], 4), np.random.default_rng(0))
    assert d.last_features[0, on_track] == 1
    d.feedback(1, 0, [0, 1, 2, 3, 4, 5])  # 6 rejected, the target chose 1: not predicted
    d.propose(req([0, 1, 2, 3, 4, 5, 1], 4), np.random.default_rng(0))
    assert d.last_features[0, on_track] == 0 and d.last_features[0, 18] == 0


def test_fit_logistic_recovers_known_weights():
    from dspark_export.ngram_table import fit_logistic

    rng = np.random.default_rng(0)
    x = np.c_[np.ones(20_000), rng.normal(size=(20_000, 2))]
    w = np.asarray([-0.5, 1.5, -1.0])
    y = (rng.random(20_000) < 1 / (1 + np.exp(-(x @ w)))).astype(np.float64)
    assert np.allclose(fit_logistic(x, y, l2=0.0), w, atol=0.1)


def _grammar_answers(n: int, seed: int = 0):
    """Answers of a small grammar: fixed phrases (always continued the same way) joined by
    random words (never predictable), so table drafts inside a phrase are right and across a
    join mostly wrong."""
    rng = np.random.default_rng(seed)
    phrases = [list(range(20 + 10 * i, 26 + 10 * i)) for i in range(12)]  # ids the tiny model has
    out = []
    for _ in range(n):
        answer: list[int] = []
        for _ in range(8):
            answer += phrases[int(rng.integers(len(phrases)))] + [int(rng.integers(150, 250))]
        out.append(([1, 2, 3], answer))
    return out


def test_built_table_carries_a_calibration_the_drafter_uses(engine_copy, tmp_path, caplog):
    from dspark_edge.drafters.ngram import FEATURES
    from dspark_export.ngram_table import build_table

    work = _fake_work(tmp_path, _grammar_answers(64))
    said: list[str] = []
    out = build_table(engine_copy, work, output=tmp_path / "t.npz", progress=said.append)
    table = NgramTable.load(out)
    cal = table.calibration
    assert cal is not None and cal["features"] == list(FEATURES) and len(cal["weights"]) == len(FEATURES)
    assert cal["held_out_answers"] == 8 and cal["judged_drafts"] >= 200
    # fitted on one half of the held-out drafts, it predicts the other half better than a constant
    assert cal["two_fold"]["log_loss"] < cal["constant"]["log_loss"] - 0.05 and cal["two_fold"]["auroc"] > 0.7
    assert any("two-fold held-out log-loss" in m for m in said)

    d = NgramDrafter(table=table)
    assert not d.observed_confidence and d.weights is not None
    d.begin([1, 2, 3])
    inside = d.propose(req([1, 2, 3, 20, 21, 22], 3), np.random.default_rng(0))  # within a phrase
    assert list(inside.tokens) == [23, 24, 25]
    want = np.clip(1 / (1 + np.exp(-(d.last_features @ d.weights))), 0.01, 0.99)
    assert np.allclose(inside.confidence, want)
    join = d.propose(req([1, 2, 3, 20, 21, 22, 23, 24, 25], 1), np.random.default_rng(0))  # before a random word
    assert inside.confidence[0] > join.confidence[0] + 0.2

    # "ngram:online" (or a drafter made with calibrated=False) ignores it
    assert NgramDrafter(table=table, calibrated=False).observed_confidence
    # a calibration for other features is not applied, and the log says so
    meta = dict(table.meta, calibration={**cal, "features": ["something else"]})
    with caplog.at_level("WARNING"):
        other = NgramDrafter(table=NgramTable(table.keys, table.nexts, table.shares, meta, table.counts))
    assert other.weights is None and other.observed_confidence and "other features" in caplog.text

    few = build_table(engine_copy, _fake_work(tmp_path / "few", _grammar_answers(8)), output=tmp_path / "f.npz",
                      progress=said.append)
    assert NgramTable.load(few).calibration is None and "not calibrated" in said[-2]


def test_calibrated_table_keeps_greedy_exact_with_the_scheduler(engine_copy, tmp_path, capsys):
    """Calibrated confidences go through the scheduler's online offset (observed_confidence is
    False); widths change, output does not."""
    from dspark_export.__main__ import main

    plain = dspark_edge.load(engine_copy)
    prompts = [f"Item {i}: the quick brown fox" for i in range(8)]
    answers = [plain.generate(p, max_new_tokens=24, ignore_eos=True) for p in prompts]
    # the model's own answers (drafted back below) and enough grammar answers to calibrate on
    work = _fake_work(tmp_path, [(plain.tokenizer.encode(p), list(r.token_ids)) for p, r in zip(prompts, answers)]
                      + _grammar_answers(64))
    assert main(["ngram-table", "--target", str(engine_copy), "--work", str(work)]) == 0
    spec = dspark_edge.load(engine_copy, drafter="ngram")
    assert spec.drafter.weights is not None, "the tiny model's answers should be enough to calibrate"
    assert dspark_edge.load(engine_copy, drafter="ngram:online").drafter.weights is None
    for p in ["Item 3: the quick brown fox", "Something else entirely"]:
        want = plain.generate(p, max_new_tokens=24, ignore_eos=True).token_ids
        assert spec.generate(p, max_new_tokens=24, ignore_eos=True).token_ids == want
    assert spec.scheduler.offset != 0.0  # the offset learned from the calibrated confidences

    from dspark_edge.cli import main as cli_main

    capsys.readouterr()
    assert cli_main(["inspect", "--engine", str(engine_copy), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["ngram_table"]
    assert shown["format"] == 2 and shown["calibration"]["used"]
    assert shown["calibration"]["two_fold"]["log_loss"] < shown["calibration"]["constant"]["log_loss"]
    assert cli_main(["inspect", "--engine", str(engine_copy)]) == 0
    assert "calibrated confidences" in capsys.readouterr().out


def test_replay_oracle_bounds_every_policy_and_the_scheduler_runs_as_in_the_pipeline():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from ngram_replay import oracle, replay

    from dspark_edge.scheduler import CostModel, Scheduler

    rng = np.random.default_rng(1)
    phrase = [10, 11, 12, 13, 14, 15, 16]
    answer = []
    for _ in range(16):  # a phrase cut at a random point, then an unpredictable token
        answer += phrase[:int(rng.integers(1, 8))] + [int(rng.integers(100, 200))]
    answers = [{"id": "a", "category": "x", "prompt": [1, 2], "answer": answer}]
    table = make_table([([1, 2] + phrase + [99] + phrase, 2)], max_n=3)
    verify = {1: 10.0, 2: 13.0, 3: 16.0, 4: 19.0, 6: 25.0, 8: 31.0}
    widths = tuple(verify)
    runs = {k: replay(lambda: NgramDrafter(table=table), answers, k, verify, widths) for k in (1, 3, 5, 7)}
    runs["oracle"] = oracle(lambda: NgramDrafter(table=table), answers, verify, widths)
    sched = Scheduler(CostModel(verify, 0.0), widths)
    runs["scheduler"] = replay(lambda: NgramDrafter(table=table), answers, sched, verify, widths)
    for name, r in runs.items():
        assert sum(r["widths"].values()) == r["rounds"], name
        assert set(r["widths"]) <= set(widths), name
    # the bound holds for every policy, and is above every fixed length here (the unpredictable
    # tokens between phrases make fixed lengths waste verification)
    assert all(runs["oracle"]["vs_plain"] >= r["vs_plain"] for r in runs.values())
    assert runs["oracle"]["vs_plain"] > max(runs[k]["vs_plain"] for k in (1, 3, 5, 7))
    # its cost is consistent with its widths: Σ rounds × cost equals tokens / speed
    cost = sum(verify[w] * n for w, n in runs["oracle"]["widths"].items())
    assert len(answer) / cost * verify[1] == pytest.approx(runs["oracle"]["vs_plain"], abs=2e-3)
    assert sched.step == runs["scheduler"]["rounds"]  # decided every round, as the pipeline does


def test_a_table_with_damaged_compressed_data_is_a_project_error(tmp_path):
    """Flipped bytes inside a compressed member make zlib fail mid-read: an EngineError with the fix."""
    import json
    import zipfile

    from dspark_edge.drafters.ngram_table import READABLE, NgramTable
    from dspark_edge.errors import EngineError

    good = tmp_path / "t.npz"
    keys = np.arange(0, 40000, 3, dtype=np.int64)
    np.savez_compressed(good, meta=np.array(json.dumps({"format": max(READABLE), "context_lengths": [1]})),
                        keys_1=keys, next_1=np.zeros(keys.size, np.int32), share_1=np.ones(keys.size, np.float32),
                        count_1=np.ones(keys.size, np.int32))
    info = zipfile.ZipFile(good).getinfo("keys_1.npy")
    start = info.header_offset + 30 + len(info.filename) + len(info.extra)
    raw = bytearray(good.read_bytes())
    refused = 0
    for at in range(start + 8, start + info.compress_size - 8, max(1, info.compress_size // 40)):
        bad = tmp_path / f"bad-{at}.npz"
        data = bytearray(raw)
        data[at] ^= 0xFF
        bad.write_bytes(bytes(data))
        try:  # a flip may leave the data decodable; any failure must be the project's error
            NgramTable.load(bad)
        except EngineError as exc:
            refused += "not a readable n-gram table" in str(exc) or "not a sorted table" in str(exc)
    assert refused > 0


@pytest.mark.parametrize("field,value", [(6, 64), (10, 99)])  # version needed to extract 6.4; compression 99
def test_a_table_zip_cannot_open_is_a_project_error(tmp_path, field, value):
    """A damaged central directory can name a zip version or a compression method that zipfile
    does not implement (NotImplementedError, found by the engine fuzz test): an EngineError."""
    import json

    from dspark_edge.drafters.ngram_table import READABLE, NgramTable
    from dspark_edge.errors import EngineError

    path = tmp_path / "t.npz"
    keys = np.arange(0, 300, 3, dtype=np.int64)
    np.savez_compressed(path, meta=np.array(json.dumps({"format": max(READABLE), "context_lengths": [1]})),
                        keys_1=keys, next_1=np.zeros(keys.size, np.int32), share_1=np.ones(keys.size, np.float32),
                        count_1=np.ones(keys.size, np.int32))
    raw = bytearray(path.read_bytes())
    at = raw.index(b"PK\x01\x02")  # the first central directory entry
    raw[at + field:at + field + 2] = value.to_bytes(2, "little")
    path.write_bytes(bytes(raw))
    with pytest.raises(EngineError, match="not a readable n-gram table"):
        NgramTable.load(path)
