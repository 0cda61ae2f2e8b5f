"""``ngram+dspark``: per round the n-gram drafts or the DSpark drafter's, exact either way; the
DSpark drafter's context, fed in one piece after rounds it sat out, is the one it builds round
by round; the choice follows each side's expected worth."""

from __future__ import annotations

import numpy as np
import pytest

import dspark_edge
from dspark_edge.drafters import create
from dspark_edge.drafters.base import Draft, DraftRequest
from dspark_edge.drafters.ngram_dspark import NgramDSparkDrafter
from dspark_edge.widths import expected_accepted
from dspark_edge.manifest import read_manifest
from dspark_edge.widths import Yardstick

REPEAT = "one two three four five six one two three four five six one two three four"


@pytest.mark.parametrize("scheduled", [False, True])
def test_greedy_output_is_plain_output_and_both_drafters_draft(tiny_with_drafter, scheduled):
    engine, _, _ = tiny_with_drafter
    plain = dspark_edge.load(engine, "fp32")
    spec = dspark_edge.load(engine, "fp32", drafter="ngram+dspark", scheduler=None if scheduled else False)
    assert isinstance(spec.drafter, NgramDSparkDrafter)
    if scheduled:  # draft every round at the widest width: the timings must not decide the test
        from forced_width import ForcedWidthScheduler

        spec.scheduler = ForcedWidthScheduler(spec.scheduler, lambda c: min(4, len(c) + 1), "test: drafts")
    kw = {} if scheduled else {"draft_tokens": 3}
    for prompt in [REPEAT, "The quick brown fox", "def add(a, b):"]:
        want = plain.generate(prompt, max_new_tokens=40, ignore_eos=True)
        got = spec.generate(prompt, max_new_tokens=40, ignore_eos=True, **kw)
        assert got.token_ids == want.token_ids
    rounds = spec.drafter.rounds_by_source
    assert rounds["ngram"] > 0 and rounds["dspark"] > 0, rounds
    # Sampling stays reproducible for a seed.
    a = spec.generate(REPEAT, max_new_tokens=20, temperature=0.8, seed=3, **kw)
    b = spec.generate(REPEAT, max_new_tokens=20, temperature=0.8, seed=3, **kw)
    assert a.token_ids == b.token_ids


def _request(context, hidden, k=3):
    return DraftRequest(context=context, max_tokens=k, temperature=0.0, top_k=0, top_p=1.0, new_hidden=hidden,
                        position=len(context) - 1)


def _rows_and_context(engine):
    """(manifest, 14 rows of made-up target features, a 15-token context) for the drafter's context tests."""
    m = read_manifest(engine)
    rng = np.random.default_rng(0)
    width = m.model.hidden_size * len(m.drafter.feature_layers)
    rows = rng.standard_normal((14, width)).astype(np.float32) * 3
    return m, rows, [int(t) for t in rng.integers(3, m.model.vocab_size, 15)]


def test_hidden_rows_handed_over_late_give_the_same_drafts(tiny_with_drafter):
    engine, _, _ = tiny_with_drafter
    m, rows, ctx = _rows_and_context(engine)
    steady, late = create("dspark", m, engine_dir=engine), create("dspark", m, engine_dir=engine)
    for d in (steady, late):
        d.begin(ctx[:6])
    g = np.random.default_rng(1)
    steady.propose(_request(ctx[:6], rows[:5]), g)
    steady.propose(_request(ctx[:10], rows[5:9]), g)
    last = steady.propose(_request(ctx[:15], rows[9:14]), g)
    late.propose(_request(ctx[:6], rows[:5]), g)
    caught_up = late.propose(_request(ctx[:15], rows[5:14]), g)  # the rows of two rounds at once
    assert np.array_equal(caught_up.tokens, last.tokens)
    assert np.allclose(caught_up.confidence, last.confidence, atol=1e-4)


class _Fixed:
    """A stand-in drafter proposing fixed drafts and confidences."""

    name, needs_hidden, observed_confidence = "fixed", False, True

    def __init__(self, tokens, confidence):
        self.draft = Draft(np.asarray(tokens, dtype=np.int64), None, np.asarray(confidence, dtype=np.float64))
        self.seen = []

    def begin(self, prompt_ids):
        pass

    def propose(self, request, rng):
        self.seen.append(None if request.new_hidden is None else request.new_hidden.shape[0])
        return self.draft.trimmed(request.max_tokens)

    def feedback(self, drafted, accepted, committed):
        pass


