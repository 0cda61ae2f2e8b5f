"""Choosing a token from logits: greedy, or sampling after temperature, top-k and top-p.

Pure functions; every random draw takes an explicit ``numpy.random.Generator``. The same
``probs`` function will turn target and draft logits into p and q for verification, so
both see identical filtering.
"""

from __future__ import annotations

import numpy as np


def probs(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """The sampling distribution for ``logits`` ([V]) as float64 summing to 1.

    temperature > 0; top_k = 0 and top_p = 1 disable those filters. Filtered-out tokens get
    probability exactly 0.
    """
    z = logits.astype(np.float64)
    vocab = z.shape[-1]
    # A tiny temperature may overflow (handled below); z - top may then overflow to -inf: exp 0.
    with np.errstate(over="ignore"):
        z /= temperature
        top = z.max()
        if not np.isfinite(top):  # overflow: the limit as temperature -> 0 is the argmax (ties share)
            p = (logits == logits.max()).astype(np.float64)
            if 0 < top_k < vocab:
                p = np.where(z >= np.partition(z, vocab - top_k)[vocab - top_k], p, 0.0)
        elif 0 < top_k < vocab:  # exp of the k kept entries only; the others are exactly 0
            kept = np.flatnonzero(z >= np.partition(z, vocab - top_k)[vocab - top_k])
            p = np.zeros_like(z)
            p[kept] = np.exp(z[kept] - top)
        else:
            z -= top
            p = np.exp(z, out=z)
    p /= p.sum()
    if top_p < 1.0:
        order = _nucleus(p, top_p)
        mask = np.zeros_like(p, dtype=bool)
        mask[order] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return p


def _nucleus(p: np.ndarray, top_p: float) -> np.ndarray:
    """The smallest set of most likely tokens with mass >= ``top_p`` (ties in index order):
    the prefix of a stable sort of ``p`` by decreasing probability, found by sorting only a
    set of candidates that holds it — the 64 largest entries (with their ties), else every
    entry of at least (1 - top_p) / V (the rest have mass below 1 - top_p together), else
    every entry with mass (after top-k often 64 or fewer). The candidates come first in the
    full sort, in the same order, so the prefix and its cumulative sums are the full sort's,
    bit for bit; a full sort of a 49k vocabulary costs several ms a token."""
    vocab = p.shape[0]
    tries = []
    if np.count_nonzero(p) > 64:  # (after top-k, often not: then a partition of zeros is only slow)
        t = np.partition(p, vocab - 64)[vocab - 64]  # the 64th largest
        tries.append(np.flatnonzero(p >= t))
        tries.append(np.flatnonzero(p >= (1.0 - top_p) / vocab))
    tries.append(np.flatnonzero(p > 0))  # after rounding, the positive entries hold it all
    for i, cand in enumerate(tries):
        order = cand[np.argsort(-p[cand], kind="stable")]
        cum = np.cumsum(p[order])
        if cum[-1] >= top_p or i == len(tries) - 1:
            # Past the last positive entry only zeros follow, which the mask leaves at zero anyway.
            return order[:min(int(np.searchsorted(cum, top_p, side="left")) + 1, order.shape[0])]
    raise AssertionError("unreachable")


def top_margin(p: np.ndarray) -> tuple[int, float]:
    """The most likely token of a distribution and its lead over the second: p[top] minus the
    largest other entry (0 for a tie)."""
    i = int(np.argmax(p))
    return i, float(p[i] - max(p[:i].max(initial=0.0), p[i + 1:].max(initial=0.0)))


def greedy_margin(logits: np.ndarray) -> tuple[int, float]:
    """``top_margin(probs(logits, 1.0))`` at a quarter of the cost, for greedy drafting: the
    softmax in float32 (margins agree to about 1e-6; the token is the same argmax)."""
    i = int(np.argmax(logits))
    e = np.exp(logits - logits[i], dtype=np.float32)
    lead = 1.0 - max(e[:i].max(initial=0.0), e[i + 1:].max(initial=0.0))
    return i, float(lead / e.sum(dtype=np.float64))


def greedy_top(logits: np.ndarray) -> tuple[int, float]:
    """The argmax of ``logits`` and its probability under ``probs(logits, 1.0)``, the softmax in
    float32 (for greedy drafting, which needs no other entry of the distribution)."""
    i = int(np.argmax(logits))
    return i, float(1.0 / np.exp(logits - logits[i], dtype=np.float32).sum(dtype=np.float64))


def sample(p: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from the distribution ``p`` ([V], sums to 1)."""
    u = rng.random()
    idx = int(np.searchsorted(np.cumsum(p), u * p.sum(), side="right"))
    if idx >= p.shape[0]:  # u*sum rounding past the last bucket
        idx = int(np.flatnonzero(p)[-1])
    return idx


def choose(logits: np.ndarray, temperature: float, top_k: int, top_p: float,
           rng: np.random.Generator) -> int:
    """Greedy when ``temperature == 0``, else a sample from ``probs``."""
    if temperature == 0.0:
        return int(np.argmax(logits))
    return sample(probs(logits, temperature, top_k, top_p), rng)


def coupled_choice(logits: np.ndarray, temperature: float, top_k: int, top_p: float, seed: int,
                   position: int) -> int:
    """The token at answer ``position`` drawn by an exponential race, argmax p(x) / E_x with
    E ~ Exp(1) seeded by (seed, position): an exact sample of ``probs(logits, ...)`` that is
    a function of the seed and the position alone, so any decoding order that reaches this
    position with the same prefix draws the same token."""
    return coupled_pick(probs(logits, temperature, top_k, top_p), seed, position)


def coupled_pick(p: np.ndarray, seed: int, position: int) -> int:
    """argmax p(x) / E_x with the noise of (seed, position): a drafter that picks its draft for
    that position this way (from its own q) matches the target's pick whenever q is close to p."""
    e = np.random.default_rng([seed, position]).standard_exponential(p.shape[0])
    return int(np.argmax(p / e))
