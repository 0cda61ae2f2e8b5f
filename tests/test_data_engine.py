"""The data engine (`python -m export data`): batched answers equal the runtime's own greedy
answers, work folders resume and refuse other inputs, self-written messages are filtered."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

import dspark_edge
from dspark_edge.errors import ExportError
from dspark_edge.manifest import read_manifest
from dspark_edge.tokenizer import Tokenizer
from dspark_export.answers import KINDS, load_answers
from dspark_export.data_engine import (BatchedTarget, DataOptions, MessageFilter, _write_shard, check_work,
                                       engine_identity, pack, read_prompts, run, written)
from dspark_export.drafter.prompts import answer_passages, task_prompts

MESSAGES = [
    [{"role": "user", "content": "hi"}],
    [{"role": "user", "content": "tell me a long story about a cat and a dog and a bird"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "why?"}],
    [{"role": "user", "content": "one two three four five six seven"}],
    [{"role": "user", "content": "x"}],
]


def _runtime_answers(engine, messages, max_new):
    with dspark_edge.load(str(engine), precision="fp32", drafter="none") as pipe:
        return [list(pipe.generate(m, max_new_tokens=max_new).token_ids) for m in messages]


def _batched_answers(engine, messages, max_new):
    manifest = read_manifest(engine)
    tok = Tokenizer.from_engine(engine, manifest)
    with BatchedTarget(engine, manifest) as target:
        return target.greedy([tok.encode_chat(m) for m in messages], max_new)


def test_batched_answers_equal_the_runtimes(tiny_engine):
    # Prompts of five lengths in one batch: each row's answer is the one the runtime gives alone.
    assert _batched_answers(tiny_engine, MESSAGES, 24) == _runtime_answers(tiny_engine, MESSAGES, 24)


@pytest.mark.slow
def test_batched_answers_equal_the_runtimes_on_the_default(default_engine):
    messages = [[{"role": "user", "content": c}] for c in (
        "What is a volcano?", "Write a haiku about tea.",
        "Explain in detail how a bicycle gear system works, step by step, for a child.", "Hello")]
    batched = _batched_answers(default_engine, messages, 48)
    assert batched == _runtime_answers(default_engine, messages, 48)
    assert any(a[-1] == 2 for a in batched) or all(len(a) == 48 for a in batched)


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_run_resumes_and_packs(tiny_engine, tmp_path):
    work, out = tmp_path / "work", tmp_path / "answers.npz"
    base = dict(target_engine=tiny_engine, work=work, prompts=12, copy_prompts=0, max_new_tokens=8, batch=3,
                per_shard=4)
    stats = run(DataOptions(answers=8, **base), progress=lambda s: None)
    shards = written(work)
    assert len(shards) == 2 and stats["answered_before"] == 0
    before = [_digest(p) for p in shards]
    # A kill mid-append leaves a cut line: the next start drops it and goes on.
    with open(work / "prompts.jsonl", "ab") as f:
        f.write(b'{"kind": "prompt", "mess')
    stats = run(DataOptions(answers=12, output=out, **base), progress=lambda s: None)
    shards = written(work)
    assert stats["answered_before"] == 8 and len(shards) == 3
    assert [_digest(p) for p in shards[:2]] == before  # the answered shards are not redone
    records = read_prompts(work / "prompts.jsonl")
    assert len(records) == 12 and all(r["kind"] == "prompt" for r in records)
    manifest = read_manifest(tiny_engine)
    answers = load_answers(out, manifest, 8)
    assert len(answers) == 12 and set(answers.kinds.tolist()) == {KINDS.index("prompt")}
    tok = Tokenizer.from_engine(tiny_engine, manifest)
    prompt, answer = answers.pair(5)
    assert prompt == tok.encode_chat(records[5]["messages"])
    assert answer == _runtime_answers(tiny_engine, [records[5]["messages"]], 8)[0]
    # --pack-first: the grown folder packs its first answers again, at the same indices.
    first = tmp_path / "first7.npz"
    said = []
    run(DataOptions(answers=1, output=first, pack_first=7, **base), progress=said.append)
    assert any("12 prompts answered" in x and "12 answers recorded; --answers 1 asks for no more" in x
               for x in said), said
    head = load_answers(first, manifest, 8)
    assert len(head) == 7 and [head.pair(i) for i in range(7)] == [answers.pair(i) for i in range(7)]
    assert head.kinds.tolist() == answers.kinds[:7].tolist()
    with pytest.raises(ExportError, match="holds 12 answers"):
        run(DataOptions(answers=1, output=first, pack_first=13, **base), progress=lambda s: None)
    with pytest.raises(ExportError, match="with --output"):
        DataOptions(answers=1, pack_first=3, **base)


def test_a_prompts_file_that_lost_or_changed_records_is_rebuilt_from_the_shards(tiny_engine, tmp_path):
    """A prompts file restored from an older copy while a run appended to it (lines missing, a
    line that is not the prompt its shard answered) is reconciled with the shards at the next
    start: the answered prompts' records are rebuilt from their tokens, and the run goes on."""
    work = tmp_path / "work"
    base = dict(target_engine=tiny_engine, work=work, prompts=12, copy_prompts=0, max_new_tokens=6, batch=4,
                per_shard=4)
    run(DataOptions(answers=8, **base), progress=lambda s: None)
    path = work / "prompts.jsonl"
    good = read_prompts(path)
    damaged = good[:5]
    damaged[2] = {"kind": "magpie", "messages": [{"role": "user", "content": "not the prompt shard 0 answered"}]}
    path.write_text("".join(json.dumps(r) + "\n" for r in damaged))
    said: list[str] = []
    run(DataOptions(answers=8, **base), progress=said.append)
    assert any("4 of the 8 answered prompts' records" in s for s in said), said
    fixed = read_prompts(path)
    assert len(fixed) == 8
    assert [(r["kind"], r["messages"][-1]["content"]) for r in fixed] == [
        (r["kind"], r["messages"][-1]["content"]) for r in good]
    assert [i for i, r in enumerate(fixed) if "recovered" in r] == [2, 5, 6, 7]
    run(DataOptions(answers=12, **base), progress=lambda s: None)  # goes on after them
    assert len(written(work)) == 3 and len(read_prompts(path)) == 12
    said.clear()
    run(DataOptions(answers=12, **base), progress=said.append)
    assert not any("rebuilt" in s for s in said)


