"""How many of a round's drafts to verify: one small interface, three policies.

``FixedLength`` verifies k drafts every round (``GenerationConfig.draft_tokens``);
``SurvivalCut`` keeps draft j while the survival of the drafts before it is at least
``min_survival`` (no scheduler); ``Scheduled`` asks the confidence scheduler (the paper's
Algorithm 1 on this device's cost curve, with the telemetry policies) and tells it what each
round cost and accepted. Every policy's choice for draft j depends only on the confidences
before it and on past rounds, never on draft j itself: the early stop that keeps rejection
sampling lossless. The round (``rounds.Speculator``) then verifies at the widest listed width
the kept drafts fill. This module knows nothing of drafters or text.

A drafter whose drafting costs per token (self-drafting) decides itself how far to draft, but
never by a rule of its own: it asks the policy's ``Yardstick`` (``WidthPolicy.yardstick``), the
expected tokens per millisecond of a round by the same rule and cost curve the scheduler
chooses widths with, and brings only what it alone knows (its confidences so far, a guess for
those it has not drawn, its time per draft).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .scheduler import Decision, Scheduler, choose_width, shifted
from .telemetry import Snapshot


@dataclass(frozen=True)
class Yardstick:
    """A round's worth in expected tokens per millisecond, by the scheduler's rule: a round that
    verifies drafts with survivals a_1..a_{w-1} at width w after ``spent_ms`` of drafting is
    worth (1 + Σ a_j) / (spent_ms + cost(w)). ``cost``: the pass ms per listed width as the
    cost model has it now; ``offset``: the online confidence offsets (logits; one for every
    position, or one per draft position) the scheduler will add to confidences calibrated
    elsewhere."""

    cost: Callable[[int], float]
    widths: tuple[int, ...]
    offset: float | tuple[float, ...] = 0.0

    def shifted(self, confidence) -> np.ndarray:
        """Confidences as the scheduler will see them (the online offset added)."""
        return shifted(confidence, self.offset)

    def at(self, width: int, expected: float, spent_ms: float = 0.0) -> float:
        """A round verifying at ``width`` whose drafts are expected to give ``expected`` accepted
        tokens (the bonus token comes on top)."""
        return (1.0 + expected) / (spent_ms + self.cost(width))

    def plain(self) -> float:
        """A round without drafts."""
        return self.at(1, 0.0)

    def best(self, confidence, spent_ms: float = 0.0, widths: Sequence[int] | None = None,
             early_stop: bool = True) -> tuple[int, float]:
        """(width, worth) of the best round over these drafts (the scheduler's ``choose_width``:
        ``early_stop`` keeps the choice for draft j blind to draft j's own confidence)."""
        return choose_width(confidence, self.widths if widths is None else widths,
                            lambda w: spent_ms + self.cost(w), early_stop=early_stop)


class WidthPolicy(Protocol):
    memory_low: bool  # memory is short: the round releases its drafter

    def yardstick(self, widths: Sequence[int]) -> Yardstick | None:
        """What a drafter that stops early measures a round with: the policy's cost curve over the
        target's listed ``widths`` and its online confidence offset (None without a cost model)."""

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

    def yardstick(self, widths):
        return None

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

    def yardstick(self, widths):
        return Yardstick(self.scheduler.costs.verify, tuple(widths), tuple(float(d) for d in self.scheduler.offsets))

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
        sched.observe_outcome(accepted)
        if round_ms is not None:
            # Every round that paid for drafting counts toward the gate, also one whose drafts
            # were all declined: its token cost a draft and a pass.
            sched.observe_round(1 + accepted, round_ms)
        if len(confidence) and shift:
            sched.observe_acceptance(confidence, accepted)


def expected_accepted(confidence) -> float:
    """Expected accepted drafts of a draft verified whole: the sum of its survivals, the
    products of the conditional confidences up to each draft (0 for no draft)."""
    c = np.asarray(confidence, dtype=np.float64)
    return float(np.cumprod(c).sum()) if c.size else 0.0


def survival_cut(confidence: np.ndarray, min_survival: float) -> int:
    """How many drafts to keep: draft j (1-based) stays while prod(c_1..c_{j-1}) >= min_survival.

    Draft 1 always stays; the decision for draft j uses only the confidences before it
    (the early stop that keeps rejection sampling lossless)."""
    survival = np.cumprod(confidence[:-1])
    below = np.flatnonzero(survival < min_survival)
    return int(below[0]) + 1 if below.size else int(confidence.shape[0])
