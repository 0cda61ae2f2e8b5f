"""Model-free drafting by prompt lookup: continue the longest recent n-gram match.

The suffix of the context (n tokens, n from ``max_n`` down to ``min_n``) is looked up among
earlier positions of the prompt and generated text; the tokens that followed its most recent
earlier occurrence are proposed (continuing periodically when that occurrence is recent).
Indexes are updated incrementally, so a round costs O(max_n) dictionary lookups however long
the context; memory grows linearly with it.

The confidence of each draft is the observed per-position acceptance of drafts that came
from a match of the same length: a 4-token match is far more often right than a 1-token
one, and the scheduler can only pick a good width if the confidence tells them apart.

With a corpus table (``ngram_table.NgramTable``: the target's habitual continuations, built from
its own answers), a context the conversation matches by fewer than ``table_min_n`` tokens is
continued from the table instead when the table knows a context of at least that length; with
no match at all, from the table's longest match. A table draft's confidence is the observed
acceptance of table drafts with the same context length and a similar share (the table's
frequency of that continuation), starting from a prior that rises with both.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import ConfigError
from .base import AcceptanceTracker, Draft, DraftRequest
from .ngram_table import NgramTable

SHARE_BINS = (0.5, 0.8)  # table drafts are judged in three bins of their share: < 0.5, < 0.8, ≥ 0.8


class RateTracker:
    """Acceptance of single draft tokens (given the ones before them were accepted), smoothed
    toward a prior."""

    def __init__(self, prior: float, prior_weight: float = 4.0) -> None:
        self.prior, self.prior_weight = prior, prior_weight
        self.tried = 0
        self.accepted = 0

    def update(self, accepted: bool) -> None:
        self.tried += 1
        self.accepted += bool(accepted)

    @property
    def rate(self) -> float:
        return (self.accepted + self.prior * self.prior_weight) / (self.tried + self.prior_weight)


class NgramDrafter:
    name = "ngram"
    needs_hidden = False
    observed_confidence = True  # the confidences are this generation's acceptance rates

    def __init__(self, min_n: int = 1, max_n: int = 4, max_tokens: int = 8,
                 learn_across_generations: bool = False, table: NgramTable | None = None,
                 table_min_n: int = 2) -> None:
        if not 1 <= min_n <= max_n:
            raise ConfigError(f"n-gram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {max_tokens}")
        if table_min_n < 1:
            raise ConfigError(f"table_min_n must be >= 1, got {table_min_n}")
        self.min_n, self.max_n, self.max_tokens = min_n, max_n, max_tokens
        self.table, self.table_min_n = table, table_min_n
        if table is not None:
            self.name = "ngram+table"
        # Acceptance statistics shape the draft length, and with it how the random stream is
        # consumed: kept per generation by default so a seed reproduces its output.
        self.learn_across_generations = learn_across_generations
        self.stats = self._new_stats()
        self.table_stats = self._new_table_stats()
        self._last_n: int | None = None  # match length behind the latest proposal
        self._last_buckets: list[tuple[int, int]] | None = None  # the latest table proposal's buckets
        self._ctx: list[int] = []
        self._index: dict[int, dict[tuple[int, ...], int]] = {}
        self._indexed = 0  # n-grams ending before this position are indexed

    def _new_stats(self) -> dict[int, AcceptanceTracker]:
        # Priors rise with the match length (0.25 for one token … 0.7 for four and more).
        return {n: AcceptanceTracker(prior=min(0.7, 0.25 + 0.15 * (n - 1)))
                for n in range(self.min_n, self.max_n + 1)}

    def _new_table_stats(self) -> dict[tuple[int, int], RateTracker]:
        # Priors: share bin b (0, 1, 2) and context length n; table drafts on text unlike the
        # table's corpus are accepted less often than their share says (docs/PERFORMANCE.md).
        if self.table is None:
            return {}
        return {(n, b): RateTracker(prior=min(0.75, 0.12 + 0.18 * b + 0.06 * (min(n, 4) - 1)))
                for n in self.table.lengths for b in range(len(SHARE_BINS) + 1)}

    def begin(self, prompt_ids: Sequence[int]) -> None:
        if not self.learn_across_generations:
            self.stats = self._new_stats()
            self.table_stats = self._new_table_stats()
        self._last_n = None
        self._last_buckets = None
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

    def _match(self, ctx: list[int]) -> tuple[int, int] | None:
        """(match length, position after the match's most recent earlier occurrence)."""
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(ctx) < n:
                continue
            start = self._index[n].get(tuple(ctx[-n:]))
            if start is not None and start < len(ctx):
                return n, start
        return None

    def _from_table(self, ctx: list[int], k: int, min_n: int) -> Draft | None:
        found = self.table.continue_from(ctx, k, min_n) if self.table is not None else None
        if not found or not found.tokens:
            return None
        buckets = [(n, int(np.searchsorted(SHARE_BINS, share, side="right")))
                   for n, share in zip(found.context_lengths, found.shares)]
        self._last_buckets = buckets
        conf = np.asarray([self.table_stats[b].rate for b in buckets], dtype=np.float64)
        return Draft(np.asarray(found.tokens, dtype=np.int64), None, conf)

    def propose(self, request: DraftRequest, rng: np.random.Generator) -> Draft:
        self._extend(request.context)
        ctx = self._ctx
        k = min(request.max_tokens, self.max_tokens)
        self._last_n, self._last_buckets = None, None
        if k < 1:
            return Draft.empty()
        match = self._match(ctx)
        if self.table is not None and (match is None or match[0] < self.table_min_n):
            # A short (or no) match in the conversation: the table's longer context wins.
            draft = self._from_table(ctx, k, self.table_min_n)
            if draft is not None:
                return draft
        if match is not None:
            n, start = match
            # Copy what followed; past the end, keep copying from the proposal itself
            # (an overlapping copy), so a repeating pattern is continued for all k tokens.
            out: list[int] = []
            for i in range(k):
                pos = start + i
                out.append(ctx[pos] if pos < len(ctx) else out[pos - len(ctx)])
            self._last_n = n
            return Draft(np.asarray(out, dtype=np.int64), None, self.stats[n].confidence(k))
        return self._from_table(ctx, k, 1) or Draft.empty()

    def feedback(self, drafted: int, accepted: int, committed: Sequence[int]) -> None:
        if drafted and self._last_n is not None:
            self.stats[self._last_n].update(drafted, accepted)
        elif drafted and self._last_buckets is not None:
            for i, bucket in enumerate(self._last_buckets[:min(drafted, accepted + 1)]):
                self.table_stats[bucket].update(i < accepted)