def test_a_prompt_holding_unicode_line_separators_reads_back_as_one_record(tmp_path):
    """A self-written message may hold U+2028, U+2029 or U+0085 as they are (JSON allows them in
    a string): the prompts file is JSON lines, split at "\n" only, so the record stays one."""
    from dspark_export.data_engine import _append
    from dspark_edge.errors import ManifestError
    from dspark_edge.strict_json import read_jsonl

    path = tmp_path / "prompts.jsonl"
    records = [{"kind": "magpie", "messages": [{"role": "user", "content": f"one{sep}two"}], "seed": i}
               for i, sep in enumerate(("\u2028", "\u2029", "\x85", "\x0c"))]
    _append(path, records[:2])
    _append(path, records[2:])
    assert read_prompts(path) == records
    assert [rec for _, rec in read_jsonl(path, ManifestError)] == records


def test_work_folder_of_other_options_is_refused(tiny_engine, tmp_path):
    work = tmp_path / "work"
    run(DataOptions(target_engine=tiny_engine, work=work, answers=2, prompts=2, copy_prompts=0, max_new_tokens=4),
        progress=lambda s: None)
    listing = sorted(p.name for p in work.rglob("*"))
    with pytest.raises(ExportError, match="max_new_tokens differ"):
        run(DataOptions(target_engine=tiny_engine, work=work, answers=4, prompts=2, copy_prompts=0, max_new_tokens=5),
            progress=lambda s: None)
    assert sorted(p.name for p in work.rglob("*")) == listing


