"""``ngram+dspark``: n-gram drafts where they promise more than the DSpark drafter is expected
to give, else the DSpark drafter.

The n-gram lookup costs a fraction of a millisecond and drafts well where the answer repeats
its context; a DSpark round costs a pass of the drafter's graph and drafts everywhere, less
surely. Each round the n-gram drafter proposes first. Its drafts are used when the round they
make is worth at least what a DSpark round is expected to be worth, by the scheduler's measure
(``widths.Yardstick``: expected tokens per millisecond of drafting and verifying): the n-gram
round's worth from its confidences, the DSpark round's from this drafter's own record of DSpark
rounds (mean accepted drafts, mean verified drafts, mean drafting time, kept across
generations: they describe the drafter and the target, not a prompt). Without a yardstick (a
fixed draft length) the n-gram drafts are used when there are as many as asked for and their
expected accepted count reaches the DSpark rounds' mean. Until the first DSpark round is on
record, the DSpark drafter drafts.

The DSpark drafter reads the target's hidden states of every committed position in order: on
rounds the n-gram drafter drafts, the new rows are kept and handed over at the next DSpark round
(its context grows by all of them at once, as the ``DraftRequest`` contract allows). Which
drafter drafted is each proposal's ``source``, so the scheduler keeps their drafting costs
apart; the drafts themselves are the chosen drafter's own, so exactness is theirs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from ..widths import expected_accepted
from .base import BaseDrafter, Draft, DraftRequest

# Weight of a new DSpark round in the running means (about the last 20 rounds).
MEAN_WEIGHT = 0.05


class NgramDSparkDrafter(BaseDrafter):
    name = "ngram+dspark"
    needs_hidden = True
    observed_confidence = False  # each proposal says (Draft.observed)

    def __init__(self, ngram, dspark) -> None:
        self.ngram, self.dspark = ngram, dspark
        # The DSpark rounds on record: mean accepted drafts, mean drafts verified, mean drafting ms.
        self.dspark_rounds = 0
        self.mean_accepted = self.mean_verified = self.mean_ms = 0.0
        self.rounds_by_source = {"ngram": 0, "dspark": 0}
        self._pending: list[np.ndarray] = []
        self._source: str | None = None
        self.begin(())

    def begin(self, prompt_ids: Sequence[int]) -> None:
        self.ngram.begin(prompt_ids)
        self.dspark.begin(prompt_ids)
        self._pending = []
        self._source = None

    def _dspark_worth(self, request: DraftRequest) -> float | None:
        """What a DSpark round is expected to be worth (None: no DSpark round on record yet)."""
        if not self.dspark_rounds:
            return None
        ys = request.yardstick
        if ys is None:
            return self.mean_accepted
        width = min(ys.widths, key=lambda w: abs(w - 1 - self.mean_verified))
        return ys.at(width, self.mean_accepted, self.mean_ms)

    def _ngram_worth(self, draft: Draft, request: DraftRequest) -> float:
        ys = request.yardstick
        if ys is None:
            return expected_accepted(draft.confidence) if len(draft) >= request.max_tokens else -1.0
        conf = draft.confidence if self.ngram.observed_confidence else ys.shifted(draft.confidence)
        return ys.best(conf)[1]

    def keep_hidden(self, rows: np.ndarray | None) -> None:
        """The target's hidden states of newly committed positions, for the next DSpark round: a
        drafter that holds this one (``ngram+dspark+self``) hands them over on rounds it does not
        ask this one to propose, so the DSpark drafter's context never skips a position."""
        if rows is not None and rows.shape[0]:
            self._pending.append(rows)

    def extend(self, drafts: Sequence[int], k: int) -> Draft:
        """The n-gram drafts continuing ``drafts`` (``NgramDrafter.extend``)."""
        ext = self.ngram.extend(drafts, k)
        return ext.reported("ngram", self.ngram.observed_confidence, None)

    def feedback_extension(self, drafted: int, accepted: int) -> None:
        self.ngram.feedback_extension(drafted, accepted)

    def propose(self, request: DraftRequest, rng: np.random.Generator) -> Draft:
        self.keep_hidden(request.new_hidden)
        ng = self.ngram.propose(replace(request, new_hidden=None), rng)
        ds_worth = self._dspark_worth(request)
        ng_worth = self._ngram_worth(ng, request) if len(ng) else None
        record = {"ngram_worth": ng_worth, "dspark_worth": ds_worth}
        if ng_worth is not None and ds_worth is not None and ng_worth >= ds_worth:
            self._source = "ngram"
            self.rounds_by_source["ngram"] += 1
            return ng.reported("ngram", self.ngram.observed_confidence, {"source": "ngram", **record})
        hidden = np.concatenate(self._pending) if self._pending else None
        self._pending = []
        t0 = time.perf_counter()
        draft = self.dspark.propose(replace(request, new_hidden=hidden), rng)
        self._draft_ms = (time.perf_counter() - t0) * 1e3
        self._source = "dspark"
        self.rounds_by_source["dspark"] += 1
        return draft.reported("dspark", False, {"source": "dspark", **record})

    def feedback(self, drafted: int, accepted: int, committed: Sequence[int]) -> None:
        if self._source == "ngram":
            self.ngram.feedback(drafted, accepted, committed)
        elif self._source == "dspark":
            self.ngram.feedback(0, 0, committed)
            self.dspark.feedback(drafted, accepted, committed)
            a = 1.0 if not self.dspark_rounds else MEAN_WEIGHT
            self.mean_accepted += a * (accepted - self.mean_accepted)
            self.mean_verified += a * (drafted - self.mean_verified)
            self.mean_ms += a * (self._draft_ms - self.mean_ms)
            self.dspark_rounds += 1
        self._source = None
