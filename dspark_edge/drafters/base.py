"""The drafter protocol, and the acceptance statistics drafters without a confidence head use.

A drafter proposes up to N tokens after the committed context, with the distribution q_i
each was drawn from (None for deterministic drafters) and a per-position confidence c_i
(the estimated probability that draft i is accepted given drafts 1..i-1 were). After each
round ``feedback`` says how many were accepted and which tokens were committed.
Drafters know nothing about the verification rule, nor about the target's KV cache, except one
that drafts over it (self-drafting, ``self_draft.py``), which ``bind_target`` gives the target
and its cache before each generation.

What the round uses of a drafter is stated here and nowhere else: the ``Drafter`` protocol
(``BaseDrafter`` gives its defaults), read once per generation into a ``Contract``; what one
proposal reports travels with it (``Draft.source``, ``Draft.observed``, ``Draft.record``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from ..verify import judged
from ..widths import Yardstick


@dataclass
class Draft:
    """One proposal. Besides the drafts: ``source``, which of a drafter's sources drafted them
    (the scheduler keeps drafting costs per source; None: the drafter has one); ``observed``,
    whether the confidences are this generation's observed acceptance rates (the scheduler's
    online offset then does not apply; None: the drafter's ``observed_confidence``); and
    ``record``, a JSON-ready account of what the proposal did and why, copied into the round's
    trace (``RoundInfo.drafting``)."""

    tokens: np.ndarray  # [k] int64, k may be 0
    q: np.ndarray | None  # [k, V] float64 draft distributions, or None (deterministic drafts)
    confidence: np.ndarray  # [k] float64 in [0, 1]
    source: str | None = None
    observed: bool | None = None
    record: dict | None = None

    @classmethod
    def empty(cls, record: dict | None = None) -> "Draft":
        return cls(np.zeros(0, dtype=np.int64), None, np.zeros(0), record=record)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def trimmed(self, k: int) -> "Draft":
        return replace(self, tokens=self.tokens[:k], q=None if self.q is None else self.q[:k],
                       confidence=self.confidence[:k])

    def reported(self, source: str | None, observed: bool | None, record: dict | None) -> "Draft":
        """This proposal with what it reports."""
        return replace(self, source=source, observed=observed, record=record)


@dataclass(frozen=True)
class DraftRequest:
    """What a drafter needs for one round. ``context`` is every committed token plus the
    pending one (the anchor, whose K/V the target has not seen yet). For a drafter whose
    ``needs_hidden`` is true, ``new_hidden`` holds the target's exposed hidden states
    ([n, H * layers]) of the positions committed since its previous request (since ``begin``
    for the first), in order; otherwise it is None."""

    context: Sequence[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    new_hidden: np.ndarray | None = None
    # Coupled sampling (GenerationConfig.sampling == "coupled"): the seed, and the answer
    # position the first draft is for; draft i should be ``sampling.coupled_pick(q_i, seed,
    # position + i)`` so that it equals the target's token whenever q_i is close to p_i.
    coupled_seed: int | None = None
    position: int = 0
    # With the scheduler: its measure of a round (``widths.Yardstick``: expected tokens per ms
    # by its rule and cost curve, and its online confidence offset), for a drafter whose
    # drafting costs per token: it asks this whether drafting on pays. None: no cost model
    # (a fixed draft length, or no scheduler).
    yardstick: Yardstick | None = None
    # Structured output (``GenerationConfig.grammar``): ``allowed(drafts)`` is the row of tokens
    # (bool over the target's vocabulary) the grammar allows after ``drafts`` from here, or None
    # where none can follow them (one is refused or ends the answer). A drafter that draws its
    # drafts from distributions may draw them under these rows (its q is then the distribution
    # under the row, which the target's verdict, taken under the same grammar, accounts for);
    # drafts the grammar refuses are cut before the target pass whatever the drafter does.
    # None: the answer is not constrained.
    allowed: Callable[[Sequence[int]], np.ndarray | None] | None = None


class Drafter(Protocol):
    """Everything the round uses of a drafter. ``BaseDrafter`` has the defaults; an object
    without them gets the same defaults (``contract``)."""

    name: str
    needs_hidden: bool  # wants the target's hidden states of committed positions (default False)
    # True when the confidences are themselves observed acceptance rates of this generation
    # (``AcceptanceTracker``): the scheduler's online confidence offset, which corrects a
    # calibration made elsewhere, is then not applied on top (it would correct them twice).
    # A proposal may say otherwise for itself (``Draft.observed``). Default False.
    observed_confidence: bool

    def bind_target(self, target, cache) -> None:
        """Before each generation, after the prefill: the target and its KV cache, for a drafter
        that drafts over them (default: nothing). Raise to refuse a cache it cannot share."""

    def begin(self, prompt_ids: Sequence[int]) -> None:
        """A new generation starts from ``prompt_ids``."""

    def propose(self, request: DraftRequest, rng: np.random.Generator) -> Draft: ...

    def feedback(self, drafted: int, accepted: int, committed: Sequence[int]) -> None:
        """``drafted`` tokens were verified, the first ``accepted`` kept; ``committed`` is the
        whole committed context now (without the new pending token)."""


class BaseDrafter:
    """The protocol's defaults, for drafters to inherit."""

    name = "drafter"
    needs_hidden = False
    observed_confidence = False

    def bind_target(self, target, cache) -> None:
        return None

    def begin(self, prompt_ids: Sequence[int]) -> None:
        return None

    def feedback(self, drafted: int, accepted: int, committed: Sequence[int]) -> None:
        return None


@dataclass(frozen=True)
class Contract:
    """A drafter's answers to the protocol, read once (``contract``), for the round."""

    name: str
    needs_hidden: bool
    observed_confidence: bool
    bind_target: Callable[..., None] | None


def contract(drafter) -> Contract:
    """The protocol read off ``drafter``, with ``BaseDrafter``'s defaults for what an object
    leaves out; a ``ConfigError`` when it lacks a method the round calls."""
    from ..errors import ConfigError

    missing = [m for m in ("begin", "propose", "feedback") if not callable(getattr(drafter, m, None))]
    if missing:
        raise ConfigError(f"drafter {drafter!r} lacks {', '.join(missing)}: a drafter needs begin(prompt_ids), "
                          "propose(request, rng) and feedback(drafted, accepted, committed) "
                          "(dspark_edge.drafters.base.Drafter)")
    bind = getattr(drafter, "bind_target", None)
    return Contract(name=str(getattr(drafter, "name", type(drafter).__name__)),
                    needs_hidden=bool(getattr(drafter, "needs_hidden", False)),
                    observed_confidence=bool(getattr(drafter, "observed_confidence", False)),
                    bind_target=bind if callable(bind) else None)


class AcceptanceTracker:
    """Per-position acceptance estimates from observed rounds (for drafters without a
    confidence head): c_i = P(draft i accepted | drafts before it accepted), smoothed with a
    prior so unseen positions start at ``prior``."""

    def __init__(self, max_positions: int = 16, prior: float = 0.5, prior_weight: float = 2.0) -> None:
        self.tried = np.zeros(max_positions)
        self.accepted = np.zeros(max_positions)
        self.prior, self.prior_weight = prior, prior_weight

    def update(self, drafted: int, accepted: int) -> None:
        n = min(drafted, self.tried.shape[0])
        reached = judged(n, accepted)
        self.tried[:reached] += 1
        self.accepted[:min(accepted, n)] += 1

    def confidence(self, k: int) -> np.ndarray:
        k = min(k, self.tried.shape[0])
        return (self.accepted[:k] + self.prior * self.prior_weight) / (self.tried[:k] + self.prior_weight)