def test_self_written_messages_that_never_end_stop_the_run(tiny_engine, tmp_path):
    # A random model never ends a user message: every batch is dropped, and the run stops with
    # an error naming the fix instead of drawing forever; what was answered is kept.
    work = tmp_path / "work"
    with pytest.raises(ExportError, match="all dropped.*unfinished"):
        run(DataOptions(target_engine=tiny_engine, work=work, answers=6, prompts=2, copy_prompts=0,
                        max_new_tokens=4, per_shard=2, batch=4, magpie_tokens=4), progress=lambda s: None)
    assert len(written(work)) == 1


def test_message_filter():
    f = MessageFilter(held_out=["Write a Python function that checks whether a string is a palindrome"],
                      seen=["What is the moon made of?"])
    assert f.keep("How do I bake sourdough bread at home?", ended=True)
    assert not f.keep("How do I bake sourdough bread at home", ended=False)
    assert not f.keep("  how do I   BAKE sourdough bread at home?  ", ended=True)  # folded duplicate
    assert not f.keep("what is the moon made of?", ended=True)  # seen in an earlier run
    assert not f.keep("Hi there", ended=True)
    assert not f.keep(" ".join(["word"] * 121), ended=True)
    assert not f.keep("Tell me <|im_start|> something please", ended=True)
    assert not f.keep("Какой сегодня день недели, скажи?", ended=True)
    assert not f.keep("Write a Python function that checks whether a string is a palindrome quickly", ended=True)
    assert f.dropped == {"unfinished": 1, "duplicate": 2, "length": 2, "special text": 1, "not plain text": 1,
                         "near a benchmark prompt": 1}


@pytest.mark.parametrize("field,value,match", [
    ("answers", 0, "--answers must be at least 1"), ("batch", 0, "--batch"), ("copy_prompts", -1, "--copy-prompts"),
    ("temperature", 0.0, "--temperature"), ("top_p", 1.5, "--top-p"),
    ("batch", 33, "at most 32 rows .* --backend torch")])
def test_options_are_checked(tiny_engine, tmp_path, field, value, match):
    with pytest.raises(ExportError, match=match):
        DataOptions(target_engine=tiny_engine, work=tmp_path / "w", **{field: value})
    assert not (tmp_path / "w").exists()


def test_not_an_engine_folder(tmp_path):
    with pytest.raises(ExportError, match="not an engine folder"):
        DataOptions(target_engine=tmp_path, work=tmp_path / "w")


def test_cli_runs_and_reports(tiny_engine, tmp_path, capsys):
    from dspark_export.__main__ import main

    out = tmp_path / "a.npz"
    assert main(["data", "--target", str(tiny_engine), "--work", str(tmp_path / "w"), "--answers", "3",
                 "--prompts", "3", "--copy-prompts", "0", "--max-new-tokens", "4", "--output", str(out)]) == 0
    err = capsys.readouterr().err
    assert "3/3 answered" in err and f"wrote {out}: 3 answers" in err
    meta = json.loads(str(np.load(out)["meta"]))
    assert meta["answers"] == {"prompt": 3, "copy": 0, "magpie": 0, "task": 0} and meta["max_new_tokens"] == 4
    assert main(["data", "--target", str(tiny_engine), "--work", str(tmp_path / "w"), "--batch", "0"]) == 2
    assert "--batch must be at least 1" in capsys.readouterr().err


def test_a_reexported_graph_of_the_same_model_continues_the_work(tmp_path):
    """The graph's bytes may change with the exporter (same source model, tokenizer and options):
    the answers are the same model's, so the work folder goes on; another model is refused."""
    import json

    from dspark_edge.errors import ExportError
    from dspark_export.data_engine import check_work

    ident = {"model": "m", "source_sha256": "a" * 64, "tokenizer_sha256": "t" * 64, "graph_sha256": "1" * 64,
             "max_new_tokens": 8, "seed": 0, "prompts": 4, "copy_prompts": 0}
    check_work(tmp_path, ident)
    check_work(tmp_path, {**ident, "graph_sha256": "2" * 64})
    assert json.loads((tmp_path / "engine.json").read_text())["graph_sha256"] == "2" * 64
    with pytest.raises(ExportError, match="source_sha256"):
        check_work(tmp_path, {**ident, "graph_sha256": "3" * 64, "source_sha256": "b" * 64})


