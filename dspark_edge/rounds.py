"""One decoding round: propose → choose the width → one target pass → verify → commit → feedback.

``Speculator.round`` is the whole round, in the papers' order; ``Speculator`` holds what one
generation's rounds share (the drafter and its failure budget, the width policy, the random
generator, the counts, the grammar's walk). Without a drafter a round is a plain width-1 step.
It knows nothing of text, stop strings or streaming (``pipeline.TextStream`` does), and it never
commits more than the target verified: the KV cache after a round holds the anchor and the
accepted drafts.

Its collaborators come in explicitly: the target and the pipeline's telemetry and drafter
release (``Target``), the width policy (``widths``: fixed length, survival cut or the
confidence scheduler), and the drafter, read once through its protocol
(``drafters.base.contract``). A proposal that is malformed, or a drafter method that raises,
is a drafter failure (``MAX_DRAFTER_FAILURES`` in a row stop speculation for the generation);
it never reaches the target, and the width never pads drafts the drafter did not give.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from .config import GenerationConfig, GenerationStats
from .drafters import Draft, DraftRequest
from .drafters.base import contract
from .grammar import Constraint
from .sampling import reshaped_logits, token_logprobs
from .scheduler import Decision
from .telemetry import Snapshot
from .widths import WidthPolicy
from .verify import VerifyOutcome, judged, verify_coupled, verify_greedy, verify_sampling

log = logging.getLogger(__name__)

MAX_DRAFTER_FAILURES = 3
Q_SUM_TOLERANCE = 1e-3  # float32 softmax rows over a 256k vocabulary sum to 1 within ~1e-5


@dataclass(frozen=True)
class RoundInfo:
    """One target pass: what was drafted, verified and committed, what it cost, and why."""

    width: int  # verify width of this target pass
    drafted: int
    accepted: int
    confidence: tuple[float, ...]  # the drafter's per-position confidence
    draft_n_total: int  # so far in this generation
    accepted_total: int
    decision: Decision | None = None  # the scheduler's choice and why, when it ran
    index: int = 0  # 1-based round number in this generation
    tokens: tuple[int, ...] = ()  # committed by this round: the accepted drafts, then the target's token
    draft_ms: float = 0.0  # drafting time of this round (0 when it did not draft)
    verify_ms: float = 0.0  # the target pass and the verification
    t_s: float = 0.0  # seconds since the generation began, at the end of this round
    telemetry: Snapshot | None = None  # the reading this round saw (None when nothing samples it)
    drafting: dict | None = None  # what the drafter did this round and why, when it says (``last_proposal``)
    drafts: tuple[int, ...] = ()  # the proposed draft ids, in order (the first ``accepted`` start ``tokens``)
    batch: dict | None = None  # a batched slot's round: how many drafts the shared pass verified and why

    def as_dict(self) -> dict:
        """A JSON-ready record (one trace line)."""
        from dataclasses import asdict

        d = {"round": self.index, "t_s": round(self.t_s, 6), "width": self.width, "drafted": self.drafted,
             "accepted": self.accepted, "tokens": list(self.tokens), "drafts": list(self.drafts), "confidence": [round(c, 5) for c in self.confidence],
             "draft_ms": round(self.draft_ms, 4), "verify_ms": round(self.verify_ms, 4),
             "draft_n_total": self.draft_n_total, "accepted_total": self.accepted_total,
             "decision": None, "telemetry": None, "drafting": self.drafting, "batch": self.batch}
        if self.decision is not None:
            d["decision"] = asdict(self.decision)
        if self.telemetry is not None:
            d["telemetry"] = asdict(self.telemetry)
        return d


class RoundStats:
    """Accumulates per-round counts into GenerationStats."""

    def __init__(self, max_drafts: int) -> None:
        self.rounds = self.draft_n = self.accepted = self.bonus = 0
        self.widths: dict[str, int] = {}
        self.hist: dict[str, int] = {}
        self.reached = np.zeros(max(1, max_drafts), dtype=np.int64)
        self.kept = np.zeros(max(1, max_drafts), dtype=np.int64)
        self.draft_s = self.verify_s = 0.0
        self.modes: dict[str, int] = {}

    def record(self, width: int, drafted: int, outcome) -> None:
        self.rounds += 1
        self.widths[str(width)] = self.widths.get(str(width), 0) + 1
        if drafted:
            self.draft_n += drafted
            self.accepted += outcome.accepted
            self.bonus += int(outcome.bonus)
            self.hist[str(outcome.accepted)] = self.hist.get(str(outcome.accepted), 0) + 1
            self.reached[:judged(drafted, outcome.accepted)] += 1
            self.kept[:outcome.accepted] += 1

    def finish(self, **kw) -> GenerationStats:
        used = int(np.max(np.flatnonzero(self.reached), initial=-1)) + 1
        per_pos = tuple(float(k / r) for k, r in zip(self.kept[:used], self.reached[:used]))
        return GenerationStats(rounds=self.rounds, widths=self.widths, draft_n=self.draft_n,
                               draft_n_accepted=self.accepted, accept_length_hist=self.hist,
                               acceptance_per_position=per_pos, bonus_tokens=self.bonus,
                               draft_s=self.draft_s, verify_s=self.verify_s, **kw)


@dataclass(frozen=True)
class Target:
    """What the rounds use of the pipeline: the target model, the latest telemetry reading,
    the vocabulary size drafts are checked against, ``release``, which drops a drafter the
    pipeline can load again (under a memory squeeze; the pipeline restores it later), and
    ``draft_room``, the most drafts this round may verify (None: no limit; a batched slot gets
    0 while other requests step with it), and for a slot whose drafts share passes with other
    requests' (``batching``) ``offer(cache, ids, confidence, alone)``, which runs a prefix of
    [anchor, drafts…] (``alone`` tokens when the pass is not shared, the runner's joint choice
    when it is) and ``last_choice()``, that choice's record."""

    model: object  # decoder.DecoderModel: step(cache, ids) -> logits, hidden; widths
    telemetry: Callable[[], Snapshot | None]
    vocab_size: int
    release: Callable[[], None]
    draft_room: Callable[[], int | None] = lambda: None
    offer: Callable | None = None
    last_choice: Callable[[], dict | None] = lambda: None


