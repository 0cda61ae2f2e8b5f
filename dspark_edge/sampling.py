"""Choosing a token from logits: greedy, or sampling after temperature, top-k and top-p.

Pure functions; every random draw takes an explicit ``numpy.random.Generator``. The same
``probs`` function will turn target and draft logits into p and q for verification, so
both see identical filtering.
"""

from __future__ import annotations

import numpy as np

from .config import TokenLogprob


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
            e = exp_shifted(z[kept] - top)
            p = z  # reused: a fresh 49k-entry array costs more than its arithmetic here
            p.fill(0.0)
            p[kept] = e
        else:
            z -= top
            p = exp_shifted(z, out=z)
    p /= p.sum()
    if top_p < 1.0:
        order = _nucleus(p, top_p)
        kept = p[order]
        p.fill(0.0)
        p[order] = kept
        p[order] /= p.sum()  # the others stay exactly 0
    return p


def exp_shifted(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """exp of logits already shifted by their maximum (x <= 0, float64), computed in float32 —
    numpy's vectorised float32 exp costs a quarter of the float64 one on a 49k vocabulary — and
    widened to float64 (into ``out`` when given, which may be ``x``) for the sums. float32 holds x
    to |x| * 6e-8, so a probability's relative error is about 1e-7 (1 + |x|): under 2e-6 for
    every token within e^-14 of the most likely one. Below e^-87 of it float32 runs out of
    exponent (subnormals, less precise) and below e^-103 the entry becomes 0."""
    e = x.astype(np.float32)
    np.exp(e, out=e)
    if out is None:
        return e.astype(np.float64)
    out[...] = e
    return out


def _nucleus(p: np.ndarray, top_p: float) -> np.ndarray:
    """The smallest set of most likely tokens with mass >= ``top_p`` (ties in index order):
    the prefix of a stable sort of ``p`` by decreasing probability, found by sorting only a
    set of candidates that holds it (``_candidates``). Each candidate set is every entry above
    a threshold, so it comes first in the full sort, in the same order: the prefix and its
    cumulative sums are the full sort's, bit for bit; a full sort of a 49k vocabulary costs
    several ms a token."""
    for cand, last in _candidates(p, top_p):
        order = cand[np.argsort(-p[cand], kind="stable")]
        cum = np.cumsum(p[order])
        if cum[-1] >= top_p or last:
            # Past the last positive entry only zeros follow, which stay zero anyway.
            return order[:min(int(np.searchsorted(cum, top_p, side="left")) + 1, order.shape[0])]
    raise AssertionError("unreachable")


def _candidates(p: np.ndarray, top_p: float):
    """Candidate sets for ``_nucleus``, cheapest first, each with whether it is the last: the
    entries of at least 1/1000 of the largest (a peaked distribution's nucleus, found without a
    partition; skipped when over 4,096), the 64 largest with their ties, every entry of at least
    (1 - top_p) / V (the rest have mass below 1 - top_p together), every entry with mass."""
    vocab = p.shape[0]
    cand = np.flatnonzero(p >= p.max() * 1e-3)
    if cand.shape[0] <= 4096:
        yield cand, False
    if np.count_nonzero(p) > 64:  # (after top-k, often not: then a partition of zeros is only slow)
        yield np.flatnonzero(p >= np.partition(p, vocab - 64)[vocab - 64]), False  # the 64th largest
        yield np.flatnonzero(p >= (1.0 - top_p) / vocab), False
    yield np.flatnonzero(p > 0), True  # after rounding, the positive entries hold it all


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
    """One draw from the distribution ``p`` ([V], sums to 1). Where most entries are 0 (after
    top-k or top-p) the cumulative sums run over the others only: the same sums at the same
    tokens (adding 0 changes no float), so the same draw, at a fraction of the cost."""
    u = rng.random()
    x = u * p.sum()
    positive = p > 0
    if np.count_nonzero(positive) * 4 < p.shape[0]:
        support = np.flatnonzero(positive)
        j = int(np.searchsorted(np.cumsum(p[support]), x, side="right"))
        return int(support[min(j, support.shape[0] - 1)])  # u*sum rounding past the last bucket
    idx = int(np.searchsorted(np.cumsum(p), x, side="right"))
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


def token_logprobs(logits: np.ndarray, tokens, top: int) -> list:
    """``TokenLogprob`` of each of ``tokens`` under the rows of ``logits`` ([n, V], row i the
    distribution token i was chosen from): the log-softmax of the raw logits (float64, before
    temperature and filters), and the ``top`` likeliest tokens of the row, most likely first
    (ties by lower id)."""
    out = []
    for row, tok in zip(logits, tokens):
        z = row.astype(np.float64)
        top_z = z.max()
        lse = top_z + np.log(exp_shifted(z - top_z).sum())
        best: tuple[tuple[int, float], ...] = ()
        if top > 0:
            k = min(top, z.shape[0])
            idx = np.argpartition(-z, k - 1)[:k]
            idx = idx[np.lexsort((idx, -z[idx]))]
            best = tuple((int(i), float(z[i] - lse)) for i in idx)
        out.append(TokenLogprob(int(tok), float(z[int(tok)] - lse), best))
    return out


def reshaped_logits(logits: np.ndarray, answer, drafts, presence: float, frequency: float,
                    bias: tuple[tuple[int, float], ...]) -> np.ndarray:
    """Rows ``logits`` [n, V] of one pass with OpenAI's presence / frequency penalties and the
    logit bias applied, as a new float32 array: row i decides the token after ``answer`` (the
    answer's tokens so far) followed by ``drafts[:i]``, so its penalties count those drafts too
    (row 0 counts the answer alone). What plain decoding computes at each of those positions."""
    rows = np.array(logits, dtype=np.float32)
    if bias:  # ids inside the vocabulary: Pipeline.stream checks them before a generation starts
        ids = np.fromiter((t for t, _ in bias), dtype=np.int64, count=len(bias))
        rows[:, ids] += np.fromiter((b for _, b in bias), dtype=np.float32, count=len(bias))
    if presence or frequency:
        counts: dict[int, int] = {}
        for t in answer:
            counts[t] = counts.get(t, 0) + 1
        for i in range(rows.shape[0]):
            if i:
                t = int(drafts[i - 1])
                counts[t] = counts.get(t, 0) + 1
            if counts:
                ids = np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))
                n = np.fromiter(counts.values(), dtype=np.float32, count=len(counts))
                rows[i, ids] -= presence + frequency * n
    return rows
