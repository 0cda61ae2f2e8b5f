"""Property tests (hypothesis): verification, sampling filters, the scheduler's choice and the
n-gram drafter keep their invariants on any input."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from dspark_edge.drafters import DraftRequest
from dspark_edge.drafters.ngram import NgramDrafter
from dspark_edge.sampling import probs
from dspark_edge.scheduler import CostModel, Scheduler, SchedulerConfig, choose_multi, choose_width
from dspark_edge.telemetry import Snapshot
from dspark_edge.verify import verify_greedy, verify_sampling

V = 12
FINITE = st.floats(-30, 30, allow_nan=False, allow_infinity=False)
CONF = st.floats(0, 1, allow_nan=False)
WIDTHS = st.lists(st.integers(2, 9), max_size=5).map(lambda ws: sorted({1, *ws}))


@st.composite
def round_inputs(draw):
    k = draw(st.integers(0, 6))
    drafts = draw(arrays(np.int64, k, elements=st.integers(0, V - 1)))
    logits = draw(arrays(np.float64, (k + 1, V), elements=FINITE))
    return drafts, logits


@settings(max_examples=300, deadline=None)
@given(round_inputs())
def test_greedy_verification_invariants(inp):
    drafts, logits = inp
    out = verify_greedy(drafts, logits)
    k = drafts.shape[0]
    assert 0 <= out.accepted <= k and len(out.tokens) == out.accepted + 1
    assert list(out.tokens[:out.accepted]) == drafts[:out.accepted].tolist()
    assert out.tokens[-1] == int(np.argmax(logits[out.accepted]))  # the target's own choice
    assert out.bonus == (out.accepted == k)
    assert all(0 <= t < V for t in out.tokens)


@settings(max_examples=300, deadline=None)
@given(round_inputs(), st.floats(0.05, 3), st.integers(0, V), st.floats(0.05, 1), st.booleans(), st.integers(0, 2**32 - 1))
def test_sampling_verification_invariants(inp, temperature, top_k, top_p, with_q, seed):
    drafts, logits = inp
    k = drafts.shape[0]
    q = None
    if with_q and k:
        q = np.stack([probs(logits[i] + 1.0, temperature, top_k, top_p) for i in range(k)])
    out = verify_sampling(drafts, q, logits, temperature, top_k, top_p, np.random.default_rng(seed))
    assert 0 <= out.accepted <= k and len(out.tokens) == out.accepted + 1
    assert list(out.tokens[:out.accepted]) == drafts[:out.accepted].tolist()
    # the new token is one the target may emit under the same filters
    p = probs(logits[out.accepted], temperature, top_k, top_p)
    assert p[out.tokens[-1]] > 0
    assert out.bonus == (out.accepted == k)


@settings(max_examples=300, deadline=None)
@given(arrays(np.float64, st.integers(1, 40), elements=st.floats(-1e4, 1e4, allow_nan=False)),
       st.floats(0, 5, exclude_min=True), st.integers(0, 50), st.floats(0.01, 1))
def test_probabilities_stay_normalised(logits, temperature, top_k, top_p):
    p = probs(logits, temperature, top_k, top_p)
    assert p.shape == logits.shape and np.all(p >= 0) and abs(p.sum() - 1.0) < 1e-9
    if top_k:  # ties at the k-th value may keep more; never more than the tied ones
        kth = np.sort(logits)[::-1][min(top_k, logits.shape[0]) - 1]
        assert np.count_nonzero(p) <= np.count_nonzero(logits >= kth)


@settings(max_examples=400, deadline=None)
@given(arrays(np.float64, st.integers(0, 9), elements=CONF), WIDTHS,
       st.lists(st.floats(0.1, 100), min_size=9, max_size=9))
def test_choose_width_returns_a_listed_width_the_drafts_fill(conf, widths, costs):
    w, value = choose_width(conf, widths, lambda width: costs[width - 1])
    assert w in widths and w - 1 <= conf.shape[0] and value > 0


@settings(max_examples=200, deadline=None)
@given(st.lists(arrays(np.float64, st.integers(0, 6), elements=CONF), min_size=1, max_size=4),
       st.floats(0.0, 2.0), st.integers(1, 30))
def test_choose_multi_admits_prefixes_within_budget(confs, slope, cap):
    admitted = choose_multi(confs, lambda n: 10.0 + slope * n, max_total=len(confs) + cap)
    assert len(admitted) == len(confs)
    assert all(0 <= a <= c.shape[0] for a, c in zip(admitted, confs))
    assert sum(admitted) <= cap


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(arrays(np.float64, st.integers(0, 8), elements=CONF),
                          st.floats(-50, 200, allow_nan=False), st.floats(-100, 5e4, allow_nan=False),
                          st.floats(0.1, 500)), min_size=1, max_size=40), WIDTHS)
def test_scheduler_never_leaves_the_listed_widths(rounds, widths):
    """Whatever the confidences, temperatures, memory and observed step times, every decision
    is a listed width that the offered drafts can fill."""
    sched = Scheduler(CostModel({w: 10.0 + w for w in widths}, 0.0), widths, SchedulerConfig())
    for conf, temp, mem, ms in rounds:
        snap = Snapshot(t=0.0, mem_total_mb=8000.0, mem_available_mb=mem, temps_c={"cpu": temp})
        offered = conf if sched.wants_draft(snap) else np.zeros(0)
        d = sched.decide(offered, snap)
        assert d.width in widths and d.width - 1 <= offered.shape[0]
        sched.observe(d.width, ms)
        if d.width > 1:
            sched.observe_round(d.width, ms)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=200), st.lists(st.integers(0, 5), max_size=60),
       st.integers(1, 10), st.integers(1, 4), st.integers(0, 3))
def test_ngram_drafter_bounded_and_copies_context(prompt, generated, k, max_n, extra_n):
    d = NgramDrafter(min_n=1, max_n=max_n, max_tokens=8)
    d.begin(prompt)
    ctx = list(prompt)
    rng = np.random.default_rng(0)
    for tok in generated + [0]:
        draft = d.propose(DraftRequest(ctx, k, 0.0, 0, 1.0), rng)
        assert len(draft) <= min(k, 8)
        assert draft.confidence.shape == (len(draft),)
        assert np.all((draft.confidence >= 0) & (draft.confidence <= 1))
        assert set(draft.tokens.tolist()) <= set(ctx)  # it only ever copies the context
        d.feedback(len(draft), min(len(draft), extra_n), ctx)
        ctx.append(tok)
    # the index holds at most one entry per n-gram position of the context
    assert sum(len(ix) for ix in d._index.values()) <= max_n * len(ctx)