def _torch_answers(engine, source, messages, max_new):
    from dspark_export.data_engine import TorchTarget

    manifest = read_manifest(engine)
    tok = Tokenizer.from_engine(engine, manifest)
    with TorchTarget(engine, manifest, source=str(source)) as target:
        return target.greedy([tok.encode_chat(m) for m in messages], max_new)


def test_torch_backend_answers_equal_the_runtimes(tiny_engine, tiny_hf):
    # Left-padded rows of five lengths in one PyTorch batch: each row's answer is the runtime's.
    assert _torch_answers(tiny_engine, tiny_hf, MESSAGES, 24) == _runtime_answers(tiny_engine, MESSAGES, 24)


def test_torch_backend_refuses_another_model_and_a_missing_gpu(tiny_engine, tmp_path):
    import torch

    from dspark_export.data_engine import TorchTarget
    from tests.tiny_model import make_tiny_hf

    other = make_tiny_hf(tmp_path / "other", seed=7)
    with pytest.raises(ExportError, match="is not the model .* was exported from"):
        TorchTarget(tiny_engine, read_manifest(tiny_engine), source=str(other))
    if not torch.cuda.is_available():
        with pytest.raises(ExportError, match="sees no CUDA GPU"):
            TorchTarget(tiny_engine, read_manifest(tiny_engine), source=str(other), device="cuda")


@pytest.mark.parametrize("change, words", [
    ({"backend": "torch", "device": "tpu"}, "--device must be cpu, cuda or cuda:N"),
    ({"device": "cuda"}, "pass --backend torch with them"),
    ({"source": "other.gguf"}, "pass --backend torch with them"),
    ({"backend": "onnx"}, "--backend must be one of genai, torch")])
def test_backend_options_are_checked(tiny_engine, tmp_path, change, words):
    with pytest.raises(ExportError, match=words):
        DataOptions(target_engine=tiny_engine, work=tmp_path / "w", **change)
    assert not (tmp_path / "w").exists()


def test_torch_backend_run_packs_and_never_mixes_with_genai(tiny_engine, tiny_hf, tmp_path):
    work, out = tmp_path / "work", tmp_path / "answers.npz"
    opts = dict(target_engine=tiny_engine, work=work, prompts=6, copy_prompts=2, answers=8, max_new_tokens=8,
                batch=4, per_shard=3)
    stats = run(DataOptions(**opts, backend="torch", source=str(tiny_hf), output=out), progress=lambda s: None)
    assert stats["answered_before"] == 0 and len(written(work)) == 3
    assert json.loads((work / "engine.json").read_text())["backend"] == "torch"
    loaded = load_answers(out, read_manifest(tiny_engine))
    assert "PyTorch" in loaded.meta["made_by"] and len(loaded.prompt_lens) == 8
    assert (np.diff(loaded.offsets) > loaded.prompt_lens).all()  # every prompt got an answer
    with pytest.raises(ExportError, match="backend"):
        run(DataOptions(**{**opts, "answers": 9}), progress=lambda s: None)  # genai into a torch folder


def test_torch_backend_samples_are_seeded(tiny_engine, tiny_hf):
    from dspark_export.data_engine import TorchTarget

    with TorchTarget(tiny_engine, read_manifest(tiny_engine), source=str(tiny_hf)) as target:
        a = target.sample([1, 5, 9], 4, 10, 1.0, 0.95, seed=3)
        assert a == target.sample([1, 5, 9], 4, 10, 1.0, 0.95, seed=3)
        assert len({tuple(r) for r in a}) > 1 and a != target.sample([1, 5, 9], 4, 10, 1.0, 0.95, seed=4)


