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

A table built with a calibration (format 2, ``python -m export ngram-table``) replaces those
online estimates by a logistic model fitted on held-out answers: per draft position, from where
the draft comes (the conversation's match length, or the table's context length, share and how
often the context occurred), its position, whether the other source proposes the same token,
and whether the previous round's proposal had predicted the pending token. Those confidences
are calibrated offline, so the scheduler's online offset corrects them for the workload at hand
(``observed_confidence`` is then False).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from ..errors import ConfigError
from .base import AcceptanceTracker, BaseDrafter, Draft, DraftRequest
from .ngram_table import NgramTable

log = logging.getLogger(__name__)

SHARE_BINS = (0.5, 0.8)  # table drafts are judged in three bins of their share: < 0.5, < 0.8, ≥ 0.8

# The calibrated confidence model's inputs, in order (a table's calibration names them; one fitted
# for other features is not used).
FEATURES = ("bias", "position 1", "position 2", "position 3", "position 4+",
            "conversation n=1", "conversation n=2", "conversation n=3", "conversation n=4+",
            "table n=1", "table n=2", "table n=3", "table n=4+", "table share", "table log count / 5",
            "table share x log count / 5", "other source agrees", "on track", "no previous proposal",
            "on track x position 1")


def draft_features(from_table: bool, lengths: Sequence[int], shares: Sequence[float], counts: Sequence[int],
                   agree: Sequence[bool], on_track: bool | None) -> np.ndarray:
    """[k, len(FEATURES)] inputs of the confidence model for a k-token draft. ``lengths``: the
    conversation match length (every position) or each table token's context length;
    ``on_track``: whether the previous proposal predicted the pending token (None: no previous
    proposal in this generation)."""
    k = len(lengths)
    x = np.zeros((k, len(FEATURES)))
    x[:, 0] = 1.0
    pos = np.minimum(np.arange(k), 3)
    x[np.arange(k), 1 + pos] = 1.0
    n = np.minimum(np.asarray(lengths, dtype=np.int64), 4)
    x[np.arange(k), (9 if from_table else 5) + n - 1] = 1.0
    if from_table:
        log_count = np.log1p(np.asarray(counts, dtype=np.float64)) / 5.0
        x[:, 13] = shares
        x[:, 14] = log_count
        x[:, 15] = np.asarray(shares, dtype=np.float64) * log_count
    x[:, 16] = np.asarray(agree, dtype=np.float64)
    if on_track is None:
        x[:, 18] = 1.0
    elif on_track:
        x[:, 17] = 1.0
        x[:1, 19] = 1.0
    return x


def calibration_weights(table: NgramTable) -> np.ndarray | None:
    """The weights of the table's confidence model when it has one fitted for ``FEATURES``."""
    cal = table.calibration
    if cal is None or list(cal.get("features", [])) != list(FEATURES):
        return None
    return np.asarray(cal["weights"], dtype=np.float64)


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


