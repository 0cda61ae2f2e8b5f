"""Verification rules on hand-built logits (−inf forces accept/reject where we want it)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_edge.verify import verify_greedy, verify_sampling

V = 8
NEG = -np.inf


def forcing(rows: list[int]) -> np.ndarray:
    """Logits whose row i puts all mass on token rows[i]."""
    out = np.full((len(rows), V), NEG, dtype=np.float32)
    for i, t in enumerate(rows):
        out[i, t] = 0.0
    return out


def test_greedy_full_accept_gives_bonus():
    o = verify_greedy(np.array([3, 4, 5]), forcing([3, 4, 5, 6]))
    assert (o.accepted, o.tokens, o.bonus) == (3, (3, 4, 5, 6), True)


def test_greedy_reject_at_second_position_takes_target_token():
    o = verify_greedy(np.array([3, 1, 5]), forcing([3, 4, 5, 6]))
    assert (o.accepted, o.tokens, o.bonus) == (1, (3, 4), False)


def test_greedy_reject_first_and_no_drafts():
    assert verify_greedy(np.array([2]), forcing([7, 0])).tokens == (7,)
    o = verify_greedy(np.zeros(0, dtype=np.int64), forcing([5]))
    assert (o.accepted, o.tokens, o.bonus) == (0, (5,), True)


@pytest.mark.parametrize("q", [None, "dist"])
def test_sampling_forced_accept_and_reject(q):
    rng = np.random.default_rng(0)
    drafts = np.array([3, 4, 2])
    qd = None
    if q == "dist":
        qd = np.zeros((3, V))
        qd[np.arange(3), drafts] = 1.0
    # p puts all mass on 3, 4 then 5: drafts 1-2 always accepted, draft 3 (=2) always rejected
    o = verify_sampling(drafts, qd, forcing([3, 4, 5, 6]), 1.0, 0, 1.0, rng)
    assert (o.accepted, o.tokens, o.bonus) == (2, (3, 4, 5), False)
    o = verify_sampling(drafts[:2], None if qd is None else qd[:2], forcing([3, 4, 6]), 1.0, 0, 1.0, rng)
    assert (o.accepted, o.tokens, o.bonus) == (2, (3, 4, 6), True)


def test_residual_excludes_rejected_token():
    """p uniform on {1, 2}; the draft proposed 1 deterministically: when rejected, 2 follows."""
    logits = np.full((2, V), NEG, dtype=np.float32)
    logits[0, [1, 2]] = 0.0
    logits[1, 0] = 0.0
    seen = set()
    for s in range(200):
        o = verify_sampling(np.array([1]), None, logits, 1.0, 0, 1.0, np.random.default_rng(s))
        if o.accepted == 0:
            assert o.tokens == (2,)
        seen.add(o.accepted)
    assert seen == {0, 1}


def test_zero_residual_falls_back_to_p():
    """q == p: the residual is empty; a rejection (impossible here, but guarded) draws from p."""
    logits = np.full((2, V), NEG)
    logits[0, :2] = np.log(0.5)
    logits[1, 0] = 0.0
    q = np.exp(logits[:1])
    o = verify_sampling(np.array([0]), q, logits.astype(np.float32), 1.0, 0, 1.0, np.random.default_rng(1))
    assert o.accepted == 1


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 6), st.integers(0, 10_000), st.sampled_from([0.0, 0.7, 1.0]))
def test_accepted_prefix_never_exceeds_drafts(k, seed, temperature):
    rng = np.random.default_rng(seed)
    drafts = rng.integers(0, V, size=k)
    logits = rng.normal(size=(k + 1, V)).astype(np.float32) * 3
    if temperature == 0.0:
        o = verify_greedy(drafts, logits)
    else:
        q = rng.dirichlet(np.ones(V), size=k)
        o = verify_sampling(drafts, q, logits, temperature, 0, 1.0, rng)
    assert 0 <= o.accepted <= k and len(o.tokens) == o.accepted + 1
    assert list(o.tokens[:o.accepted]) == list(drafts[:o.accepted])
    assert o.bonus == (o.accepted == k)


def _first_token_freq(p_logits, q, n, seed=0, rule=verify_sampling):
    rng = np.random.default_rng(seed)
    counts = np.zeros(V)
    for _ in range(n):
        x = rng.choice(V, p=q)
        o = rule(np.array([x]), q[None, :], p_logits, 1.0, 0, 1.0, rng)
        counts[o.tokens[0]] += 1
    return counts / n


def test_first_token_follows_target_distribution():
    """Drafts from a poor q; the first committed token is distributed as p (4 sigma)."""
    rng = np.random.default_rng(42)
    p = rng.dirichlet(np.ones(V))
    q = rng.dirichlet(np.ones(V) * 0.3)
    logits = np.log(np.stack([p, p])).astype(np.float32)
    n = 20000
    freq = _first_token_freq(logits, q, n)
    sigma = np.sqrt(p * (1 - p) / n)
    assert np.all(np.abs(freq - p) < 4 * sigma + 1e-3)
    # and the check has teeth: always accepting the draft gives q, not p
    def accept_all(drafts, qd, lg, t, k, tp, r):
        return verify_sampling(drafts, qd, np.log(np.maximum(qd[[0, 0]], 1e-30)).astype(np.float32), t, k, tp, r)
    bad = _first_token_freq(logits, q, n, rule=accept_all)
    assert np.any(np.abs(bad - p) > 4 * sigma + 1e-3)