PROSE = ("Rain gardens collect the water that runs off roofs and streets. They are planted with grasses and "
         "flowers that like wet soil, and they let the water sink slowly into the ground instead of rushing "
         "into drains. A small one fits in most front yards and costs little to build.")


def test_task_prompts_are_fixed_varied_and_use_the_passages():
    passages = [PROSE.replace("Rain", f"Rain{i}") for i in range(50)]
    recs = task_prompts(200, seed=3, passages=passages)
    assert recs == task_prompts(200, seed=3, passages=passages) != task_prompts(200, seed=4, passages=passages)
    texts = [r["messages"][-1]["content"] for r in recs]
    assert len(texts) == 200 and len(set(texts)) == 200
    with_passage = [t for t in texts if "Rain" in t]
    assert len(with_passage) == 50  # two fifths of 200 would be 80: every passage is used, once
    assert {r["category"] for r in recs} == {"qa", "chat", "story", "summ", "code", "math"}
    assert all(r["messages"][-1]["role"] == "user" for r in recs)
    # Without passages, arithmetic fills a fifth of a large request; nothing repeats.
    big = [r["messages"][-1]["content"] for r in task_prompts(3000)]
    assert len(set(big)) == 3000
    assert sum(r["category"] == "math" for r in task_prompts(3000)) >= 600


def test_answer_passages_take_one_prose_paragraph_per_answer():
    answers = [f"{PROSE}\n\nA second paragraph that is long enough to pass as prose but comes second, "
               f"so it is never taken because one paragraph per answer is the rule here.",
               "Sure!\n\n1. a list\n2. another",  # no prose paragraph
               "short.\n\n" + PROSE]
    assert answer_passages(answers) == [PROSE, PROSE]


def test_task_prompts_near_a_benchmark_prompt_are_left_out():
    near = MessageFilter(held_out=["Write a short story about a robot who learns to paint."])
    assert near.near_benchmark("Write a short story about a robot who learns to dance.")
    assert not near.near_benchmark("Solve for x: 3x + 2 = 11. Explain each step.")
    assert not near.dropped  # asking is not dropping


def _answers_file(engine, path, texts):
    """An answers file of ``engine`` whose answers are ``texts`` (as if the target wrote them)."""
    manifest = read_manifest(engine)
    tok = Tokenizer.from_engine(engine, manifest)
    work = path.parent / "passage-work"
    opts = DataOptions(target_engine=engine, work=work, output=path, max_new_tokens=8)
    check_work(work, engine_identity(manifest, engine, opts))
    (work / "answers").mkdir()
    prompts = [tok.encode_chat([{"role": "user", "content": f"question {i}"}]) for i in range(len(texts))]
    _write_shard(work / "answers" / "shard-00000.npz", prompts, [tok.encode(t) for t in texts],
                 ["magpie"] * len(texts))
    return pack(work, manifest, opts, progress=lambda s: None)


def test_a_run_answers_task_prompts_over_passages_and_refuses_other_passages(tiny_engine, tmp_path):
    second = PROSE.replace("Rain gardens", "Green roofs")
    passages = _answers_file(tiny_engine, tmp_path / "p.npz", [PROSE, "Sure!\n\n1. a list", second])
    work, out = tmp_path / "work", tmp_path / "tasks.npz"
    base = dict(target_engine=tiny_engine, work=work, prompts=0, copy_prompts=0, tasks=5, max_new_tokens=4,
                batch=3, per_shard=5)
    run(DataOptions(answers=5, passages=passages, output=out, **base), progress=lambda s: None)
    records = read_prompts(work / "prompts.jsonl")
    assert [r["kind"] for r in records] == ["task"] * 5
    texts = [r["messages"][-1]["content"] for r in records]
    assert sum(PROSE in t for t in texts) == 1 and sum(second in t for t in texts) == 1  # 2 of 5: two fifths
    answers = load_answers(out, read_manifest(tiny_engine), 4)
    assert set(answers.kinds.tolist()) == {KINDS.index("task")}
    assert json.loads(str(np.load(out)["meta"]))["answers"]["task"] == 5
    assert json.loads((work / "engine.json").read_text())["tasks"] == 5
    # Other passages would make other prompts: the folder is refused, nothing in it changed.
    other = _answers_file(tiny_engine, tmp_path / "other" / "q.npz", [second])
    listing = sorted((p.name, p.stat().st_size) for p in work.rglob("*"))
    with pytest.raises(ExportError, match="passages_sha256 differ"):
        run(DataOptions(answers=8, passages=other, **base), progress=lambda s: None)
    assert sorted((p.name, p.stat().st_size) for p in work.rglob("*")) == listing


