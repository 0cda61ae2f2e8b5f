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
    with np.errstate(over="ignore"):  # a tiny temperature may overflow: handled below
        z = logits.astype(np.float64) / temperature
    vocab = z.shape[-1]
    if 0 < top_k < vocab:
        kth = np.partition(z, vocab - top_k)[vocab - top_k]
        z = np.where(z >= kth, z, -np.inf)
    top = z.max()
    if not np.isfinite(top):  # overflow: the limit as temperature -> 0 is the argmax (ties share)
        p = (logits == logits.max()).astype(np.float64)
    else:
        p = np.exp(z - top)
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        keep = int(np.searchsorted(cum, top_p, side="left")) + 1  # smallest prefix with mass >= top_p
        mask = np.zeros_like(p, dtype=bool)
        mask[order[:keep]] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return p


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
