"""Model-free drafting by prompt lookup: continue the longest recent n-gram match.

The suffix of the context (n tokens, n from ``max_n`` down to ``min_n``) is looked up among
earlier positions of the prompt and generated text; the tokens that followed its most recent
earlier occurrence are proposed (continuing periodically when that occurrence is recent).
Indexes are updated incrementally, so a round costs O(max_n) dictionary lookups however long
the context; memory grows linearly with it.

The confidence of each draft is the observed per-position acceptance of drafts that came
from a match of the same length: a 4-token match is far more often right than a 1-token
one, and the scheduler can only pick a good width if the confidence tells them apart.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import ConfigError
from .base import AcceptanceTracker, Draft, DraftRequest


class NgramDrafter:
    name = "ngram"
    needs_hidden = False
    observed_confidence = True  # the confidences are this generation's acceptance rates

    def __init__(self, min_n: int = 1, max_n: int = 4, max_tokens: int = 8,
                 learn_across_generations: bool = False) -> None:
        if not 1 <= min_n <= max_n:
            raise ConfigError(f"n-gram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {max_tokens}")
        self.min_n, self.max_n, self.max_tokens = min_n, max_n, max_tokens
        # Acceptance statistics shape the draft length, and with it how the random stream is
        # consumed: kept per generation by default so a seed reproduces its output.
        self.learn_across_generations = learn_across_generations
        self.stats = self._new_stats()
        self._last_n: int | None = None  # match length behind the latest proposal
        self._ctx: list[int] = []
        self._index: dict[int, dict[tuple[int, ...], int]] = {}
        self._indexed = 0  # n-grams ending before this position are indexed

    def _new_stats(self) -> dict[int, AcceptanceTracker]:
        # Priors rise with the match length (0.25 for one token … 0.7 for four and more).
        return {n: AcceptanceTracker(prior=min(0.7, 0.25 + 0.15 * (n - 1)))
                for n in range(self.min_n, self.max_n + 1)}

    def begin(self, prompt_ids: Sequence[int]) -> None:
        if not self.learn_across_generations:
            self.stats = self._new_stats()
        self._last_n = None
        self._ctx = []
        self._index = {n: {} for n in range(self.min_n, self.max_n + 1)}
        self._indexed = 0
        self._extend(prompt_ids)

    def _extend(self, context: Sequence[int]) -> None:
        if len(context) < len(self._ctx) or list(context[:len(self._ctx)]) != self._ctx:
            self._ctx = []
            self._index = {n: {} for n in range(self.min_n, self.max_n + 1)}
            self._indexed = 0
        self._ctx.extend(int(t) for t in context[len(self._ctx):])
        # Index every n-gram that ends before the last token: value = position after it.
        ctx = self._ctx
        for end in range(max(self._indexed, 1), len(ctx)):
            for n in self._index:
                if end >= n:
                    self._index[n][tuple(ctx[end - n:end])] = end
        self._indexed = max(self._indexed, len(ctx))

    def propose(self, request: DraftRequest, rng: np.random.Generator) -> Draft:
        self._extend(request.context)
        ctx = self._ctx
        k = min(request.max_tokens, self.max_tokens)
        if k < 1:
            return Draft.empty()
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(ctx) < n:
                continue
            start = self._index[n].get(tuple(ctx[-n:]))
            if start is not None and start < len(ctx):
                # Copy what followed; past the end, keep copying from the proposal itself
                # (an overlapping copy), so a repeating pattern is continued for all k tokens.
                out: list[int] = []
                for i in range(k):
                    pos = start + i
                    out.append(ctx[pos] if pos < len(ctx) else out[pos - len(ctx)])
                self._last_n = n
                return Draft(np.asarray(out, dtype=np.int64), None, self.stats[n].confidence(k))
        self._last_n = None
        return Draft.empty()

    def feedback(self, drafted: int, accepted: int, committed: Sequence[int]) -> None:
        if drafted and self._last_n is not None:
            self.stats[self._last_n].update(drafted, accepted)
