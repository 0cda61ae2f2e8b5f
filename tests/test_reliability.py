"""Reliability cases of the catalogue (docs/RELIABILITY.md) not covered next to their feature:
misbehaving drafters, out-of-vocabulary ids, cancellation, adversarial repetition, a full disk
during export, a misbehaving observer-free pipeline reused after each fault."""

from __future__ import annotations

import errno

import numpy as np
import pytest

import dspark_edge
from dspark_edge.drafters import Draft
from dspark_edge.errors import ConfigError, ExportError


@pytest.fixture(scope="module")
def plain(tiny_engine):
    return dspark_edge.load(tiny_engine, "fp32")


class _Bad:
    """A drafter whose proposals are malformed in one way."""

    name = "bad"
    needs_hidden = False

    def __init__(self, kind: str) -> None:
        self.kind, self.calls = kind, 0

    def begin(self, prompt_ids):
        pass

    def propose(self, request, rng):
        self.calls += 1
        k = request.max_tokens
        toks = np.zeros(k, dtype=np.int64)
        conf = np.full(k, 0.9)
        if self.kind == "out_of_vocab":
            toks[-1] = 10**9
        elif self.kind == "negative":
            toks[0] = -1
        elif self.kind == "nan_confidence":
            conf[0] = np.nan
        elif self.kind == "too_many":
            toks, conf = np.zeros(k + 3, dtype=np.int64), np.full(k + 3, 0.5)
        elif self.kind == "bad_q":
            return Draft(toks, np.ones((k, 3)), conf)
        return Draft(toks, None, conf)

    def feedback(self, drafted, accepted, committed):
        pass


@pytest.mark.parametrize("kind", ["out_of_vocab", "negative", "nan_confidence", "too_many", "bad_q"])
def test_malformed_drafts_disable_speculation_and_output_stays_exact(tiny_engine, plain, kind):
    bad = _Bad(kind)
    spec = dspark_edge.load(tiny_engine, "fp32", drafter=bad, scheduler=False)
    ref = plain.generate("The quick brown", max_new_tokens=12)
    r = spec.generate("The quick brown", max_new_tokens=12, draft_tokens=3)
    assert r.token_ids == ref.token_ids and r.stop_reason == ref.stop_reason
    assert r.stats.drafter_disabled and "consecutive failures" in r.stats.drafter_disabled
    assert r.stats.draft_n == 0 and bad.calls == 3  # three strikes, then plain decoding


def test_stop_token_ids_outside_the_vocabulary(plain):
    vocab = plain.manifest.model.vocab_size
    with pytest.raises(ConfigError, match=rf"outside the vocabulary \(ids 0..{vocab - 1}\)"):
        plain.generate("hi", stop_token_ids=(vocab,))
    with pytest.raises(ConfigError, match="non-negative integers"):
        plain.generate("hi", stop_token_ids=(-1,))
    assert plain.generate("hi", max_new_tokens=2).stats.new_tokens <= 2  # still usable


def test_cancel_mid_stream_returns_the_partial_answer(plain):
    full = plain.generate("The quick brown", max_new_tokens=30, ignore_eos=True)
    stream = plain.stream("The quick brown", max_new_tokens=30, ignore_eos=True)
    pieces = [next(stream)]
    stream.cancel()
    pieces += list(stream)
    r = stream.result
    assert r.stop_reason == "cancelled" and 0 < len(r.token_ids) < 30
    assert r.token_ids == full.token_ids[:len(r.token_ids)] and "".join(pieces) == r.text
    assert plain.generate("The quick brown", max_new_tokens=30, ignore_eos=True).token_ids == full.token_ids


