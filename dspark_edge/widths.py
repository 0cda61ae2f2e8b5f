"""How many of a round's drafts to verify: one small interface, three policies.

``FixedLength`` verifies k drafts every round (``GenerationConfig.draft_tokens``);
``SurvivalCut`` keeps draft j while the survival of the drafts before it is at least
``min_survival`` (no scheduler); ``Scheduled`` asks the confidence scheduler (the paper's
Algorithm 1 on this device's cost curve, with the telemetry policies) and tells it what each
round cost and accepted. Every policy's choice for draft j depends only on the confidences
before it and on past rounds, never on draft j itself: the early stop that keeps rejection
sampling lossless. The round (``rounds.Speculator``) then verifies at the widest listed width
the kept drafts fill. This module knows nothing of drafters or text.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from .scheduler import Decision, Scheduler
from .telemetry import Snapshot


class WidthPolicy(Protocol):
    memory_low: bool  # memory is short: the round releases its drafter

    def hints(self) -> tuple[Callable[[int], float] | None, float]:
        """What a drafter that stops early may know: the target's pass cost per listed width
        (None without a cost model) and the online confidence offset (logits)."""

    def wants_draft(self, snap: Snapshot | None) -> bool:
        """Before drafting: whether this round drafts at all."""

    def choose(self, confidence: np.ndarray, snap: Snapshot | None, shift: bool, source: str | None,
               draft_ms: float | None) -> tuple[int, Decision | None]:
        """How many of the drafts (with these confidences) to verify, and the decision's record
        when there is one. ``shift``: the confidences are calibrated elsewhere (the online offset
        applies); ``source``: which of the drafter's sources drafted; ``draft_ms``: this round's
        drafting time, None when it did not draft (seen only after the choice)."""

    def learn(self, width: int, verify_ms: float, round_ms: float | None, confidence: np.ndarray,
              accepted: int, shift: bool) -> None:
        """After the target pass: the width verified, its time, the round's time from drafting to
        verdict (None: no drafting), and how many of the verified drafts were accepted."""


class _Unscheduled:
    """A policy without a cost model: always drafts, learns nothing, never short of memory."""

    memory_low = False

    def hints(self):
        return None, 0.0

    def wants_draft(self, snap: Snapshot | None) -> bool:
        return True

    def learn(self, width, verify_ms, round_ms, confidence, accepted, shift) -> None:
        return None


class FixedLength(_Unscheduled):
    """Verify ``k`` drafts whenever the drafter gives them (fewer when it gives fewer)."""

    def __init__(self, k: int) -> None:
        self.k = k

    def choose(self, confidence, snap, shift, source, draft_ms) -> tuple[int, Decision | None]:
        return min(self.k, int(confidence.shape[0])), None


class SurvivalCut(_Unscheduled):
    """Keep draft j while prod(c_1..c_{j-1}) >= ``min_survival`` (draft 1 always)."""

    def __init__(self, min_survival: float) -> None:
        self.min_survival = min_survival

    def choose(self, confidence, snap, shift, source, draft_ms) -> tuple[int, Decision | None]:
        k = int(confidence.shape[0])
        return (survival_cut(confidence, self.min_survival) if k > 1 else k), None


class Scheduled:
    """The confidence scheduler's width, and what it learns from each round."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    @property
    def memory_low(self) -> bool:
        return self.scheduler.memory_low

    def hints(self):
        return self.scheduler.costs.verify, self.scheduler.offset

    def wants_draft(self, snap: Snapshot | None) -> bool:
        return self.scheduler.wants_draft(snap)

    def choose(self, confidence, snap, shift, source, draft_ms) -> tuple[int, Decision | None]:
        sched = self.scheduler
        decision = sched.decide(confidence, snap, shift=shift, source=source if draft_ms is not None else None)
        if draft_ms is not None:  # after the choice: it must not see this round's own time
            sched.costs.observe_draft(draft_ms, source=source)
        return decision.width - 1, decision

    def learn(self, width, verify_ms, round_ms, confidence, accepted, shift) -> None:
        sched = self.scheduler
        sched.observe(width, verify_ms)
        if round_ms is not None:
            # Every round that paid for drafting counts toward the gate, also one whose drafts
            # were all declined: its token cost a draft and a pass.
            sched.observe_round(1 + accepted, round_ms)
        if len(confidence) and shift:
            sched.observe_acceptance(confidence, accepted)


def survival_cut(confidence: np.ndarray, min_survival: float) -> int:
    """How many drafts to keep: draft j (1-based) stays while prod(c_1..c_{j-1}) >= min_survival.

    Draft 1 always stays; the decision for draft j uses only the confidences before it
    (the early stop that keeps rejection sampling lossless)."""
    survival = np.cumprod(confidence[:-1])
    below = np.flatnonzero(survival < min_survival)
    return int(below[0]) + 1 if below.size else int(confidence.shape[0])
