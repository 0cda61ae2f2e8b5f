"""Self-drafting: a quantized copy of the target (another precision of the same engine folder,
INT8 by default) drafts for it, reading and writing the target's own KV cache.

The copy has the target's architecture, so its K/V have the target's layout: instead of a
cache of its own that would have to catch up on every committed token, it runs over the
target's cache (a second binding of the same buffers). Each round it runs the pending token
and then its own drafts one at a time at the positions after the committed ones, attending to
the target's exact K/V of the context; the target's verify pass then writes its own K/V over
those positions before it reads them, so the copy's values never reach the output. No file is
exported for it and no second cache is held. In a batched server (``batching``) the slots'
drafters share one copy, which drafts over the slot's row of the batch's K/V while the slot's
request is the only one decoding; with others decoding the slot offers only its n-gram drafts.

Under a grammar (``DraftRequest.allowed``) the copy draws each draft from the tokens the grammar
allows after the drafts before it (its q is then that masked distribution), and stops drafting
where the drafts end the answer.

A drafted token costs a step of the copy (on a 2-core AVX2 CPU an INT8 step is about 55 % of an
FP32 step), so drafting stops early where the drafts are unlikely to be accepted: before each
further draft, the expected tokens per millisecond of the round with it (its survival guessed
from the last conditional confidence) must beat the round without it, as the width policy's
``Yardstick`` measures rounds (``DraftRequest.yardstick``: the scheduler's rule on its
corrected cost curve). Without one (a fixed draft length) it drafts the length asked for.

Confidences: the observed acceptance rate of drafts, per bin of the copy's margin (top-1 minus
top-2 probability) at that position, computed before the draft is drawn, so a width choice made
from them never looks at the draw it admits. They are observed rates (``observed_confidence``),
kept across generations: how often the copy agrees with the target is a property of the two
graphs, not of a prompt, and a 64-token answer is too short to learn it afresh (with counts reset
per generation the scheduler drafted 1-2 tokens a round where 3 paid best). They only shape the
draft length when the scheduler is on, whose choices depend on measured timings anyway; with a
fixed draft length the copy drafts exactly that many.

``ngram`` (an n-gram drafter, "ngram+self"): it proposes first (its lookup costs a fraction of a
millisecond); its drafts are used when their expected tokens per millisecond (the scheduler's
width rule on their confidences) match what drafting with the copy is expected to give, and the
copy drafts otherwise. With a fixed draft length k, the n-gram drafts are used when there are k
of them and their expected accepted count (the sum of their survivals) reaches the copy's.

Where the copy drafts, the n-gram drafts still serve as guesses (a staged check): the copy's
first pass runs the pending token and the first j guesses together (one pass of width j + 1
instead of one of width 1), and its tokens are drawn from those rows in order for as long as
each drawn token equals the guess the next row was computed after. A chain of m agreed guesses
gives m + 1 drafts for one pass; drafting then goes on one step at a time. The drafts are the
copy's own, drawn from the copy's distributions exactly as step-by-step drafting would draw
them, so what the target accepts and how the drafts are distributed do not change: only the
drafting time does. Whether a draft follows depends on the drafts before it, never on itself.
j maximises the expected drafts per millisecond of the copy's pass (each guess survives with
the n-gram confidence times the copy's acceptance rate), with the copy's pass cost per width
from this device's profile (or measured when the drafter is bound) and corrected by the passes
it times. On a 2-core AVX2 CPU an INT8 pass of width 2 costs 1.16 (64 positions cached) to 1.43
(256) times one of width 1, so the check gains little there (docs/notes/2026-11-30-to-12-02-measurements.md); where a wider
pass costs about what a narrow one does, a replay puts the gain near 10 %.

The n-gram drafts also continue the copy's (``NgramDrafter.extend``: the lookup run past the
copy's drafts as if they were committed). Such drafts cost a lookup, not a step, so with the
scheduler, before each further step of the copy, the round as it stands plus the continuation
(its best width by the scheduler's rule, the continuation's confidences shifted as the scheduler
would shift them) is weighed against the further steps plus a continuation after them, guessed
to be as good as the one found now; the copy stops where stopping promises more, and the
continuation follows its drafts for the scheduler to verify as many as pay. With a fixed length
k, after each draft of the copy the continuation completes the k drafts where it promises more
tokens per ms of the round than the copy drafting the rest (the target's pass at width k + 1,
from the device profile, costs the same either way). A continuation is a
function of the drafts before it, so under sampling it is drawn from a point mass at itself
(its q row is one-hot) and the rejection rule stays exact.

``ngram+dspark+self``: the cheap drafter in front of the copy is ``ngram+dspark``
(``ngram_dspark.py``), whose proposal each round is the n-gram drafts or a DSpark block (a
pass of the DSpark drafter's graph, a fraction of a copy step). Everything above holds with
that proposal in place of the n-gram drafts: it is used alone where it promises more tokens per
millisecond than drafting with the copy (the DSpark drafter's calibrated confidences shifted as
the scheduler shifts them), and otherwise its drafts are the guesses of the copy's first pass;
continuations are the n-gram drafter's. Each proposal reports which of the two drafted, so the
scheduler keeps their costs apart. The DSpark drafter reads every committed position's hidden
states: this drafter then asks for them (``needs_hidden``) and hands them on every round,
including rounds that draft nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..backends import BackendOptions
from ..decoder import DecoderModel
from ..errors import ConfigError, EngineError
from ..grammar import Constraint
from ..manifest import Manifest, verify_role_files
from ..sampling import coupled_pick, greedy_margin, probs, sample, top_margin
from ..scheduler import CostModel
from ..verify import judged
from ..widths import Yardstick, expected_accepted
from .base import BaseDrafter, Draft, DraftRequest

log = logging.getLogger(__name__)

# Margin bins (top-1 minus top-2 probability of the copy) and the acceptance each starts from:
# the embedded default's INT8 copy on 120 of the drafter-training answers (15,912 tokens, none
# from the benchmark set) agreed with the FP32 target 74 / 95 / 98.8 / 99.7 % of the time in
# the first four bins and 99.9-100 % above (capped at 0.99 here). Another copy (INT4 agrees far
# less) moves its counts away from these within a few rounds. Measured with `python
# bench/self_draft.py agreement --engine engines/smollm2-135m --answers
# drafters/smollm2-135m-answers.npz --sample 120`.
MARGIN_EDGES = (0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9)
MARGIN_PRIOR = (0.74, 0.95, 0.98, 0.99, 0.99, 0.99, 0.99, 0.99)
PRIOR_WEIGHT = 4.0


class SelfDrafter(BaseDrafter):
    name = "self"
    needs_hidden = False
    observed_confidence = True

    def __init__(self, engine_dir: str | Path, target_manifest: Manifest, precision: str = "int8",
                 options: BackendOptions | None = None, verify_hashes: bool = True, max_tokens: int = 8,
                 ngram=None, shared: dict | None = None) -> None:
        """``shared``: loaded copies by (engine folder, precision), for drafters that draft for
        the slots of one batch (``Pipeline.batch_slots``): the first one loads the copy, the
        others use it (its session is read-only; each drafter keeps its own state)."""
        engine_dir = Path(engine_dir)
        present = target_manifest.precisions("target", "onnxruntime")
        if precision not in present:
            raise ConfigError(f"self-drafting with {precision} needs the engine's {precision} target graph; "
                              f"{engine_dir} has {present}: export it with `python -m export target --precisions "
                              f"{','.join(sorted(set(present) | {precision}))}` or pick one of {present}")
        key = (str(engine_dir.resolve()), precision)
        if shared is not None and key in shared:
            self.model = shared[key]
        else:
            verify_role_files(target_manifest, engine_dir, "target", precision, check_hashes=verify_hashes)
            self.model = DecoderModel(target_manifest, engine_dir, precision, options=options)
            if shared is not None:
                shared[key] = self.model
        if 1 not in self.model.widths:
            raise EngineError(f"{engine_dir}: the {precision} graph lists no width-1 variant")
        self.precision = precision
        self.max_tokens = max_tokens
        self.ngram = ngram
        self.name = f"self:{precision}" if ngram is None else f"{ngram.name}+self:{precision}"
        # ``ngram+dspark+self``: the DSpark drafter inside reads the target's hidden states.
        self.needs_hidden = bool(getattr(ngram, "needs_hidden", False))
        self._target_cache = None
        self._view = None
        self._run = self._run_alone  # the copy's pass: (view, ids) → logits [w, V]
        self._room = lambda: None  # the most drafts the copy may draw this round (None: no limit)
        self._widths: tuple[int, ...] = ()
        self.step_ms = 0.0  # moving average of one drafting step
        self._source = "self"  # of the latest proposal, for its feedback: "self" or the cheap drafter's source
        self._observed = True  # whether the latest proposal's confidences are observed rates
        self._bins: list[int] = []  # margin bin of each draft of the latest self proposal
        self.tried = np.zeros(len(MARGIN_PRIOR))  # judged drafts per margin bin, across generations
        self.accepted = np.zeros(len(MARGIN_PRIOR))
        self.engine_dir = engine_dir
        self.copy_costs: CostModel | None = None  # the copy's pass ms per width (staged checks)
        self._target: DecoderModel | None = None
        self.target_ms: dict[int, float] | None = None  # its pass ms per width, once a fixed length's fill needs it
        self._guesses: list[int] = []  # n-gram drafts checked by the latest self proposal's first pass
        self._copied = 0  # drafts of the latest self proposal that the copy drew; the n-gram's follow
        self._agreed = 0  # how many of them the copy drew
        self.staged = [0, 0, 0]  # staged checks so far: passes, guesses checked, guesses the copy drew
        self.extended = [0, 0]  # proposals the n-gram drafts extended, and their drafts
        self._record: dict | None = None  # what the latest proposal did (reported with it: Draft.record)

    # -- the target's cache -------------------------------------------------------------------
    def bind_target(self, target: DecoderModel, cache) -> None:
        """Draft over ``cache`` (the target's KV cache). Refuses a target whose cache the copy
        cannot share (another backend, K/V type or layout)."""
        if cache is self._target_cache:
            return
        if getattr(target, "precision", None) == self.precision:
            raise ConfigError(f"self-drafting with {self.precision} drafts with the target's own {self.precision} "
                              "graph: each draft would cost a full target step and no round could gain; load the "
                              "target in fp32 or pick another drafter ('ngram')")
        runner = getattr(target, "runner", None)
        if runner is not None:
            # A slot of a batched server: the copy (one for every slot) runs over the slot's row
            # of the runner's K/V, between the batch's passes (``BatchRunner.copy_forward``).
            from ..batching import SlotCache

            self.model = runner.attach_copy(self.model)
            self._view = SlotCache(cache.capacity, cache.slot)
            self._run = lambda view, ids: runner.copy_forward(view.slot, view.length, ids)
            self._room = lambda: runner.copy_room(cache.slot)
        else:
            view = getattr(self.model.session, "view_cache", None)
            if view is None or target.backend != "onnxruntime":
                raise ConfigError("self-drafting shares the target's KV cache and needs the onnxruntime backend; "
                                  "use the n-gram drafter with the TensorRT backend")
            self._view = view(cache)
            self._run = self._run_alone
            self._room = lambda: None
        self._target_cache = cache
        self._widths = target.widths
        if target is not self._target:
            self._target, self.target_ms = target, None
        if self.ngram is not None and self.copy_costs is None:  # the staged check's pass costs
            from ..profile import cost_curve

            self.copy_costs = CostModel(cost_curve(self.model, self.engine_dir)[0], 0.0)

    def _run_alone(self, view, ids: np.ndarray) -> np.ndarray:
        return self.model.step(view, ids).logits

    def _target_pass_ms(self, width: int) -> float | None:
        """The target's pass ms at ``width``, for a fixed length's fill: from the device profile
        (measured where there is none) the first time a fill is weighed. With the scheduler the
        requests carry its corrected curve instead, so a scheduled generation never measures it
        (the pipeline has measured it already)."""
        if self.target_ms is None:
            from ..profile import cost_curve

            self.target_ms = cost_curve(self._target, self.engine_dir)[0]
        return self.target_ms.get(width)

    # -- the drafter protocol -----------------------------------------------------------------
    def begin(self, prompt_ids: Sequence[int]) -> None:
        if self.ngram is not None:
            self.ngram.begin(prompt_ids)

    @property
    def rate(self) -> float:
        """Observed conditional acceptance of the copy's drafts so far (with the priors)."""
        prior = float(np.mean(MARGIN_PRIOR))
        return float((self.accepted.sum() + prior * PRIOR_WEIGHT) / (self.tried.sum() + PRIOR_WEIGHT))

    def _confidence(self, margin: float) -> tuple[int, float]:
        b = int(np.searchsorted(MARGIN_EDGES, margin, side="right"))
        return b, float((self.accepted[b] + MARGIN_PRIOR[b] * PRIOR_WEIGHT) / (self.tried[b] + PRIOR_WEIGHT))

    def _self_value(self, k_max: int, ys: Yardstick) -> float:
        """Expected tokens per ms of drafting with the copy, from its observed acceptance rate."""
        alpha, d = self.rate, max(self.step_ms, 1e-3)
        best = ys.plain()
        for w in ys.widths:
            k = w - 1
            if 1 <= k <= k_max:
                best = max(best, ys.at(w, sum(alpha ** i for i in range(1, k + 1)), k * d))
        return best

    def propose(self, request: DraftRequest, rng: np.random.Generator) -> Draft:
        """The n-gram drafts or the copy's, reporting which (``Draft.source``), whether the
        confidences are observed rates (the copy's are; the n-gram drafter's may not be) and
        what the proposal did (``Draft.record``)."""
        self._observed = True
        draft = self._propose(request, rng)
        return draft.reported(self._source, self._observed, self._record)

    def _observed_rates(self, draft: Draft) -> bool:
        """Whether the cheap drafter's ``draft`` carries observed acceptance rates (the scheduler's
        online offset then does not apply): what the proposal says, else the drafter's default."""
        return self.ngram.observed_confidence if draft.observed is None else bool(draft.observed)

    def _propose(self, request: DraftRequest, rng: np.random.Generator) -> Draft:
        if self.needs_hidden:  # every committed position's features reach the DSpark drafter
            self.ngram.keep_hidden(request.new_hidden)
            request = replace(request, new_hidden=None)
        k_max = min(request.max_tokens, self.max_tokens)
        if k_max < 1:
            return Draft.empty()
        ys = request.yardstick
        guesses: list[int] = []
        # A slot of a batched server among other active ones: the copy does not draft (see
        # ``BatchRunner.copy_room``); the n-gram drafts, if any, are offered to the shared pass.
        barred = self._room() == 0
        if self.ngram is not None:
            ng = self.ngram.propose(request, rng)
            if len(ng) and (barred or self._use_ngram(ng, k_max, ys)):
                self._source = ng.source or "ngram"
                self._observed = self._observed_rates(ng)
                self._record = {"source": self._source, "drafts": len(ng),
                                "why": "other requests are decoding: the copy does not draft" if barred else
                                       f"the {self._source} drafts promise more than the copy's"}
                return ng
        if barred:
            self._source = "self"
            self._record = {"source": "self", "copied": 0, "continued": 0,
                            "why": "other requests are decoding: the copy does not draft"}
            return Draft.empty()
        if self.ngram is not None:
            j = self._stage_width(ng, k_max, ys)
            guesses = [int(t) for t in ng.tokens[:j]]
        self._source = "self"
        if ys is not None and self._self_value(k_max, ys) <= ys.plain():
            self._record = {"source": "self", "copied": 0, "continued": 0,
                            "why": "drafting with the copy is not expected to pay"}
            return Draft.empty()
        return self._draft(request, k_max, ys, rng, guesses)

    def _extension(self, tokens: Sequence[int], room: int, ys: Yardstick | None) -> Draft:
        """The n-gram drafts continuing the copy's ``tokens`` (at most ``room``), their
        confidences as the scheduler would shift them."""
        if self.ngram is None or room < 1 or not tokens:
            return Draft.empty()
        ext = self.ngram.extend(tokens, room)
        if not len(ext):
            return ext
        conf = ext.confidence if self._observed_rates(ext) or ys is None else ys.shifted(ext.confidence)
        return Draft(ext.tokens, None, np.clip(np.asarray(conf, dtype=np.float64), 0.0, 1.0))

    def _stage_width(self, ng: Draft, k_max: int, ys: Yardstick | None) -> int:
        """How many n-gram drafts the copy's first pass checks (0: none): the j whose pass of
        width j + 1 promises the most drafts per millisecond, a guess surviving with its n-gram
        confidence times the copy's acceptance rate. At most k_max - 1: the chain then never
        outgrows the drafts asked for. Every width is scanned (no early stop): the drafts are the
        copy's whatever j is, so the choice does not touch what the target accepts."""
        costs = self.copy_costs
        n = min(len(ng), k_max - 1)
        if costs is None or n < 1 or 1 not in costs.verify_ms:
            return 0
        conf = ng.confidence if self._observed_rates(ng) or ys is None else ys.shifted(ng.confidence)
        guessed = np.clip(np.asarray(conf[:n], dtype=np.float64), 0.0, 1.0) * self.rate
        # The copy's own pass, measured by the same rule on the copy's cost curve.
        width, _ = Yardstick(costs.verify, tuple(costs.verify_ms)).best(guessed, early_stop=False)
        return width - 1

    def _use_ngram(self, ng: Draft, k_max: int, ys: Yardstick | None) -> bool:
        if ys is None:  # a fixed draft length: the n-gram drafts, free, if they reach as far
            if len(ng) < k_max:
                return False
            reach = expected_accepted(np.clip(ng.confidence[:k_max], 0.0, 1.0))
            return reach >= sum(self.rate ** i for i in range(1, k_max + 1))
        fits = [w for w in self._widths if w - 1 <= len(ng)]
        if len(fits) < 2:
            return False
        # As the scheduler will shift them (observed rates it leaves as they are).
        conf = ng.confidence if self._observed_rates(ng) else ys.shifted(ng.confidence)
        _, value = ys.best(conf, widths=fits)
        return value >= self._self_value(k_max, ys)

    def _draft(self, request: DraftRequest, k_max: int, ys: Yardstick | None, rng: np.random.Generator,
               guesses: Sequence[int] = ()) -> Draft:
        cache, view = self._target_cache, self._view
        self._guesses, self._agreed, self._copied = [], 0, 0
        self._record = {"source": "self", "copied": 0, "continued": 0, "why": "not bound to this context's cache"}
        if view is None or cache is None or cache.length != len(request.context) - 1:
            return Draft.empty()  # not bound to the cache this context is in (e.g. a replay)
        k_max = min(k_max, cache.free - 1)
        listed = sorted(w - 1 for w in self._widths if 1 <= w - 1 <= k_max)
        if not listed:
            self._record["why"] = "no listed width fits the room left in the cache"
            return Draft.empty()
        guesses = list(guesses)[:max(k_max - 1, 0)]
        greedy = request.temperature == 0.0
        tokens: list[int] = []
        qs: list[np.ndarray] = []
        conf: list[float] = []
        self._bins = []
        survival, expected, last_c = 1.0, 0.0, self.rate
        staged_ms, steps = 0.0, 0  # drafting so far: the staged pass, then steps of width 1
        ext, ext_at = Draft.empty(), -1  # the n-gram drafts continuing the first ext_at drafts
        fill_ms = self._target_pass_ms(k_max + 1) if ys is None and self.ngram is not None else None

        def extension() -> Draft:
            nonlocal ext, ext_at
            if ext_at != len(tokens):
                ext, ext_at = self._extension(tokens, k_max - len(tokens), ys), len(tokens)
            return ext

        def guessed(n: int) -> float:
            """Expected accepted drafts among the next ``n`` the copy has not drawn yet, their
            conditional confidences guessed as the last one."""
            return sum(survival * last_c ** e for e in range(1, n + 1))

        def fills() -> bool:
            """A fixed length: do the n-gram drafts after the copy's promise more tokens per ms
            for the k drafts than the copy drafting the rest (same verify width either way)?"""
            if fill_ms is None or len(extension()) < k_max - len(tokens):
                return False
            d = max(self.step_ms, 1e-3)
            spent = staged_ms + steps * d
            reach = survival * expected_accepted(ext.confidence[:k_max - len(tokens)])
            rest = guessed(k_max - len(tokens))
            return ((1.0 + expected + reach) / (spent + fill_ms)
                    >= (1.0 + expected + rest) / (spent + (k_max - len(tokens)) * d + fill_ms))

        def open_() -> bool:
            """Whether a further draft can follow (under a grammar: one that does not end the answer)."""
            return request.allowed is None or request.allowed(tokens) is not None

        def take(logits: np.ndarray) -> int:
            """Draw the next draft from one row of the copy's logits (under a grammar, from the
            tokens it allows there: ``open_()`` was checked); its confidence is set before the draw."""
            nonlocal survival, expected, last_c
            if request.allowed is not None:
                logits = Constraint.apply(logits[None], request.allowed(tokens)[None])[0]
            if greedy:
                x, margin = greedy_margin(logits)
                b, c = self._confidence(margin)
            else:
                q = probs(logits, request.temperature, request.top_k, request.top_p)
                b, c = self._confidence(top_margin(q)[1])  # before the draw
                x = (sample(q, rng) if request.coupled_seed is None
                     else coupled_pick(q, request.coupled_seed, request.position + len(tokens)))
                qs.append(q)
            tokens.append(x)
            conf.append(c)
            self._bins.append(b)
            survival *= c
            expected += survival
            last_c = c
            return x

        x = int(request.context[-1])
        view.length = cache.length
        stop, why = False, "every length asked for"
        try:
            if guesses:
                # The staged check: rows 0..j of one pass over the pending token and the guesses.
                t = time.perf_counter()
                rows = self._run(view, np.asarray([x, *guesses], dtype=np.int64))
                for i in range(len(guesses) + 1):
                    if not open_():
                        stop, why = True, "the grammar ends the answer at the drafts"
                        break
                    x = take(rows[i])
                    if i == len(guesses) or x != guesses[i]:
                        break
                    self._agreed += 1
                view.commit(self._agreed + 1)  # K/V of the pending token and the agreed guesses
                staged_ms = (time.perf_counter() - t) * 1e3
                self.copy_costs.observe(len(guesses) + 1, staged_ms)
                self._guesses = guesses
                self.staged[0] += 1
                self.staged[1] += len(guesses)
                self.staged[2] += self._agreed
            for goal in listed if not stop else ():
                if ys is not None and tokens and goal > len(tokens):
                    # Before drafting up to ``goal``: does the round with them promise more tokens
                    # per ms than the round as it stands? Their conditional confidences are guessed
                    # as the last one (they are not drawn yet). Where n-gram drafts continue the
                    # copy's, both sides count a continuation at their best width: the one found
                    # now, and after the further drafts one guessed to be as good.
                    d = max(self.step_ms, 1e-3)
                    spent = staged_ms + steps * d
                    more_ms = spent + (goal - len(tokens)) * d
                    # The round as it stands verifies at the widest listed width its drafts fill.
                    fit = max(w for w in self._widths if w <= len(tokens) + 1)
                    now = ys.at(fit, expected_accepted(conf[:fit - 1]), spent)
                    more = ys.at(goal + 1, expected + guessed(goal - len(tokens)), more_ms)
                    why = "further drafts not expected to pay"
                    if len(extension()):
                        after = list(ext.confidence)
                        with_ext = ys.best(conf + after, spent)[1]
                        if with_ext > now:
                            now, why = with_ext, "the n-gram continuation promises more than further drafts"
                        guess = (conf + [last_c] * (goal - len(tokens)) + after)[:k_max]
                        more = max(more, ys.best(guess, more_ms)[1])
                    if more <= now:
                        break
                    why = "every length asked for"
                while len(tokens) < goal:
                    if ys is None and tokens and fills():
                        stop, why = True, "the n-gram continuation completes the length asked for"
                        break
                    if not open_():
                        stop, why = True, "the grammar ends the answer at the drafts"
                        break
                    t = time.perf_counter()
                    logits = self._run(view, np.array([x], dtype=np.int64))[-1]
                    view.commit(1)
                    x = take(logits)
                    ms = (time.perf_counter() - t) * 1e3
                    steps += 1
                    self.step_ms = ms if self.step_ms <= 0 else 0.8 * self.step_ms + 0.2 * ms
                    if self.copy_costs is not None:
                        self.copy_costs.observe(1, ms)
                if stop:
                    break
        finally:
            view.length = cache.length  # the copy's K/V past the committed positions are dropped
        n = min(len(tokens), k_max)
        del tokens[n:], qs[n:], conf[n:]
        self._copied = n
        ended = not open_()  # under a grammar, the drafts end the answer: nothing follows them
        more = extension() if (ys is not None or stop) and not ended else Draft.empty()
        if len(more):
            # The n-gram drafts after the copy's: deterministic given the drafts before them,
            # so each is drawn from a point mass at itself.
            tokens += more.tokens.tolist()
            conf += more.confidence.tolist()
            for x in more.tokens.tolist() if qs else ():
                one = np.zeros_like(qs[0])
                one[x] = 1.0
                qs.append(one)
            self.extended[0] += 1
            self.extended[1] += len(more)
        self._record = {"source": "self", "copied": n, "continued": len(more), "checked": len(guesses),
                        "agreed": self._agreed, "why": why}
        return Draft(np.asarray(tokens, dtype=np.int64), np.stack(qs) if qs else None,
                     np.asarray(conf, dtype=np.float64))

    def feedback(self, drafted: int, accepted: int, committed: Sequence[int]) -> None:
        if self._source != "self":  # the cheap drafter's own drafts were verified
            self.ngram.feedback(drafted, accepted, committed)
            return
        copied = min(drafted, self._copied)
        if self._guesses:  # what the round says of the n-gram drafts the copy checked
            seen, right = guesses_judged(len(self._guesses), self._agreed, copied, min(accepted, copied))
            if seen:
                self.ngram.feedback(seen, right, committed)
        if drafted > copied and accepted >= copied:  # the n-gram drafts after the copy's were judged
            self.ngram.feedback_extension(drafted - copied, accepted - copied)
        bins = self._bins[:copied]
        for i in range(judged(len(bins), accepted)):
            self.tried[bins[i]] += 1
            self.accepted[bins[i]] += i < accepted


def guesses_judged(guessed: int, agreed: int, drafted: int, accepted: int) -> tuple[int, int]:
    """(judged, accepted) of ``guessed`` n-gram drafts of which the copy drew the first
    ``agreed``, after the target accepted ``accepted`` of the ``drafted`` drafts it verified
    (the copy's chain: the agreed guesses, then the copy's own tokens). A guess past the
    agreed ones differs from the copy's token at its place, so it is judged wrong when the
    target accepted that token and unknown when the target rejected it."""
    if accepted < min(agreed, drafted):
        return accepted + 1, accepted  # the target rejected an agreed guess
    if drafted <= agreed:
        return accepted, accepted  # all verified guesses accepted; later ones not judged
    if agreed == guessed:
        return guessed, guessed
    if accepted > agreed:
        return agreed + 1, agreed  # the target took the copy's token where the guess differed
    return agreed, agreed