def test_the_choice_follows_the_expected_worth_and_the_rows_wait_for_dspark():
    ys = Yardstick(cost=lambda w: 10.0 + w, widths=(1, 2, 3, 4))
    ngram, dspark = _Fixed([5, 6, 7], [0.9, 0.9, 0.9]), _Fixed([8, 9, 10], [0.5, 0.5, 0.5])
    d = NgramDSparkDrafter(ngram, dspark)
    g = np.random.default_rng(0)
    hidden = lambda n: np.zeros((n, 4), dtype=np.float32)  # noqa: E731
    req = lambda n: DraftRequest(context=[1] * 8, max_tokens=3, temperature=0.0, top_k=0, top_p=1.0,  # noqa: E731
                                 new_hidden=hidden(n), yardstick=ys)
    assert d.propose(req(4), g).source == "dspark"  # nothing on record for DSpark yet: it drafts
    d.feedback(3, 0, [1] * 8)  # ... and none of its drafts was accepted
    first = d.propose(req(2), g)
    assert first.source == "ngram" and list(first.tokens) == [5, 6, 7]
    d.feedback(3, 3, [1] * 11)
    assert d.propose(req(3), g).source == "ngram"
    d.feedback(3, 3, [1] * 14)
    # n-gram drafts worth less than DSpark's record: DSpark drafts and gets every row since its last round.
    ngram.draft = Draft(np.asarray([5], dtype=np.int64), None, np.asarray([0.01]))
    d.mean_accepted = 2.5
    assert d.propose(req(1), g).source == "dspark"
    assert dspark.seen == [4, 6]
    assert expected_accepted(np.array([0.5, 0.5])) == pytest.approx(0.75)


# -- ngram+dspark+self: the cheap drafts in front of the self drafter's copy --------------------

def _no_failures(caplog):
    failed = [r.getMessage() for r in caplog.records if "failed in" in r.getMessage()]
    assert not failed, failed


@pytest.mark.parametrize("scheduled", [False, True])
def test_ngram_dspark_self_greedy_is_plain_and_the_dspark_context_stays_in_step(tiny_with_drafter, scheduled,
                                                                                caplog):
    from dspark_edge.drafters.self_draft import SelfDrafter

    engine, _, _ = tiny_with_drafter
    plain = dspark_edge.load(engine, "fp32")
    spec = dspark_edge.load(engine, "fp32", drafter="ngram+dspark+self", scheduler=None if scheduled else False)
    d = spec.drafter
    assert isinstance(d, SelfDrafter) and isinstance(d.ngram, NgramDSparkDrafter)
    assert d.needs_hidden and d.name == "ngram+dspark+self:int8"
    assert d.ngram.dspark.precision == "int8"  # the DSpark drafter's INT8 graph, the engine having one
    if scheduled:
        from forced_width import ForcedWidthScheduler

        spec.scheduler = ForcedWidthScheduler(spec.scheduler, lambda c: min(4, len(c) + 1), "test: drafts")
    kw = {} if scheduled else {"draft_tokens": 3}
    for prompt in [REPEAT, "The quick brown fox", "def add(a, b):"]:
        want = plain.generate(prompt, max_new_tokens=40, ignore_eos=True)
        got = spec.generate(prompt, max_new_tokens=40, ignore_eos=True, **kw)
        assert got.token_ids == want.token_ids
        assert got.stats.drafter_disabled is None and got.stats.draft_n > 0
    # The DSpark drafter proposed (its context took every committed position's hidden states:
    # a row missed would have failed its next round, "drafter context out of step").
    assert d.ngram.rounds_by_source["dspark"] > 0
    _no_failures(caplog)


def test_ngram_dspark_self_uses_the_dspark_drafts_where_the_copy_promises_less(tiny_with_drafter, caplog):
    engine, _, _ = tiny_with_drafter
    plain = dspark_edge.load(engine, "fp32")
    spec = dspark_edge.load(engine, "fp32", drafter="ngram+dspark+self", scheduler=False)
    d = spec.drafter
    seen = []

    class Sources:
        def on_round(self, info):
            if info.drafting is not None:
                seen.append(info.drafting["source"])

    spec.add_observer(Sources())
    for prompt in ["The quick brown fox", "Once upon a time"]:
        d.tried[:], d.accepted[:] = 1e6, 0.0  # the copy's drafts never accepted: the cheap ones win
        want = plain.generate(prompt, max_new_tokens=32, ignore_eos=True)
        got = spec.generate(prompt, max_new_tokens=32, ignore_eos=True, draft_tokens=2)
        assert got.token_ids == want.token_ids and got.stats.drafter_disabled is None
    assert "dspark" in seen, seen  # the DSpark drafter's own drafts were verified
    assert "self" not in seen
    _no_failures(caplog)


def test_ngram_dspark_self_hands_the_rows_of_rounds_without_drafts_to_the_dspark_drafter(tiny_with_drafter):
    engine, _, _ = tiny_with_drafter
    m, rows, ctx = _rows_and_context(engine)
    steady = create("dspark:int8", m, engine_dir=engine)
    hybrid = create("ngram+dspark+self", m, engine_dir=engine)
    steady.begin(ctx[:6])
    hybrid.begin(ctx[:6])
    g = np.random.default_rng(1)
    steady.propose(_request(ctx[:6], rows[:5]), g)
    # The pair in front of the copy: no DSpark round on record yet, so the DSpark drafter drafts.
    assert hybrid.ngram.propose(_request(ctx[:6], rows[:5]), g).source == "dspark"
    # A round that drafts nothing (no room for a draft): its rows are kept all the same.
    assert len(hybrid.propose(_request(ctx[:10], rows[5:9], k=0), g)) == 0
    steady.propose(_request(ctx[:10], rows[5:9]), g)
    last = steady.propose(_request(ctx[:15], rows[9:14]), g)
    caught_up = hybrid.ngram.propose(_request(ctx[:15], rows[9:14]), g)
    assert caught_up.source == "dspark" and np.array_equal(caught_up.tokens, last.tokens)