def test_passages_need_tasks_and_an_existing_file(tiny_engine, tmp_path):
    with pytest.raises(ExportError, match="pass --tasks N"):
        DataOptions(target_engine=tiny_engine, work=tmp_path / "w", passages=tmp_path / "a.npz")
    with pytest.raises(ExportError, match="does not exist"):
        DataOptions(target_engine=tiny_engine, work=tmp_path / "w", tasks=4, passages=tmp_path / "a.npz")


def test_openers_start_the_self_written_messages(tiny_engine, tmp_path):
    """With ``openers`` the target continues an opening after the user turn's start: the message
    is the opening and its continuation, the record names the opening, and the opening depends
    on the prompt index alone (a resumed run draws what an uninterrupted one would)."""
    from dataclasses import replace

    from dspark_export.data_engine import _magpie_batch, user_turn_prefix
    from dspark_export.drafter.prompts import MESSAGE_OPENERS

    manifest = read_manifest(tiny_engine)
    tok = Tokenizer.from_engine(tiny_engine, manifest)
    tail = tok.encode(" the sea and the ships")

    class Fake:
        eos_ids = {int(manifest.tokenizer.eos_ids[0])}

        def __init__(self):
            self.prefixes = []

        def sample(self, prefix, rows, max_new, temperature, top_p, seed):
            self.prefixes.append(list(prefix))
            return [tail + [next(iter(self.eos_ids))] for _ in range(rows)]

    prefix = user_turn_prefix(tok)
    opts = DataOptions(target_engine=tiny_engine, work=tmp_path / "w", openers=True, batch=3)
    stats = {"magpie_drawn": 0, "magpie_kept": 0, "magpie_s": 0.0}
    fake = Fake()
    out = _magpie_batch(fake, tok, prefix, MessageFilter([]), opts, 40, stats)
    opener = out[0]["opener"]
    assert opener in MESSAGE_OPENERS and len(out) == 1  # the other two rows repeat it: duplicates
    assert fake.prefixes[0] == prefix + tok.encode(opener)
    assert out[0]["messages"][0]["content"] == tok.decode(tok.encode(opener) + tail).strip()
    assert out[0]["messages"][0]["content"].startswith(opener)
    again = _magpie_batch(Fake(), tok, prefix, MessageFilter([]), opts, 40, dict(stats))
    assert again[0]["opener"] == opener  # the same index draws the same opening
    openings = {_magpie_batch(Fake(), tok, prefix, MessageFilter([]), opts, i, dict(stats))[0]["opener"]
                for i in range(0, 300, 3)}
    assert len(openings) > 10  # spread over the list
    plain = _magpie_batch(Fake(), tok, prefix, MessageFilter([]), replace(opts, openers=False), 40, dict(stats))
    assert "opener" not in plain[0] and plain[0]["messages"][0]["content"] == tok.decode(tail).strip()
    # a work folder is made with or without openers, never both
    work = tmp_path / "work"
    run(DataOptions(target_engine=tiny_engine, work=work, answers=2, prompts=2, copy_prompts=0, max_new_tokens=4),
        progress=lambda s: None)
    with pytest.raises(ExportError, match="openers differ"):
        run(DataOptions(target_engine=tiny_engine, work=work, answers=4, prompts=2, copy_prompts=0, max_new_tokens=4,
                        openers=True), progress=lambda s: None)
