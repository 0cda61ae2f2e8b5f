"""Token choice: filtering keeps distributions normalised; draws come from the given Generator."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from dspark_edge.sampling import choose, probs, sample

logits_st = arrays(np.float32, st.integers(2, 64), elements=st.floats(-30, 30, width=32))


@settings(max_examples=200, deadline=None)
@given(logits_st, st.floats(0.05, 4.0), st.integers(0, 70), st.floats(0.01, 1.0))
def test_probs_normalised_and_filtered(logits, temperature, top_k, top_p):
    p = probs(logits, temperature, top_k, top_p)
    assert p.shape == logits.shape
    assert np.all(p >= 0) and abs(p.sum() - 1.0) < 1e-9
    full = probs(logits, temperature)
    assert np.any((p > 0) & (full >= full.max() * (1 - 1e-12)))  # a most likely token always survives
    if 0 < top_k < logits.shape[0]:
        assert np.count_nonzero(p) <= top_k + int(np.sum(logits == np.sort(logits)[-top_k])) - 1


def test_top_p_keeps_smallest_prefix():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    p = probs(logits, 1.0, 0, 0.8)
    assert np.count_nonzero(p) == 2 and np.isclose(p[0], 0.5 / 0.8)


def test_top_k_one_is_greedy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=100).astype(np.float32)
    for _ in range(20):
        assert choose(logits, 1.0, 1, 1.0, rng) == int(np.argmax(logits))


def test_sampling_a_sparse_distribution_draws_what_the_full_sums_draw():
    """Over the positive entries only (under a quarter of the vocabulary), ``sample`` must pick the
    token the cumulative sums over the whole vocabulary pick, for the same random number."""
    def full_sums(p, rng):
        idx = int(np.searchsorted(np.cumsum(p), rng.random() * p.sum(), side="right"))
        return idx if idx < p.shape[0] else int(np.flatnonzero(p)[-1])

    rng = np.random.default_rng(0)
    for trial in range(300):
        vocab = int(rng.choice([8, 100, 5000]))
        p = np.zeros(vocab)
        kept = rng.choice(vocab, size=max(1, vocab // int(rng.choice([5, 20, 1000]))), replace=False)
        p[kept] = rng.random(kept.shape[0]) ** 3
        p /= p.sum()
        for seed in range(5):
            got = sample(p, np.random.default_rng([trial, seed]))
            assert got == full_sums(p, np.random.default_rng([trial, seed]))
            assert p[got] > 0


def test_probabilities_keep_float32_precision_over_a_large_vocabulary():
    rng = np.random.default_rng(1)
    logits = (rng.standard_normal(49152) * 4).astype(np.float32)
    for t in (0.3, 0.7, 1.0, 2.0):
        z = logits.astype(np.float64) / t
        want = np.exp(z - z.max())
        want /= want.sum()
        got = probs(logits, t)
        # float32 holds the shifted logit x to |x| * 6e-8, which is exp's relative error
        x = np.log(want / want.max(), where=want > 0, out=np.full_like(want, -np.inf))
        some = x > -87.0  # below, float32 exp's results are subnormal (and below e^-104, 0)
        err = np.abs(got[some] / want[some] - 1.0)
        assert np.all(err <= 2e-7 + 1.2e-7 * np.abs(x[some])), t
        likely = x > -14.0  # every token within e^-14 of the most likely one
        assert np.max(np.abs(got[likely] / want[likely] - 1.0)) < 2e-6, t
        assert np.all(got[x < -104.0] == 0.0)
        assert abs(got.sum() - 1.0) < 1e-12


def test_greedy_is_argmax_and_ignores_rng():
    logits = np.array([0.1, 3.0, 2.9], dtype=np.float32)
    assert choose(logits, 0.0, 0, 1.0, np.random.default_rng(1)) == 1
    assert choose(logits, 0.0, 0, 1.0, np.random.default_rng(2)) == 1


def test_sample_follows_distribution_and_seed():
    p = np.array([0.1, 0.0, 0.6, 0.3])
    draws = [sample(p, np.random.default_rng(s)) for s in range(4000)]
    counts = np.bincount(draws, minlength=4) / len(draws)
    assert counts[1] == 0
    np.testing.assert_allclose(counts, p, atol=0.03)
    a = [sample(p, g) for g in [np.random.default_rng(5)] for _ in range(50)]
    b = [sample(p, g) for g in [np.random.default_rng(5)] for _ in range(50)]
    assert a == b


@pytest.mark.parametrize("t", [0.5, 1.0, 2.0])
def test_temperature_scales_logits(t):
    logits = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    expected = np.exp(logits / t) / np.exp(logits / t).sum()
    np.testing.assert_allclose(probs(logits, t), expected, rtol=1e-6)


def test_probs_equal_the_full_sort_bit_for_bit():
    """``probs`` sorts only candidates that hold the nucleus (a full sort of a 49k vocabulary cost
    8 ms a token); its output must be the plainly written filter's, exactly: peaked and flat
    distributions, ties, top-k, overflowing temperatures, vocabularies small and large."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from sampling_cost import probs_by_full_sort

    rng = np.random.default_rng(0)
    for trial in range(1500):
        vocab = int(rng.choice([3, 64, 65, 700, 5000])) if trial % 25 else 49152
        logits = (rng.standard_normal(vocab) * rng.choice([0.05, 1.0, 3.0, 12.0])).astype(np.float32)
        if trial % 3 == 0:
            logits = np.round(logits)  # many ties
        if trial % 7 == 0:
            logits[:3] += 20.0  # a few dominant tokens
        temperature = float(rng.choice([0.3, 0.7, 1.0, 2.0, 1e-308]))
        top_k = int(rng.choice([0, 0, 1, 3, 50, 80]))
        top_p = float(rng.choice([0.1, 0.5, 0.9, 0.95, 0.999999, 1.0]))
        want = probs_by_full_sort(logits, temperature, top_k, top_p)
        got = probs(logits, temperature, top_k, top_p)
        assert np.array_equal(got, want), (trial, vocab, temperature, top_k, top_p)


def test_greedy_margin_is_the_margin_of_the_distribution():
    from dspark_edge.sampling import greedy_margin, top_margin

    rng = np.random.default_rng(1)
    for trial in range(200):
        logits = (rng.standard_normal(int(rng.choice([2, 100, 49152]))) * rng.choice([0.3, 2.0, 6.0])).astype(np.float32)
        if trial % 4 == 0:
            logits[-2:] = logits.max() + rng.choice([0.0, 1e-3, 2.0])  # a tie or a near tie at the top
        token, margin = greedy_margin(logits)
        want_token, want_margin = top_margin(probs(logits, 1.0))
        assert token == want_token == int(np.argmax(logits))
        assert abs(margin - want_margin) < 1e-6
    assert top_margin(np.array([0.4, 0.4, 0.2])) == (0, 0.0)
    assert top_margin(np.array([0.1, 0.2, 0.7])) == (2, pytest.approx(0.5))


def test_greedy_top_is_the_top_probability_of_the_distribution():
    from dspark_edge.sampling import greedy_top

    rng = np.random.default_rng(2)
    for trial in range(200):
        logits = (rng.standard_normal(int(rng.choice([2, 100, 49152]))) * rng.choice([0.3, 2.0, 6.0])).astype(np.float32)
        if trial % 4 == 0:
            logits[-2:] = logits.max() + rng.choice([0.0, 1e-3, 2.0])
        token, top = greedy_top(logits)
        p = probs(logits, 1.0)
        assert token == int(np.argmax(logits)) == int(np.argmax(p))
        assert abs(top - float(p[token])) < 1e-6
