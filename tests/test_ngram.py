"""The n-gram (prompt lookup) drafter: proposals continue an earlier occurrence of the suffix."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_edge import ConfigError
from dspark_edge.drafters import DraftRequest, NgramDrafter


def req(ctx, k=4):
    return DraftRequest(context=ctx, max_tokens=k, temperature=0.0, top_k=0, top_p=1.0)


def test_continues_most_recent_longest_match():
    d = NgramDrafter(min_n=1, max_n=3, max_tokens=8)
    ctx = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    d.begin(ctx[:-1])
    draft = d.propose(req(ctx, 3), np.random.default_rng(0))
    assert list(draft.tokens) == [7, 8, 5]  # after the latest earlier "1 2 3"
    assert draft.q is None and draft.confidence.shape == (3,)


def test_no_match_gives_empty_draft():
    d = NgramDrafter(min_n=2, max_n=3)
    d.begin([1, 2, 3])
    assert len(d.propose(req([1, 2, 3, 4]), np.random.default_rng(0))) == 0


def test_bad_sizes_rejected():
    with pytest.raises(ConfigError):
        NgramDrafter(min_n=3, max_n=2)
    with pytest.raises(ConfigError):
        NgramDrafter(max_tokens=0)


def test_context_rewrite_is_handled():
    d = NgramDrafter(min_n=1, max_n=2)
    d.begin([5, 6, 5])
    assert list(d.propose(req([5, 6, 5]), np.random.default_rng(0)).tokens) == [6, 5, 6, 5]
    # a different context (new generation without begin) re-indexes instead of mixing
    assert list(d.propose(req([7, 8, 7]), np.random.default_rng(0)).tokens) == [8, 7, 8, 7]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=60), st.integers(1, 8), st.integers(1, 4))
def test_proposals_are_earlier_continuations(ctx, k, max_n):
    d = NgramDrafter(min_n=1, max_n=max_n, max_tokens=8)
    d.begin(ctx[: len(ctx) // 2])
    draft = d.propose(req(ctx, k), np.random.default_rng(0))
    toks = list(draft.tokens)
    assert len(toks) <= k
    if toks:
        # some n >= 1: the suffix occurred earlier, ending at s, and the draft continues the
        # text from s (periodically past the end of the context)
        def follows(s):
            seq = list(ctx)
            for i in range(len(toks)):
                seq.append(seq[s + i])
            return seq[len(ctx):] == toks
        ok = any(ctx[s - n:s] == ctx[-n:] and follows(s)
                 for n in range(1, max_n + 1) for s in range(n, len(ctx)))
        assert ok
    assert np.all((draft.confidence >= 0) & (draft.confidence <= 1))


def test_repetitive_text_stays_bounded():
    d = NgramDrafter()
    ctx = [3] * 5000
    d.begin(ctx)
    draft = d.propose(req(ctx, 8), np.random.default_rng(0))
    assert list(draft.tokens) == [3] * 8
    assert all(len(ix) <= 1 for ix in d._index.values())  # one n-gram per size: memory stays flat


def test_confidence_is_learned_per_match_length():
    """Long matches that keep being accepted and one-token matches that keep failing end up
    with confidences far apart, so the scheduler verifies the former wider."""
    d = NgramDrafter(min_n=1, max_n=4, max_tokens=4)
    long_ctx = [5, 6, 7, 8, 9, 5, 6, 7, 8]  # suffix 5 6 7 8 matched at length 4
    short_ctx = [1, 2, 3, 1]  # suffix 1 matched at length 1 only
    rng = np.random.default_rng(0)
    d.begin(long_ctx)
    prior_long = d.propose(DraftRequest(long_ctx, 4, 0.0, 0, 1.0), rng).confidence
    d.begin(short_ctx)
    prior_short = d.propose(DraftRequest(short_ctx, 4, 0.0, 0, 1.0), rng).confidence
    assert prior_long[0] > prior_short[0]  # priors rise with the match length
    d = NgramDrafter(min_n=1, max_n=4, max_tokens=4)
    d.begin([0])
    for _ in range(10):
        d.propose(DraftRequest(long_ctx, 4, 0.0, 0, 1.0), rng)
        d.feedback(4, 4, long_ctx)
        d.propose(DraftRequest(short_ctx, 4, 0.0, 0, 1.0), rng)
        d.feedback(2, 0, short_ctx)
    long_c = d.propose(DraftRequest(long_ctx, 4, 0.0, 0, 1.0), rng).confidence
    short_c = d.propose(DraftRequest(short_ctx, 4, 0.0, 0, 1.0), rng).confidence
    assert long_c[0] > 0.9 and short_c[0] < 0.1


def test_extend_continues_past_drafts_and_leaves_the_state_as_it_was():
    """``extend`` looks up a continuation of another drafter's (uncommitted) drafts as
    ``propose`` would were they committed, without indexing them or changing what the next
    round's proposal reads; ``feedback_extension`` judges those drafts by their match length."""
    d = NgramDrafter()
    ctx = [1, 2, 3, 4, 5, 6, 1, 2]  # the last token is the pending one
    d.begin(ctx[:-1])
    rng = np.random.default_rng(0)
    assert d.propose(DraftRequest(ctx, 4, 0.0, 0, 1.0), rng).tokens.tolist() == [3, 4, 5, 6]
    state = (list(d._ctx), {n: dict(i) for n, i in d._index.items()}, d._previous, d._last_n)
    ext = d.extend([3, 4], 3)  # "1 2 3 4" seen before: 5 6, then what followed 6
    assert ext.tokens.tolist() == [5, 6, 1] and ext.confidence.shape == (3,)
    assert d._ext_n == 4
    assert not len(d.extend([9, 9], 3))  # nothing continues an unseen token
    assert (list(d._ctx), {n: dict(i) for n, i in d._index.items()}, d._previous, d._last_n) == state
    d.extend([3, 4], 3)
    d.feedback_extension(3, 1)  # the first accepted, the second rejected
    assert d.stats[4].tried[:3].tolist() == [1, 1, 0] and d.stats[4].accepted[:2].tolist() == [1, 0]
    assert d.stats[2].tried.sum() == 0  # the round's own proposal (a 2-token match) is judged apart
    d.feedback(4, 4, ctx + [3, 4, 5, 6])
    assert d.stats[2].tried[:4].tolist() == [1, 1, 1, 1]