class Speculator:
    """The rounds of one generation. ``drafter`` None decodes plainly; ``policy`` chooses how
    many drafts each round verifies (``widths``); ``max_drafts`` caps a round's drafts;
    ``seed`` is coupled sampling's, None otherwise; ``constraint`` walks ``cfg.grammar``
    (``grammar.Constraint``): drafts the grammar refuses are cut before the pass, and every row
    of the pass is masked with the grammar's state after the drafts before it."""

    def __init__(self, target: Target, cfg: GenerationConfig, drafter, policy: WidthPolicy, max_drafts: int,
                 rng: np.random.Generator, seed: int | None, constraint: Constraint | None = None) -> None:
        self.target, self.cfg = target, cfg
        self.constraint = constraint
        self._masks: np.ndarray | None = None  # this round's allowed tokens per pass row (with a grammar)
        self.drafter, self.policy = drafter, policy
        self.max_drafts = max_drafts
        self.rng, self.seed = rng, seed
        self.stats = RoundStats(max_drafts)
        self.disabled: str | None = None  # why speculation stopped mid-generation, when it did
        self.failures = 0  # consecutive drafter failures
        self.contract = None if drafter is None else contract(drafter)  # what the round uses of it
        wants_hidden = self.contract is not None and self.contract.needs_hidden
        # The target's hidden states since the drafter last read them (a DSpark drafter's input).
        self.hidden_rows: list[np.ndarray] | None = [] if wants_hidden else None
        # With cfg.logprobs: the latest round's tokens' log-probabilities, read from its pass's
        # logits before the next pass reuses their buffer.
        self.logprobs: list | None = None
        # With penalties: where the answer starts in ``committed``, and this round's answer so far.
        self.answer_start = 0
        self._answer: list[int] = []

    def first_logits(self, logits: np.ndarray) -> np.ndarray:
        """The distribution the answer's first token is drawn from, from the prefill's last
        row of logits ([V]): the logit bias (the answer is empty: no penalty yet) and the grammar's
        first mask applied, as every later position gets them."""
        cfg = self.cfg
        if cfg.reshapes_logits:
            logits = reshaped_logits(logits[None], (), (), cfg.presence_penalty, cfg.frequency_penalty,
                                     cfg.logit_bias)[0]
        if self.constraint is not None:
            _, _, masks = self.constraint.masks(())
            logits = Constraint.apply(logits[None], masks)[0]
        return logits

    def begin(self, committed: list[int], cache, first: int | None = None) -> None:
        """After the prefill: bind a drafter that drafts over the target's KV cache, then start it.
        ``committed`` is the prompt: what follows it is the answer (penalties count its tokens);
        ``first`` the answer's first token, chosen from the prefill (the grammar takes it)."""
        self.answer_start = len(committed)
        if self.constraint is not None and first is not None:
            self.constraint.take([first])
        if self.drafter is None:
            return
        try:
            if self.contract.bind_target is not None:
                self.contract.bind_target(self.target.model, cache)
            self.drafter.begin(committed)
        except Exception as exc:  # a drafter that could not start is not asked to propose
            self._failed("begin", exc, fatal=True)

    def round(self, cache, committed: list[int], pending: int, position: int, budget: int, t0: float,
              record: Callable[[RoundInfo], None]) -> RoundInfo:
        """One round after ``committed`` (extended here by ``pending`` and the accepted drafts):
        propose → choose the width → one target pass → verify → commit → feedback. ``position``
        is the answer position of ``pending``'s successor; ``budget`` the most drafts the answer
        can still use; ``record`` receives the round before the drafter's feedback (observers
        see the drafter's state of the round)."""
        failures, policy, st = self.failures, self.policy, self.stats
        snap = self.target.telemetry()
        wants = policy.wants_draft(snap)
        if policy.memory_low and self.drafter is not None:
            self._unload(snap)
        # Propose: at most what the widths, the answer and the cache can still use.
        k_max = min(self.max_drafts, budget, cache.free - 1)
        room = self.target.draft_room()
        if room is not None:
            k_max = min(k_max, room)
        draft, draft_ms, t_d = Draft.empty(), None, None
        if self.drafter is not None and k_max > 0 and wants:
            t_d = time.perf_counter()
            draft = self._propose(committed + [pending], k_max, position)
            draft_ms = (time.perf_counter() - t_d) * 1e3
            st.draft_s += draft_ms / 1e3
        own_drafts, forced = len(draft), 0
        if self.constraint is not None:
            draft, forced = self._constrain(draft, k_max - len(draft) if (self.cfg.speculative and wants) else 0)
        # Confidences that are already this generation's observed rates get no online offset.
        shift = self.contract is not None and not (self.contract.observed_confidence if draft.observed is None
                                                   else draft.observed)
        # Choose the width: the policy's count, then the widest listed width the drafts fill.
        keep, decision = policy.choose(draft.confidence, snap, shift, draft.source, draft_ms)
        if decision is not None:
            st.modes[decision.mode] = st.modes.get(decision.mode, 0) + 1
        widths = self.target.model.widths
        width = max(w for w in widths if w <= min(keep, len(draft)) + 1)
        # A batched slot offers every draft up to the widest width; the pass may verify more
        # or fewer than its own choice ``width`` when it is shared (``Target.offer``).
        yardstick = policy.yardstick(widths) if self.target.offer is not None and len(draft) else None
        offered = draft.trimmed(max(w for w in widths if w <= len(draft) + 1) - 1) if yardstick else None
        draft = draft.trimmed(width - 1)
        # One target pass over [pending, drafts…], and the verdict.
        if self.cfg.reshapes_logits:
            self._answer = committed[self.answer_start:] + [pending]
        t_v = time.perf_counter()
        choice = None
        if yardstick is not None and offered is not None:
            outcome, draft = self._verify_offered(cache, pending, offered, yardstick, width, position)
            choice = self.target.last_choice()
            width = len(draft) + 1
        else:
            outcome = self._verify(cache, pending, draft, position)
        verify_ms = (time.perf_counter() - t_v) * 1e3
        st.verify_s += verify_ms / 1e3
        round_ms = None if t_d is None else (time.perf_counter() - t_d) * 1e3
        policy.learn(width, verify_ms, round_ms, draft.confidence, outcome.accepted, shift)
        # Commit the anchor and the accepted drafts; the rest of the pass is rolled back.
        cache.commit(1 + outcome.accepted)
        committed.append(pending)
        committed.extend(outcome.tokens[:-1])
        st.record(width, len(draft), outcome)
        info = RoundInfo(width, len(draft), outcome.accepted, tuple(float(c) for c in draft.confidence),
                         st.draft_n, st.accepted, decision, index=st.rounds,
                         tokens=tuple(int(t) for t in outcome.tokens), draft_ms=draft_ms or 0.0,
                         verify_ms=verify_ms, t_s=time.perf_counter() - t0, telemetry=snap,
                         drafting=_drafting_record(draft.record, forced),
                         drafts=tuple(int(t) for t in draft.tokens), batch=choice)
        record(info)
        # Feedback for the drafter's own learning: its own drafts only (the grammar's come after them).
        own = min(len(draft), own_drafts)  # the grammar's forced drafts come after the drafter's
        if self.drafter is not None and own > 0:
            try:
                self.drafter.feedback(own, min(outcome.accepted, own), committed)
            except Exception as exc:
                self._failed("feedback", exc)
        if self.failures == failures:  # a round without a failure ends the run of failures
            self.failures = 0
        return info

    def _constrain(self, draft: Draft, room: int) -> tuple[Draft, int]:
        """The drafts the grammar lets the pass verify, and how many it forced after them (up to
        ``room``); the masks of the pass's rows go to ``_masks``. Drafts after the first the
        grammar refuses could never be accepted: they are cut."""
        allowed, more, self._masks = self.constraint.masks(draft.tokens, room)
        if more:
            return _with_forced(draft, more, self.target.vocab_size), len(more)
        if allowed < len(draft) and draft.q is not None and self.cfg.temperature > 0 and self.seed is None:
            # Rejection sampling with the drafter's q: the refused draft stays, to be rejected
            # there and the token drawn from max(p - q, 0); drawing it from p instead (as a cut
            # would) biases the answer wherever q gave refused tokens mass.
            self._masks = np.concatenate([self._masks, self._masks[-1:]])  # (its successor's: never read)
            return draft.trimmed(allowed + 1), 0
        return draft.trimmed(allowed), 0  # greedy, coupled or one-hot drafts: a cut is the same verdict

    def _unload(self, snap: Snapshot) -> None:
        """Memory is low: stop drafting, and release a drafter the pipeline can load again."""
        self.disabled = f"available memory {snap.mem_available_mb:.0f} MiB is low: drafter unloaded"
        log.warning("%s", self.disabled)
        self.drafter, self.hidden_rows = None, None
        self.target.release()

    def _propose(self, context: list[int], k_max: int, position: int) -> Draft:
        """The drafter's checked proposal; an empty draft when it fails (a drafter must never
        take the generation down; enough failures in a row disable it)."""
        try:
            new_hidden = None
            if self.hidden_rows is not None:
                new_hidden = np.concatenate(self.hidden_rows) if self.hidden_rows else None
                self.hidden_rows.clear()
            cfg = self.cfg
            proposal = self.drafter.propose(DraftRequest(
                context, k_max, cfg.temperature, cfg.top_k, cfg.top_p, new_hidden, coupled_seed=self.seed,
                position=position, yardstick=self.policy.yardstick(self.target.model.widths),
                allowed=None if self.constraint is None else self.constraint.allowed_after), self.rng)
            check_draft(proposal, k_max, self.target.vocab_size)
        except Exception as exc:
            self._failed("propose", exc)
            return Draft.empty()
        return proposal

    def _failed(self, where: str, exc: Exception, fatal: bool = False) -> None:
        """Every drafter failure (in begin, propose or feedback) takes this path: logged, counted
        toward ``MAX_DRAFTER_FAILURES`` rounds in a row (``fatal``: at once), then speculation stops
        for this generation. The output never depends on it: a failed proposal verifies no drafts."""
        self.failures = MAX_DRAFTER_FAILURES if fatal else self.failures + 1
        log.warning("drafter %s failed in %s (%s: %s)", self.contract.name, where, type(exc).__name__, exc)
        if self.failures >= MAX_DRAFTER_FAILURES:
            self.disabled = (f"failed to start, in {where}: " if fatal else
                             f"{self.failures} consecutive failures, last in {where}: ") + f"{type(exc).__name__}: {exc}"
            log.warning("speculation disabled for this generation: %s", self.disabled)
            self.drafter, self.hidden_rows = None, None

    def _verify_offered(self, cache, pending: int, offered: Draft, yardstick, alone: int,
                        position: int) -> tuple[VerifyOutcome, Draft]:
        """``_verify`` for a batched slot: the runner runs a prefix of the offered drafts (the
        confidences as the scheduler sees them go with them); the drafts it ran are verified."""
        ids = np.concatenate(([pending], offered.tokens)).astype(np.int64)
        out = self.target.offer(cache, ids, yardstick.shifted(offered.confidence), alone)
        draft = offered.trimmed(out.logits.shape[0] - 1)
        return self._verify(cache, pending, draft, position, out), draft

    def _verify(self, cache, pending: int, draft: Draft, position: int, out=None) -> VerifyOutcome:
        """One target pass over [pending, drafts…] (``out``, when it ran already) and the
        verification of the drafts; row 0 decides answer position ``position``."""
        cfg = self.cfg
        if out is None:
            out = self.target.model.step(cache, np.concatenate(([pending], draft.tokens)).astype(np.int64))
        logits = out.logits
        if cfg.reshapes_logits:  # the distribution plain decoding would have at each position
            logits = reshaped_logits(out.logits[:len(draft) + 1], self._answer, draft.tokens,
                                     cfg.presence_penalty, cfg.frequency_penalty, cfg.logit_bias)
        if self.constraint is not None:  # row i: the grammar's state after drafts[:i] (``round``)
            logits = Constraint.apply(logits[:len(draft) + 1], self._masks)
        if cfg.temperature == 0.0:
            outcome = verify_greedy(draft.tokens, logits)
        elif self.seed is not None:
            outcome = verify_coupled(draft.tokens, logits, cfg.temperature, cfg.top_k, cfg.top_p,
                                     self.seed, position)
        else:
            outcome = verify_sampling(draft.tokens, draft.q, logits, cfg.temperature,
                                      cfg.top_k, cfg.top_p, self.rng)
        if self.constraint is not None:
            self.constraint.take(outcome.tokens)
        if self.hidden_rows is not None and out.hidden is not None:
            self.hidden_rows.append(out.hidden[:1 + outcome.accepted].copy())
        if cfg.logprobs is not None:
            self.logprobs = token_logprobs(out.logits[:len(outcome.tokens)], outcome.tokens, cfg.logprobs)
        return outcome


