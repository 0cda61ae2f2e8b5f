"""The n-gram drafter's corpus table: building, checking, looking up, and drafting from it."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import dspark_edge
from dspark_edge import ConfigError
from dspark_edge.drafters import DraftRequest, NgramDrafter, NgramTable
from dspark_edge.drafters.ngram_table import FILE_NAME, context_key
from dspark_edge.errors import EngineError
from export.ngram_table import count_continuations, table_arrays


def req(ctx, k=4):
    return DraftRequest(context=ctx, max_tokens=k, temperature=0.0, top_k=0, top_p=1.0)


def make_table(sequences, max_n=3) -> NgramTable:
    arrays = table_arrays(count_continuations(sequences, max_n))
    lengths = list(range(1, max_n + 1))
    return NgramTable({n: arrays[f"keys_{n}"] for n in lengths}, {n: arrays[f"next_{n}"].astype(np.int64) for n in lengths},
                      {n: arrays[f"share_{n}"].astype(np.float32) for n in lengths}, {"format": 1})


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
    assert table.lookup([7, 1, 2]) == (3, 2, pytest.approx(2 / 3, abs=1e-3))
    assert table.lookup([2]) == (3, 1, pytest.approx(2 / 3, abs=1e-3))
    assert table.lookup([9]) == (1, 1, 1.0)  # a prompt token as context, an answer token as continuation
    assert table.lookup([42]) is None


def test_ties_go_to_the_smallest_id():
    table = make_table([([1, 8], 0), ([1, 5], 0)], max_n=1)
    assert table.lookup([1])[0] == 5


def test_continue_from_chains_lookups():
    table = make_table([([1, 2, 3, 4, 5, 6], 0)], max_n=3)
    d = table.continue_from([0, 1, 2], 4)
    assert d.tokens == [3, 4, 5, 6] and d.context_lengths == [2, 3, 3, 3]
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
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    toks = [np.asarray(p + a, dtype=np.int32) for p, a in sequences]
    n = sum(t.size for t in toks)
    np.savez(work / "data" / "shard-00000.npz", tokens=np.concatenate(toks),
             offsets=np.cumsum([0] + [t.size for t in toks]).astype(np.int64),
             prompt_lens=np.asarray([len(p) for p, _ in sequences], dtype=np.int32),
             aux=np.zeros((n, 1), np.float16), top_ids=np.zeros((n, 1), np.int32), top_logp=np.zeros((n, 1), np.float16))
    return work


def test_export_builds_installs_and_the_pipeline_stays_exact(engine_copy, tmp_path, capsys):
    from export.__main__ import main

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
    from export.__main__ import main

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
    from export.__main__ import main

    assert main(["ngram-table", "--target", str(engine_copy), "--work", str(tmp_path / "nothing")]) == 2
    assert "train-drafter" in capsys.readouterr().err
    assert main(["ngram-table", "--target", str(engine_copy), "--from", str(tmp_path / "x.npz"),
                 "--output", str(tmp_path / "y.npz")]) == 2
    assert "--from" in capsys.readouterr().err
    assert main(["ngram-table", "--target", str(engine_copy), "--from", str(tmp_path / "x.npz")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not (engine_copy / FILE_NAME).exists()
    work = _fake_work(tmp_path, [([1], [2, 3])])
    blocked = tmp_path / "a-folder.npz"
    (blocked / "kept").mkdir(parents=True)  # the output path is a folder: the write fails, it stays
    assert main(["ngram-table", "--target", str(engine_copy), "--work", str(work), "--output", str(blocked)]) == 2
    assert "failed" in capsys.readouterr().err and (blocked / "kept").is_dir()
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
    from export.ngram_table import build_table

    work = _fake_work(tmp_path, [([1], [2, 3]), ([1], [4, 5]), ([1], [6, 7])])
    copy = _fake_work(tmp_path / "c", [([9], [8, 8, 8])])
    (copy / "data").rename(work / "copy")
    (work / "copy" / "shard-00001.tmp.npz").write_bytes(b"being written")  # not complete: not read
    out = build_table(engine_copy, work, prompts=2, output=tmp_path / "t.npz", progress=lambda m: None)
    table = NgramTable.load(out)
    assert table.meta["answers"] == 3 and table.meta["answer_tokens"] == 2 + 2 + 3
    assert table.lookup([1])[0] == 2 and table.lookup([6]) is None  # the third answer (1 → 6 7) is left out
    assert table.lookup([9])[0] == 8
