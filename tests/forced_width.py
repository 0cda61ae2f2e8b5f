"""A test wrapper around the real scheduler: it still decides every round (so its offset, costs
and decision record are exercised) but a given function sets the verify width, and every round
drafts (the gate is bypassed), so a test does not depend on this machine's timings. The
yardstick it hands drafters prices every width alike and far above any drafting time, so what
a drafter decides with it (a DSpark block, ngram+dspark's source) follows the confidences and
never the timings."""

from __future__ import annotations

import dataclasses


class _FlatCosts:
    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def verify(self, width: int) -> float:
        return 1e9


class ForcedWidthScheduler:
    def __init__(self, inner, width, reason: str):
        self.inner, self.width, self.reason = inner, width, reason

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def wants_draft(self, snap):
        self.inner.update_modes(snap)
        return True

    @property
    def costs(self):
        """The inner scheduler's cost model as drafters' yardsticks read it: every width 1e9 ms."""
        return _FlatCosts(self.inner.costs)

    def decide(self, confidence, snap, shift=True, source=None):
        d = self.inner.decide(confidence, snap, shift=shift, source=source)
        return dataclasses.replace(d, width=self.width(confidence), reason=self.reason)
