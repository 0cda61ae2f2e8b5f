"""Verification of drafted tokens: pure numpy, in the notation of speculative decoding.

Given the target's logits at the k+1 positions of [anchor, x_1..x_k] and the drafts x_i:

- greedy: accept the longest prefix with x_i = argmax p_i; then add the target's own token
  (argmax at the first mismatch, or the bonus token argmax p_{k+1} after a full accept);
- sampling: accept x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection
  draw from norm(max(p_i − q_i, 0)) (from p_i when that mass is ~0); after a full accept draw
  the bonus token from p_{k+1}. p and q pass through the same temperature / top-k / top-p.

Both leave the output distributed exactly as the target's own (Leviathan et al. 2023; Chen
et al. 2023). A deterministic drafter (n-gram) is the case q_i = one-hot(x_i). Every random
draw comes from the caller's numpy Generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .sampling import coupled_choice, probs, sample

RESIDUAL_EPS = 1e-12


def judged(drafted: int, accepted: int) -> int:
    """How many draft positions a verification judged: every accepted draft and the first
    rejected one (never more than were drafted). Per-position acceptance is accepted/judged."""
    return min(accepted + 1, drafted)


@dataclass(frozen=True)
class VerifyOutcome:
    accepted: int  # a: drafts accepted (0..k)
    tokens: tuple[int, ...]  # x_1..x_a followed by the target's token: a + 1 new tokens
    bonus: bool  # all k drafts accepted, last token drawn from p_{k+1}


def verify_greedy(drafts: np.ndarray, target_logits: np.ndarray) -> VerifyOutcome:
    """drafts [k] ints; target_logits [k+1, V] (row i scores the token after position i)."""
    k = drafts.shape[0]
    best = np.argmax(target_logits[:k + 1], axis=-1)
    mismatch = np.flatnonzero(best[:k] != drafts)
    a = int(mismatch[0]) if mismatch.size else k
    return VerifyOutcome(a, tuple(int(t) for t in drafts[:a]) + (int(best[a]),), a == k)


def verify_sampling(drafts: np.ndarray, draft_probs: np.ndarray | None, target_logits: np.ndarray,
                    temperature: float, top_k: int, top_p: float, rng: np.random.Generator) -> VerifyOutcome:
    """Rejection sampling. ``draft_probs`` [k, V] are the q_i the drafts were drawn from, already
    filtered like p; None means a deterministic drafter (q_i one-hot at x_i)."""
    k = drafts.shape[0]
    for i in range(k):
        p = probs(target_logits[i], temperature, top_k, top_p)
        x = int(drafts[i])
        q_x = 1.0 if draft_probs is None else float(draft_probs[i, x])
        if q_x > 0.0 and rng.random() < min(1.0, p[x] / q_x):
            continue
        if draft_probs is None:
            residual = p.copy()
            residual[x] = 0.0
        else:
            residual = np.maximum(p - draft_probs[i], 0.0)
        mass = residual.sum()
        token = sample(residual / mass, rng) if mass > RESIDUAL_EPS else sample(p, rng)
        return VerifyOutcome(i, tuple(int(t) for t in drafts[:i]) + (token,), False)
    p = probs(target_logits[k], temperature, top_k, top_p)
    return VerifyOutcome(k, tuple(int(t) for t in drafts) + (sample(p, rng),), True)


def verify_coupled(drafts: np.ndarray, target_logits: np.ndarray, temperature: float, top_k: int, top_p: float,
                   seed: int, position: int) -> VerifyOutcome:
    """Coupled sampling: row i's token is ``coupled_choice`` at answer position
    ``position + i``; drafts are accepted while they equal those tokens. The output is exactly
    what plain decoding with the same seed produces, so it follows the target's distribution."""
    k = drafts.shape[0]
    for i in range(k + 1):
        t = coupled_choice(target_logits[i], temperature, top_k, top_p, seed, position + i)
        if i == k or t != int(drafts[i]):
            return VerifyOutcome(i, tuple(int(x) for x in drafts[:i]) + (t,), i == k)
    raise AssertionError("unreachable")
