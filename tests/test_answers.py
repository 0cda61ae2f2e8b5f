"""Recorded answers packed into one file: packing, checking, and reuse by ngram-table and
train-drafter."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dspark_edge.drafters import NgramTable
from dspark_edge.errors import ExportError
from dspark_edge.manifest import read_manifest
from dspark_export.answers import KINDS, load_answers, merge_answers, pack_answers


def _shard(folder, sequences, index=0):
    folder.mkdir(parents=True, exist_ok=True)
    toks = [np.asarray(p + a, dtype=np.int32) for p, a in sequences]
    n = sum(t.size for t in toks)
    np.savez(folder / f"shard-{index:05d}.npz", tokens=np.concatenate(toks),
             offsets=np.cumsum([0] + [t.size for t in toks]).astype(np.int64),
             prompt_lens=np.asarray([len(p) for p, _ in sequences], dtype=np.int32),
             aux=np.zeros((n, 1), np.float16), top_ids=np.zeros((n, 1), np.int32), top_logp=np.zeros((n, 1), np.float16))


PROMPTS = [([1, 5, 7], [20, 21, 22, 2]), ([1, 6], [30, 31, 2]), ([1, 5, 8], [20, 21, 40, 2])]
COPY = [([1, 9, 9, 9], [9, 9, 2])]


def _work(tmp_path, max_new=192):
    work = tmp_path / "work"
    _shard(work / "data", PROMPTS[:2])
    _shard(work / "data", PROMPTS[2:], index=1)
    _shard(work / "copy", COPY)
    (work / "copy" / "shard-00001.tmp.npz").write_bytes(b"being written")  # incomplete: not packed
    (work / "options.json").write_text(json.dumps({"max_new_tokens": str(max_new)}))
    return work


def test_pack_and_load_keep_every_answer_in_order(engine_copy, tmp_path):
    out = pack_answers(engine_copy, _work(tmp_path), tmp_path / "a.npz", progress=lambda m: None)
    got = load_answers(out, read_manifest(engine_copy), max_new_tokens=192)
    assert [got.pair(i) for i in range(len(got))] == PROMPTS + COPY
    assert [KINDS[k] for k in got.kinds] == ["prompt"] * 3 + ["copy"]
    assert got.meta["answers"] == {"prompt": 3, "copy": 1, "magpie": 0, "task": 0} and got.meta["max_new_tokens"] == 192
    assert got.meta["answer_tokens"] == sum(len(a) for _, a in PROMPTS + COPY)
    assert got.tokens.dtype == np.uint16  # the embedded default's vocabulary fits
    assert got.by_prompt()[(1, 6)] == [30, 31, 2]
    assert not [p for p in tmp_path.iterdir() if "partial" in p.name]


def test_merged_files_keep_their_order_and_drop_a_prompt_seen_before(engine_copy, tmp_path):
    first = pack_answers(engine_copy, _work(tmp_path), tmp_path / "a.npz", progress=lambda m: None)
    other = tmp_path / "other"
    _shard(other / "data", [([1, 6], [99, 2]), ([1, 4, 4], [50, 51, 2])])  # (1, 6) is in the first file
    _shard(other / "copy", [([1, 3], [3, 2])])
    (other / "options.json").write_text(json.dumps({"max_new_tokens": 192}))
    second = pack_answers(engine_copy, other, tmp_path / "b.npz", progress=lambda m: None)
    said: list[str] = []
    out = merge_answers(engine_copy, [first, second], tmp_path / "ab.npz", progress=said.append)
    got = load_answers(out, read_manifest(engine_copy), max_new_tokens=192)
    assert [got.pair(i) for i in range(len(got))] == PROMPTS + COPY + [([1, 4, 4], [50, 51, 2]), ([1, 3], [3, 2])]
    assert [KINDS[k] for k in got.kinds] == ["prompt"] * 3 + ["copy", "prompt", "copy"]
    parts = got.meta["parts"]
    assert [(p["first"], p["answers"], p["duplicates_dropped"]) for p in parts] == [(0, 4, 0), (4, 2, 1)]
    assert any("1 whose prompt came earlier dropped" in m for m in said)
    (other / "options.json").write_text(json.dumps({"max_new_tokens": 64}))
    capped = pack_answers(engine_copy, other, tmp_path / "c.npz", progress=lambda m: None)
    with pytest.raises(ExportError, match="different caps"):
        merge_answers(engine_copy, [first, capped], tmp_path / "x.npz", progress=lambda m: None)
    with pytest.raises(ExportError, match="two or more"):
        merge_answers(engine_copy, [first], tmp_path / "x.npz", progress=lambda m: None)
    assert not (tmp_path / "x.npz").exists()


def test_answers_of_another_model_or_cap_are_refused(engine_copy, tmp_path):
    out = pack_answers(engine_copy, _work(tmp_path), tmp_path / "a.npz", progress=lambda m: None)
    manifest = read_manifest(engine_copy)
    with pytest.raises(ExportError, match="capped at 192 tokens.*--max-new-tokens 192 or leave out --answers"):
        load_answers(out, manifest, max_new_tokens=64)
    with np.load(out) as f:
        arrays = {k: f[k] for k in f.files}
    meta = json.loads(str(arrays.pop("meta")))
    for change, words in (({"tokenizer_sha256": "0" * 64}, "another tokenizer"),
                          ({"source_sha256": "1" * 64, "model": "Other"}, "another model"),
                          ({"format": 7}, "format 7")):
        bad = tmp_path / "bad.npz"
        np.savez(bad, meta=np.asarray(json.dumps({**meta, **change})), **arrays)
        with pytest.raises(ExportError, match=words):
            load_answers(bad, manifest)
    np.savez(bad, meta=np.asarray(json.dumps(meta)), **{**arrays, "offsets": arrays["offsets"][:-1]})
    with pytest.raises(ExportError, match="damaged"):
        load_answers(bad, manifest)
    with pytest.raises(ExportError, match="does not exist"):
        load_answers(tmp_path / "none.npz", manifest)
    with pytest.raises(ExportError, match="no answer shards"):
        pack_answers(engine_copy, tmp_path / "empty", tmp_path / "b.npz", progress=lambda m: None)


def test_ngram_table_from_answers_equals_the_table_from_the_work_folder(engine_copy, tmp_path, capsys):
    from dspark_export.__main__ import main

    work = _work(tmp_path)
    answers = tmp_path / "a.npz"
    assert main(["answers", "--target", str(engine_copy), "--work", str(work), "--output", str(answers)]) == 0
    a, b = tmp_path / "from_work.npz", tmp_path / "from_answers.npz"
    assert main(["ngram-table", "--target", str(engine_copy), "--work", str(work), "--output", str(a)]) == 0
    assert main(["ngram-table", "--target", str(engine_copy), "--answers", str(answers), "--output", str(b)]) == 0
    ta, tb = NgramTable.load(a), NgramTable.load(b)
    assert ta.meta["answers"] == tb.meta["answers"] == 4
    assert ta.meta["answer_tokens"] == tb.meta["answer_tokens"]
    for n in ta.lengths:
        assert np.array_equal(ta.keys[n], tb.keys[n]) and np.array_equal(ta.nexts[n], tb.nexts[n])
    capsys.readouterr()
    assert main(["ngram-table", "--target", str(engine_copy), "--answers", str(answers), "--prompts", "2"]) == 2
    assert "--prompts applies to --work" in capsys.readouterr().err


def test_train_drafter_shards_reuse_recorded_answers(tmp_path, monkeypatch):
    from dspark_export.drafter import data

    generated: list[list[int]] = []

    def fake_generate(model, prompts, max_new_tokens, eos_id, pad_id, batch):
        generated.extend(prompts)
        return [[50 + len(p), 2] for p in prompts]

    written = {}
    monkeypatch.setattr(data, "generate_answers", fake_generate)
    monkeypatch.setattr(data, "write_shard", lambda path, decoder, seqs, top_k: written.setdefault(path.name, seqs))

    class Tok:
        def encode_chat(self, messages):
            return [1] + [ord(c) for c in messages[0]["content"]]

    prompts = [{"messages": [{"role": "user", "content": t}]} for t in ("ab", "c", "de")]
    known = {(1, ord("c")): [77, 78, 2]}
    data.build_shards(None, None, Tok(), prompts, tmp_path / "data", 2, 2, known=known)
    assert generated == [[1, ord("a"), ord("b")], [1, ord("d"), ord("e")]]  # only the prompts not recorded
    seqs = written["shard-00000.npz"]
    assert [a for _, a in seqs] == [[53, 2], [77, 78, 2], [53, 2]]  # in prompt order


def test_train_drafter_checks_the_answers_file_before_touching_anything(tiny_engine, tmp_path, capsys):
    from dspark_export.__main__ import main

    work = tmp_path / "work"
    assert main(["train-drafter", "--target", str(tiny_engine), "--output", str(tmp_path / "out"), "--work", str(work),
                 "--answers", str(tmp_path / "none.npz"), "--steps", "1"]) == 2
    assert "none.npz does not exist" in capsys.readouterr().err
    assert not work.exists() and not (tmp_path / "out").exists()