def _with_forced(draft: Draft, more: list[int], vocab: int) -> Draft:
    """``draft`` followed by the tokens a grammar forces after it, drafted with confidence 1
    (deterministic drafts: one-hot rows where the drafter gave distributions)."""
    n = len(more)
    q = draft.q
    if q is not None:
        extra = np.zeros((n, vocab), dtype=q.dtype)
        extra[np.arange(n), more] = 1.0
        q = np.concatenate([q, extra])
    return replace(draft, tokens=np.concatenate([draft.tokens, np.asarray(more, dtype=np.int64)]), q=q,
                   confidence=np.concatenate([draft.confidence, np.ones(n)]))


def _drafting_record(record, forced: int) -> dict | None:
    """The round trace's account of the drafting: the drafter's own, and how many drafts the
    grammar forced after its drafts, when it did."""
    out = dict(record) if isinstance(record, dict) else None
    if forced:
        out = {**(out or {}), "grammar_forced": forced}
    return out


def check_draft(draft: Draft, k_max: int, vocab: int) -> None:
    """A drafter's proposal must be usable as is: a bad one counts as a drafter failure, never
    reaches the target (an out-of-vocabulary id would fail the target pass)."""
    k = len(draft)
    if draft.tokens.ndim != 1 or k > k_max:
        raise ValueError(f"draft has shape {draft.tokens.shape}; at most {k_max} tokens were asked for")
    if k and (draft.tokens.min() < 0 or draft.tokens.max() >= vocab):
        raise ValueError(f"draft token ids must lie in [0, {vocab}); got {draft.tokens.tolist()}")
    c = draft.confidence
    if c.shape != (k,) or (k and not (np.all(np.isfinite(c)) and c.min() >= 0.0 and c.max() <= 1.0)):
        raise ValueError(f"draft confidences must be {k} numbers in [0, 1]; got {np.asarray(c).tolist()}")
    q = draft.q
    if q is not None and (q.ndim != 2 or q.shape[0] != k or q.shape[1] != vocab):
        raise ValueError(f"draft distributions have shape {q.shape}; expected ({k}, {vocab})")
    if q is not None and k:
        # Rejection sampling is lossless only for a real distribution q: a negative, non-finite
        # or unnormalised row would bias the output, so it is a drafter failure like a bad id.
        sums = q.sum(axis=1, dtype=np.float64)
        if not np.all(np.isfinite(sums)) or q.min() < 0.0 or np.abs(sums - 1.0).max() > Q_SUM_TOLERANCE:
            raise ValueError(f"draft distributions must be finite, non-negative and sum to 1 "
                             f"(within {Q_SUM_TOLERANCE:g}); row sums {np.round(sums, 6).tolist()}, "
                             f"min {float(q.min()):.3g}")