class NgramDrafter(BaseDrafter):
    name = "ngram"
    needs_hidden = False
    observed_confidence = True  # the confidences are this generation's acceptance rates

    def __init__(self, min_n: int = 1, max_n: int = 4, max_tokens: int = 8,
                 learn_across_generations: bool = False, table: NgramTable | None = None,
                 table_min_n: int = 2, calibrated: bool = True, record_features: bool = False) -> None:
        if not 1 <= min_n <= max_n:
            raise ConfigError(f"n-gram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {max_tokens}")
        if table_min_n < 1:
            raise ConfigError(f"table_min_n must be >= 1, got {table_min_n}")
        self.min_n, self.max_n, self.max_tokens = min_n, max_n, max_tokens
        self.table, self.table_min_n = table, table_min_n
        self.weights: np.ndarray | None = None  # the calibrated confidence model, when the table has one
        if table is not None:
            self.name = "ngram+table" if calibrated else "ngram+table (online)"
            if calibrated:
                self.weights = calibration_weights(table)
            if self.weights is not None:
                self.observed_confidence = False  # calibrated offline: the scheduler's offset applies
            elif calibrated and table.calibration is not None:
                log.warning("the n-gram table's confidence calibration was fitted for other features; "
                            "estimating confidences online instead (rebuild the table to use it)")
        # The confidence model's inputs are computed when the model uses them, or when asked to
        # (``record_features``: what the calibration fit replays), and kept in ``last_features``.
        self.record_features = table is not None and (self.weights is not None or record_features)
        # Acceptance statistics shape the draft length, and with it how the random stream is
        # consumed: kept per generation by default so a seed reproduces its output.
        self.learn_across_generations = learn_across_generations
        self.stats = self._new_stats()
        self.table_stats = self._new_table_stats()
        self._last_n: int | None = None  # match length behind the latest proposal
        self._last_buckets: list[tuple[int, int]] | None = None  # the latest table proposal's buckets
        self._ext_n: int | None = None  # the same two of the latest ``extend``
        self._ext_buckets: list[tuple[int, int]] | None = None
        self._ctx: list[int] = []
        self._index: dict[int, dict[tuple[int, ...], int]] = {}
        self._indexed = 0  # n-grams ending before this position are indexed
        self._previous: tuple[int, list[int]] | None = None  # (context length, full proposal) of the last round
        self.last_features: np.ndarray | None = None  # the confidence model's inputs of the latest proposal

    def _new_stats(self) -> dict[int, AcceptanceTracker]:
        # Priors rise with the match length (0.25 for one token … 0.7 for four and more).
        return {n: AcceptanceTracker(prior=min(0.7, 0.25 + 0.15 * (n - 1)))
                for n in range(self.min_n, self.max_n + 1)}

    def _new_table_stats(self) -> dict[tuple[int, int], RateTracker]:
        # Priors: share bin b (0, 1, 2) and context length n; table drafts on text unlike the
        # table's corpus are accepted less often than their share says (docs/notes/2026-11-30-to-12-02-measurements.md).
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
        self._previous, self.last_features = None, None
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

    def _copy(self, ctx: list[int], start: int, k: int) -> list[int]:
        """What followed the match at ``start``; past the end, keep copying from the proposal
        itself (an overlapping copy), so a repeating pattern is continued for all k tokens."""
        out: list[int] = []
        for i in range(k):
            pos = start + i
            out.append(ctx[pos] if pos < len(ctx) else out[pos - len(ctx)])
        return out

    def _on_track(self, ctx: list[int]) -> bool | None:
        """Whether the previous proposal, read past the drafts accepted since, had predicted the
        pending token (the last one of ``ctx``); None before the first proposal."""
        if self._previous is None:
            return None
        start, tokens = self._previous
        i = len(ctx) - 1 - start  # the pending token's index in that proposal
        return 0 <= i < len(tokens) and tokens[:i + 1] == ctx[start:]

    def propose(self, request: DraftRequest, rng: np.random.Generator) -> Draft:
        self._extend(request.context)
        ctx = self._ctx
        k = min(request.max_tokens, self.max_tokens)
        self._last_n, self._last_buckets, self.last_features = None, None, None
        if k < 1:
            return Draft.empty()
        draft, self._last_n, self._last_buckets, self.last_features = self._lookup(
            ctx, k, self._on_track(ctx) if self.record_features else None)
        self._previous = (len(ctx), draft.tokens.tolist())
        return draft

    def extend(self, drafts: Sequence[int], k: int) -> Draft:
        """Up to ``k`` drafts continuing ``drafts`` (another drafter's tokens after the context
        of the latest ``propose``, not committed), looked up as ``propose`` would were they
        committed, except that n-grams inside them are not indexed; the confidence model's "on
        track" input reads the latest proposal against them. The drafter's state stays as
        ``propose`` left it; ``feedback_extension`` takes the outcome of these drafts."""
        self._ext_n, self._ext_buckets = None, None
        k = min(k, self.max_tokens)
        if k < 1 or not self._ctx:
            return Draft.empty()
        ctx = self._ctx + [int(t) for t in drafts]
        draft, self._ext_n, self._ext_buckets, _ = self._lookup(
            ctx, k, self._on_track(ctx) if self.record_features else None)
        return draft

    def _lookup(self, ctx: list[int], k: int, on_track: bool | None):
        """(draft, match length, table buckets, model inputs) continuing ``ctx``; the lengths
        and buckets say which acceptance counts the outcome of the draft goes to."""
        match = self._match(ctx)
        conv = self._copy(ctx, match[1], k) if match is not None else []
        # The table is looked up when it may draft, or to tell whether it agrees.
        wanted = self.table is not None and (self.record_features or match is None or match[0] < self.table_min_n)
        found = self.table.continue_from(ctx, k, 1) if wanted else None
        if found is not None and not found.tokens:
            found = None
        # A short (or no) match in the conversation: the table's longer context wins; with no
        # match at all, the table's longest one.
        use_table = found is not None and (match is None or (
            match[0] < self.table_min_n and found.context_lengths[0] >= self.table_min_n))
        if use_table:
            tokens, other = found.tokens, conv
        elif match is not None:
            tokens, other = conv, (found.tokens if found is not None else [])
        else:
            return Draft.empty(), None, None, None
        x = None
        if self.record_features:
            agree = [i < len(other) and other[i] == t for i, t in enumerate(tokens)]
            if use_table:
                x = draft_features(True, found.context_lengths, found.shares, found.counts, agree, on_track)
            else:
                x = draft_features(False, [match[0]] * len(tokens), [], [], agree, on_track)
        last_n, buckets = None, None
        if self.weights is not None:
            conf = np.clip(1.0 / (1.0 + np.exp(-(x @ self.weights))), 0.01, 0.99)
        elif use_table:
            buckets = [(n, int(np.searchsorted(SHARE_BINS, share, side="right")))
                       for n, share in zip(found.context_lengths, found.shares)]
            conf = np.asarray([self.table_stats[b].rate for b in buckets], dtype=np.float64)
        else:
            last_n = match[0]
            conf = self.stats[match[0]].confidence(k)
        return Draft(np.asarray(tokens, dtype=np.int64), None, np.asarray(conf, dtype=np.float64)), last_n, buckets, x

    def feedback(self, drafted: int, accepted: int, committed: Sequence[int]) -> None:
        self._judge(self._last_n, self._last_buckets, drafted, accepted)

    def feedback_extension(self, drafted: int, accepted: int) -> None:
        """The outcome of the latest ``extend``'s drafts: ``drafted`` of them verified, the first
        ``accepted`` kept."""
        self._judge(self._ext_n, self._ext_buckets, drafted, accepted)

    def _judge(self, n: int | None, buckets: list[tuple[int, int]] | None, drafted: int, accepted: int) -> None:
        if drafted and n is not None:
            self.stats[n].update(drafted, accepted)
        elif drafted and buckets is not None:
            for i, bucket in enumerate(buckets[:min(drafted, accepted + 1)]):
                self.table_stats[bucket].update(i < accepted)