def test_adversarial_repetition_with_the_ngram_drafter(tiny_engine, plain):
    """A long, maximally repetitive prompt: the n-gram drafter neither loops nor grows without
    bound, and the output is still exactly the target's."""
    spec = dspark_edge.load(tiny_engine, "fp32", drafter="ngram")
    prompt = " ".join(["a b"] * 150 + ["a"] * 120)  # ~420 of the tiny context's 512 positions
    ref = plain.generate(prompt, max_new_tokens=48, ignore_eos=True)
    r = spec.generate(prompt, max_new_tokens=48, ignore_eos=True)
    assert r.token_ids == ref.token_ids and len(r.token_ids) == 48
    d = spec.drafter
    ctx = r.stats.prompt_tokens + len(r.token_ids)
    assert sum(len(ix) for ix in d._index.values()) <= (d.max_n - d.min_n + 1) * ctx
    assert r.stats.rounds <= 48


def test_disk_full_during_export_keeps_the_previous_engine(tiny_hf, tmp_path, monkeypatch):
    from dspark_export import ExportOptions, export_target
    import dspark_export.tokenizer

    out = tmp_path / "engine"
    export_target(ExportOptions(source=str(tiny_hf), output=out, precisions=("fp32",), widths=(1, 2),
                                validate=False))
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dspark_export.tokenizer, "write_tokenizer", full)
    with pytest.raises(ExportError, match="no space left on the device") as info:
        export_target(ExportOptions(source=str(tiny_hf), output=out, precisions=("fp32",), widths=(1, 2),
                                    validate=False, overwrite=True))
    assert "is unchanged" in str(info.value)
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before
    assert [p.name for p in tmp_path.iterdir()] == ["engine"]  # no partial folder left behind
    monkeypatch.undo()
    with pytest.raises(ExportError, match="no space left"):  # a fresh folder: nothing appears
        monkeypatch.setattr(dspark_export.tokenizer, "write_tokenizer", full)
        export_target(ExportOptions(source=str(tiny_hf), output=tmp_path / "new", precisions=("fp32",),
                                    widths=(1, 2), validate=False))
    assert not (tmp_path / "new").exists()


def test_stop_string_across_a_token_boundary(tiny_engine, plain):
    """A stop string made of the end of one token and the start of the next ends the answer
    right before it, plain and speculative, and no streamed piece ever shows any of it."""
    full = plain.generate("The quick brown", max_new_tokens=30, ignore_eos=True)
    pieces = [plain.tokenizer.decode([t]) for t in full.token_ids]
    i = next((i for i in range(3, len(pieces) - 1) if len(pieces[i]) >= 1 and len(pieces[i + 1]) >= 1
              and "\ufffd" not in pieces[i] + pieces[i + 1]), None)
    if i is None:
        pytest.skip("the tiny model's tokens decode to no usable boundary")
    stop = pieces[i][-1] + pieces[i + 1][0]
    cut = full.text.find(stop)
    spec = dspark_edge.load(tiny_engine, "fp32", drafter="ngram")
    for pipe, extra in ((plain, {}), (spec, {"draft_tokens": 3})):
        stream = pipe.stream("The quick brown", max_new_tokens=30, ignore_eos=True, stop=(stop,), **extra)
        streamed = list(stream)
        r = stream.result
        assert r.stop_reason == "stop_string" and r.text == full.text[:cut]
        assert "".join(streamed) == r.text and stop not in "".join(streamed)


def test_huge_max_new_tokens_ends_at_the_context(tiny_engine):
    small = dspark_edge.load(tiny_engine, options=dspark_edge.BackendOptions(max_context=48))
    r = small.generate("The quick", max_new_tokens=10**12, ignore_eos=True)
    # every position holds a token in the KV cache except the last one decided (it was never run)
    assert r.stop_reason == "context_full" and r.stats.prompt_tokens + len(r.token_ids) == 48 + 1
    with pytest.raises(ConfigError, match="max_new_tokens must be an integer >= 0"):
        small.generate("The quick", max_new_tokens=-1)


def test_prompts_of_every_length_keep_no_extra_buffers(plain):
    """A long-running process sees prompts of every length: only the decode widths keep output
    buffers ([width, vocab] each), never one per prompt length."""
    for n in range(1, 40):
        plain.generate(" ".join(["word"] * n), max_new_tokens=2)
    session = plain.target.session
    assert set(session._outputs) <= set(plain.target.widths)
