"""Continuous batching: several generations, each in its own thread, over one loaded target.

Each generation decodes in a *slot*: one row of a KV buffer shaped [slots, kv heads, capacity,
head dim] per layer. A generation's target passes go through the ``BatchRunner``, which gathers
the passes of every active slot and runs them together: the width-1 steps of all slots in one
batched pass (each row at its own length), prefill chunks and wider speculative passes one slot
at a time, bound to that slot's row. A generation joins at its first pass and leaves when it
ends; the others go on meanwhile, so requests come and go at any round. A slot whose pipeline
kept its last generation's K/V (``GenerationConfig.reuse_prefix``) keeps them in its row while
idle: its dummy rows (below) write past them.

Drafts of several requests in one pass: onnxruntime's CPU GroupQueryAttention (the fused
graph's attention) runs several new tokens after a cached context at batch size 1 only, so a
batch of rows cannot verify drafts. The runner opens a second session over the *slots graph*
(``backends.slots``): the new tokens of every pending pass in one sequence through the matmuls,
each request's part through an attention node of its own. With it, every slot drafts as it
would alone and offers its drafts with their confidences (``offer``); when several passes meet,
the runner chooses how many of each request's drafts the shared pass verifies: the paper's
Algorithm 1 over (request, position) pairs, admitted by survival while the expected tokens per
millisecond of the pass improve (``scheduler.choose_multi``), under a cost table T(tokens in the
pass) learned from the passes run (``PassCosts``), then runs them all in one pass. A pass alone
verifies what the slot's own scheduler chose, on the engine's own graph. Rounds whose passes are
all one token run on the engine's graph as one batch of rows (cheaper than the slots graph for
that case). Without the slots graph (another graph, onnx not installed, or ``verify_slots``
off: it holds a second copy of the weights in memory), a slot drafts only while it is the only
active one (``draft_room``); with others active, every slot takes batched width-1 steps.

Self-drafting (``drafters.self_draft``): the copy (the engine's INT8 graph) has the target's
K/V layout, so it drafts over the slot's own row (``copy_forward``), one copy shared by every
slot (``attach_copy``). It drafts only while its slot is the only active one (``copy_room``):
with several requests decoding, a copy step per request and the wider shared pass cost more
than the drafts save on the CPUs measured (docs/performance.md), and the slot's n-gram drafts,
if any, are offered instead. A target pass waits for a slot whose copy is drafting.

Guarantees: a slot's rows in a batched pass compute exactly what a pass of that slot alone
computes (each row reads and writes only its own K/V, with the same kernels; the tests compare
the outputs bit for bit), so a greedy answer is the one the request gets served alone. Rows of
slots that are idle, or whose pass this round is a separate one, are run as one-token dummies
writing at the slot's *frontier*: past every position its latest passes wrote (K/V the slot may
still commit, or that its copy's next step reads), and at or past its committed length. Nothing
at or past a frontier is read before the slot's own next pass writes it, so a dummy never
changes an answer, nor the copy's drafts. A gathering slot waits at most ``gather_s`` for the
others (and at most ``draft_wait_s`` for slots whose copy is drafting). A slot quiet for
``stall_s`` (no pass pending, none submitted or returned and no copy step in that time: its caller
stopped iterating its stream) is *stalled*: nobody waits for it and it does not count as decoding
(``draft_room``, ``copy_room``), until its next pass or copy step. So a slot busy elsewhere
never stalls the rest, nor bars a slot that decodes alone from drafting.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from .backends import ForwardOutput, KVCache
from .decoder import PREFILL_CHUNK, prefill_in_chunks
from .errors import BackendError, ConfigError, DSparkError
from .scheduler import choose_multi, monotone, survival

log = logging.getLogger(__name__)


class SlotCache(KVCache):
    """The committed length of one slot's row of the runner's KV buffers."""

    def __init__(self, capacity: int, slot: int) -> None:
        super().__init__(capacity)
        self.slot = slot


class PassCosts:
    """T(n): milliseconds of one slots-graph pass over n new tokens in all (dummies included).

    ``curve`` (n → ms) is the basis: the passes measured when the runner opened the slots graph
    (``BatchRunner.measure_passes``), else the engine's width curve (a pass alone: the device
    profile's or the scheduler's); between its points T is interpolated, past them extended
    with the last slope. Passes run since then correct it: an n that has been run reads its
    own moving average, any other the curve times the moving ratio observed/curve. The first
    pass at each n is not counted (onnxruntime sets up buffers on a shape's first run). Without
    a curve a pass costs n (drafts never pay)."""

    def __init__(self, curve: dict[int, float] | None = None, weight: float = 0.25) -> None:
        self.curve = monotone(dict(curve)) if curve else {}
        self.weight = weight
        # A width-1 pass of the engine's own graph over m rows (no slots graph): what a round
        # costs when no draft is verified. Measured by ``BatchRunner.measure_rows``, then a moving
        # average of the batched passes run.
        self.rows: dict[int, float] = {}
        self.seen: dict[int, float] = {}
        self.warm: set[int] = set()  # the n's whose first pass has run
        self.ratio = 1.0  # observed / curve, a moving average over the passes counted

    def _basis(self, n: int) -> float:
        if not self.curve:
            return float(n)
        if n in self.curve:
            return self.curve[n]
        ws = sorted(self.curve)
        lo = max((w for w in ws if w < n), default=None)
        hi = min((w for w in ws if w > n), default=None)
        if lo is None:
            return self.curve[ws[0]]
        if hi is None:  # past the last point: its slope from the one before
            a, b = (ws[-2], ws[-1]) if len(ws) > 1 else (ws[-1], ws[-1])
            slope = (self.curve[b] - self.curve[a]) / (b - a) if b > a else 0.0
            return self.curve[b] + slope * (n - b)
        t = (n - lo) / (hi - lo)
        return self.curve[lo] + t * (self.curve[hi] - self.curve[lo])

    def __call__(self, n: int) -> float:
        return self.seen.get(n, self._basis(n) * self.ratio)

    def observe_rows(self, m: int, ms: float) -> None:
        if m in self.rows and ms > 0:
            self.rows[m] += self.weight * (ms - self.rows[m])

    def observe(self, n: int, ms: float) -> None:
        if ms <= 0:
            return
        if n not in self.warm:
            self.warm.add(n)
            return
        old = self.seen.get(n)
        self.seen[n] = ms if old is None else old + self.weight * (ms - old)
        if self.curve:
            self.ratio += self.weight * (ms / self._basis(n) - self.ratio)


class BatchRunner:
    """Gathers the target passes of the active slots and runs them (see the module docstring).
    ``model``: a ``DecoderModel`` on the onnxruntime backend with the fused graph's shared K/V
    buffer layout. Thread-safe: each slot is driven by one thread at a time."""

    def __init__(self, model, slots: int, gather_s: float = 0.02, verify_slots: bool = True,
                 curve: dict[int, float] | None = None, pass_costs: dict[int, float] | None = None,
                 measure: bool = True, draft_wait_s: float = 0.5, stall_s: float = 0.25) -> None:
        if model.backend != "onnxruntime" or not hasattr(model.session, "new_rows"):
            raise ConfigError("batching several requests needs the onnxruntime backend and the fused graph "
                              "(its shared K/V buffer); serve with --parallel 1 on this engine")
        if slots < 1:
            raise ConfigError(f"--parallel must be at least 1, got {slots}")
        self.model, self.session, self.slots = model, model.session, slots
        self.capacity = self.session.capacity
        self.gather_s, self.draft_wait_s, self.stall_s = gather_s, draft_wait_s, stall_s
        try:
            self._kv = self.session.new_rows(slots)
        except BackendError as exc:
            raise ConfigError(f"{exc}; serve with --parallel 1 on this engine") from None
        self.caches = [SlotCache(self.capacity, s) for s in range(slots)]
        self.slots_pass = self._open_slots() if verify_slots and slots > 1 else None
        self.costs = PassCosts(curve)
        self.costs_from = "scheduler"  # where the pass cost table's basis came from
        if self.slots_pass is not None and pass_costs:
            self.costs = PassCosts(pass_costs)  # the device profile's table for this many slots
            self.costs_from = "profile"
        elif self.slots_pass is not None and measure:
            self.measure_passes(max(model.widths))
        self.copy = None  # the self drafter's copy (a DecoderModel) running over the same rows
        if measure:  # also the warm-up: onnxruntime sets up buffers on its first run at each row count
            self.measure_rows()
        self.choices: dict[int, dict] = {}  # each offering slot's last joint choice, for its round's record
        self._cond = threading.Condition()
        self._active: set[int] = set()
        self._pending: dict[int, np.ndarray] = {}
        self._copying: set[int] = set()  # slots that ran copy steps since their latest target pass
        self._heard: dict[int, float] = {}  # slot -> when it last joined, submitted or got a pass, or drafted
        self._results: dict[int, ForwardOutput | BaseException] = {}
        self._offers: dict[int, tuple[np.ndarray, int]] = {}  # slot -> (confidences, width alone)
        # Where a slot's dummy row may write: past the positions its passes since its latest
        # target pass was submitted have written (see the module docstring).
        self._frontier: dict[int, int] = {}
        self.passes = {"batched": 0, "rows": 0, "single": 0, "slots": 0, "copy": 0}  # counts, for tests and metrics

    def measure_passes(self, widest: int, repeats: int = 3) -> dict[int, float]:
        """The pass cost table's basis on this device: T(n) at a few n between ``slots`` (every
        request one token) and ``slots`` × ``widest`` (every request its widest pass), each the
        median of ``repeats`` runs after one uncounted run, the rest interpolated (``PassCosts``).
        Runs on rows whose caches are empty: it writes only positions no cache has committed.
        About a second, once."""
        p = self.slots_pass.slots
        points = sorted({n for n in (p, p + 1, p + 2, p + 4, 2 * p, 3 * p, 4 * p, 6 * p, p * widest)
                         if p <= n <= p * widest})
        table = {}
        for n in points:
            widths = [n // p + (1 if j < n % p else 0) for j in range(p)]
            jobs = [(j, 0, np.zeros(w, dtype=np.int64)) for j, w in enumerate(widths)]
            times = []
            for _ in range(repeats + 1):
                t = time.perf_counter()
                self.slots_pass.run(self._kv, jobs)
                times.append((time.perf_counter() - t) * 1e3)
            table[n] = float(np.median(times[1:]))
        self.costs = PassCosts(table)
        self.costs.warm.update(points)
        self.costs_from = "measured"
        log.info("slots-graph pass costs on this device (ms by tokens in the pass): %s",
                 ", ".join(f"{n}: {ms:.1f}" for n, ms in sorted(table.items())))
        return table

    def measure_rows(self, repeats: int = 3) -> dict[int, float]:
        """``costs.rows``: the width-1 pass over m rows, m = 1 … slots, what a round of m
        requests costs when none of their drafts is verified (the joint choice's yardstick
        against the slots pass; the batched passes run since then update it). Called when the
        runner opens, it is also the warm-up: onnxruntime's first pass at each new row count
        sets up its buffers, which the first requests would otherwise wait for. Runs on rows
        whose caches are empty, at position 0 (nothing is committed there yet)."""
        ids = np.zeros((self.slots, 1), dtype=np.int64)
        mask = np.ones((self.slots, 1), dtype=np.int64)
        for m in range(1, self.slots + 1):
            times = []
            for _ in range(repeats + 1):
                t = time.perf_counter()
                self.session.run_rows(self._kv, 0, ids[:m], mask[:m])
                times.append((time.perf_counter() - t) * 1e3)
            self.costs.rows[m] = float(np.median(times[1:]))
        log.info("width-1 pass over m rows on this device (ms by m): %s",
                 ", ".join(f"{m}: {ms:.1f}" for m, ms in sorted(self.costs.rows.items())))
        return self.costs.rows

    def _open_slots(self):
        """The slots graph's session (None, with the reason logged, where it cannot be had)."""
        from .backends.slots import SlotsDecoder

        try:
            return SlotsDecoder(self.session, self.slots)
        except ImportError:
            log.warning("the onnx package is not installed: requests batched together verify no drafts "
                        "(install dspark-edge[serve])")
        except DSparkError as exc:
            log.warning("requests batched together verify no drafts: %s", exc)
        return None

    # -- slots --------------------------------------------------------------------------------
    def join(self, slot: int) -> None:
        with self._cond:
            self._active.add(slot)
            self._heard[slot] = time.monotonic()

    def leave(self, slot: int) -> None:
        """The slot's generation ended: the others stop waiting for it. Its row keeps what its
        pipeline kept (``GenerationConfig.reuse_prefix``; else the pipeline reset its length):
        while it is idle its dummies write at that length, past every kept position."""
        with self._cond:
            self._active.discard(slot)
            self._pending.pop(slot, None)
            self._frontier.pop(slot, None)
            self._copying.discard(slot)
            self._heard.pop(slot, None)
            self._cond.notify_all()

    def _free(self, slot: int) -> int:
        """The position a dummy row of ``slot`` writes at (its frontier)."""
        return max(self.caches[slot].length, self._frontier.get(slot, 0))

    def _wrote(self, slot: int, start: int, width: int) -> None:
        self._frontier[slot] = max(self._frontier.get(slot, 0), start + width)

    def _decoding(self) -> set[int]:
        """The active slots that are not stalled (see the module docstring); holding the lock."""
        now = time.monotonic()
        return {s for s in self._active if s in self._pending or now - self._heard.get(s, now) < self.stall_s}

    def _stall_at(self) -> float | None:
        """When the next decoding slot without a pending pass turns stalled; holding the lock."""
        quiet = [self._heard[s] for s in self._decoding() - self._pending.keys() if s in self._heard]
        return min(quiet) + self.stall_s if quiet else None

    def draft_room(self, slot: int) -> int | None:
        """How many drafts the slot may verify this round: None (no limit) while no other slot
        is decoding or drafts of several requests share a pass (the slots graph); otherwise 0
        (their width-1 steps batch with its own)."""
        if self.slots_pass is not None:
            return None
        with self._cond:
            return None if self._decoding() <= {slot} else 0

    @property
    def joint(self) -> bool:
        """Whether slots offer their drafts for a joint choice (``offer``)."""
        return self.slots_pass is not None

    # -- passes -------------------------------------------------------------------------------
    def offer(self, cache: SlotCache, ids: np.ndarray, confidence: np.ndarray, alone: int) -> ForwardOutput:
        """Run [anchor, drafts…] ``ids`` (``confidence``: the drafts', as the slot's scheduler sees
        them) after the slot's committed positions, verifying a prefix: the first ``alone``
        tokens when the pass is the slot's alone, the joint choice when it is shared. The
        output has one row per token run; the choice is in ``choices[slot]``."""
        slot = cache.slot
        with self._cond:
            self._offers[slot] = (np.asarray(confidence, dtype=np.float64)[:ids.shape[0] - 1], max(1, alone))
        try:
            return self.forward(cache, ids)
        finally:
            with self._cond:
                self._offers.pop(slot, None)

    def forward(self, cache: SlotCache, ids: np.ndarray) -> ForwardOutput:
        """Run ``ids`` after the slot's committed positions, batched with the other active
        slots' passes of this round; commits nothing. The outputs are the caller's own."""
        width = int(ids.shape[0])
        if width < 1 or cache.length + width > cache.capacity:
            raise BackendError(f"cannot run {width} new tokens after {cache.length} of {cache.capacity} "
                               "KV positions: the context is full (raise max_context when loading)")
        slot = cache.slot
        now = time.monotonic()
        deadline, latest = now + self.gather_s, now + self.gather_s + self.draft_wait_s
        with self._cond:
            if slot not in self._active:
                raise BackendError(f"slot {slot} runs a pass without having joined the batch")
            # The slot's copy (if it drafted) is done: its K/V past the committed length are no
            # longer read, the pass writes its own over them first.
            self._frontier[slot] = cache.length
            self._copying.discard(slot)
            self._pending[slot] = np.asarray(ids, dtype=np.int64)
            while slot not in self._results:  # a pass runs holding the lock: none is under way here
                if not self._run_ready(deadline, latest):
                    wake = latest if self._drafting() and time.monotonic() >= deadline else deadline
                    stall = self._stall_at()  # a slot turning stalled is no event: wake for it
                    wake = min(wake, stall) if stall is not None else wake
                    self._cond.wait(timeout=max(0.0005, wake - time.monotonic()))
            out = self._results.pop(slot)
            self._heard[slot] = time.monotonic()
        if isinstance(out, BaseException):
            raise out
        return out

    def _drafting(self) -> bool:
        """Whether a decoding slot's copy is drafting (it asked for a copy step since its latest
        target pass was submitted): its target pass follows shortly."""
        return bool(self._copying & self._decoding())

    def _run_ready(self, deadline: float, latest: float) -> bool:
        """Run the pending target passes if they are due (holding the lock): when every
        decoding slot has one pending, or the window is over and no slot's copy is drafting, or
        ``latest`` has passed. Returns whether they ran."""
        now = time.monotonic()
        if self._pending.keys() >= self._decoding() or (now >= deadline and not self._drafting()) or now >= latest:
            self._execute()
            return True
        return False

    # -- the self drafter's copy --------------------------------------------------------------
    def attach_copy(self, model):
        """Share ``model`` (a ``DecoderModel`` of the engine at another precision, the self
        drafter's copy) as every slot's copy: the first one attached is kept and returned to
        later callers. Raises ConfigError when its graph cannot run over the runner's K/V rows
        (another backend, K/V type or layout)."""
        with self._cond:
            if self.copy is not None:
                if self.copy.precision != model.precision:
                    raise ConfigError(f"the slots already draft with the {self.copy.precision} copy, not "
                                      f"{model.precision}")
                return self.copy
            session = getattr(model, "session", None)
            if getattr(model, "backend", None) != "onnxruntime" or not hasattr(session, "fits_rows") \
                    or not session.fits_rows(self._kv):
                raise ConfigError(f"the {model.precision} graph cannot draft over the batched K/V rows of the "
                                  f"{self.model.precision} target (another K/V type, layout or device)")
            self.copy = model
            log.info("the slots' self drafters share one %s copy", model.precision)
            return model

    def copy_room(self, slot: int) -> int | None:
        """How many drafts the slot's copy may draw this round: None (the drafter's own choice)
        while no other slot is decoding, else 0. Measured on a 2-core CPU with the
        embedded default (docs/performance.md, "Self-drafting in a batched server"): every slot
        drafting with the copy, its steps batched as rows and the requests verified together,
        gave 0.71–0.96× the per-request speed of plain batched steps at 2 and 4 requests."""
        with self._cond:
            return None if self._decoding() <= {slot} else 0

    def copy_forward(self, slot: int, start: int, ids: np.ndarray) -> np.ndarray:
        """The copy's logits [w, V] for ``ids`` [w] run at positions ``start`` … of the slot's
        row (after its committed K/V and the copy's own earlier drafts). Commits nothing; no
        dummy row of a later pass writes below ``start + w`` until the slot's next target pass
        is submitted."""
        width = int(ids.shape[0])
        if self.copy is None:
            raise BackendError("no copy is attached to this batch (attach_copy)")
        self.copy.check_width(width)  # the graph's listed widths, as a pass of it alone
        if width < 1 or start + width > self.capacity:
            raise BackendError(f"cannot run {width} new tokens after {start} of {self.capacity} KV positions")
        with self._cond:  # passes run holding the lock: none is under way while the copy runs
            if slot not in self._active:
                raise BackendError(f"slot {slot} runs a copy step without having joined the batch")
            self._wrote(slot, start, width)
            self._copying.add(slot)
            self._heard[slot] = time.monotonic()
            logits, _ = self.copy.session.run_rows(self._kv, slot, np.asarray(ids, dtype=np.int64).reshape(1, -1),
                                                   np.ones((1, start + width), dtype=np.int64))
            self.passes["copy"] += 1
        return logits[0]

    def _execute(self) -> None:
        """Run every pending pass (called holding the lock; other slots wait meanwhile)."""
        jobs, self._pending = self._pending, {}
        try:
            jobs = self._choose(jobs)
            if self.slots_pass is not None and len(jobs) > 1 and any(ids.shape[0] > 1 for ids in jobs.values()):
                self._slots(jobs)
                return
            steps = {s: ids for s, ids in jobs.items() if ids.shape[0] == 1}
            if len(steps) > 1:
                self._batched(steps)
            else:
                for s, ids in steps.items():
                    self._results[s] = self._single(s, ids)
            for s, ids in jobs.items():
                if ids.shape[0] > 1:
                    self._results[s] = self._single(s, ids)
        finally:
            self._cond.notify_all()

    def _choose(self, jobs: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        """Each pass trimmed to what this round verifies: an offering slot alone, its own
        choice; several passes, Algorithm 1 over the offered (request, position) pairs, the
        other passes' tokens and the dummies counted in every cost."""
        offering = {s: self._offers[s] for s in jobs if s in self._offers}
        if not offering:
            return jobs
        if len(jobs) == 1 or self.slots_pass is None:
            for s, (_, alone) in offering.items():
                jobs[s] = jobs[s][:alone]
                self.choices[s] = {"requests": len(jobs), "offered": len(jobs[s]) - 1, "kept": alone - 1,
                                   "reason": "alone: the slot's own choice"}
            return jobs
        order = sorted(offering)
        fixed = sum(int(jobs[s].shape[0]) for s in jobs if s not in offering)
        dummies = self.slots_pass.slots - len(jobs)
        base = fixed + dummies
        kept = choose_multi([offering[s][0] for s in order], lambda n: self.costs(base + n))
        accepted = {s: float(survival(offering[s][0])[:k].sum()) for s, k in zip(order, kept)}  # expected
        why = "drafts admitted by survival while expected tokens per ms of the shared pass improved"
        rows = max(jobs) + 1
        plain = self.costs.rows.get(rows)
        if any(kept) and plain and all(jobs[s].shape[0] == 1 for s in jobs if s not in offering):
            # Without drafts the round is one width-1 pass over the rows, cheaper than the slots
            # graph's pass: the drafts kept must beat that, not the slots pass over the anchors.
            expected = len(jobs) + sum(accepted.values())
            if expected / self.costs(base + len(order) + sum(kept)) <= len(jobs) / plain:
                kept, accepted = [0] * len(order), dict.fromkeys(order, 0.0)
                why = "drafts declined: the expected tokens per ms do not beat one width-1 pass over the rows"
        total = base + len(order) + sum(kept)
        for s, k in zip(order, kept):
            offered = len(offering[s][0])
            jobs[s] = jobs[s][:1 + k]
            self.choices[s] = {"requests": len(jobs), "offered": offered, "kept": k, "pass_tokens": total,
                               "expected_accepted": round(accepted[s], 4),
                               "pass_ms_expected": round(self.costs(total), 3), "reason": why}
        return jobs

    def _slots(self, jobs: dict[int, np.ndarray]) -> None:
        """One pass of the slots graph over every job (each on its slot's row)."""
        order = sorted(jobs)
        spec = [(s, self.caches[s].length, jobs[s]) for s in order]
        n = sum(int(ids.shape[0]) for ids in jobs.values()) + self.slots_pass.slots - len(jobs)
        t = time.perf_counter()
        try:
            outs = self.slots_pass.run(self._kv, spec)
        except BackendError as exc:
            for s in order:
                self._results[s] = exc
            return
        self.costs.observe(n, (time.perf_counter() - t) * 1e3)
        for s, start, ids in spec:
            self._wrote(s, start, int(ids.shape[0]))
        self.passes["slots"] += 1
        self.passes["rows"] += len(order)
        for s, (logits, hidden) in zip(order, outs):
            self._results[s] = ForwardOutput(logits, hidden)

    def _run(self, first: int, ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        return self.session.run_rows(self._kv, first, ids, mask)

    def _single(self, slot: int, ids: np.ndarray) -> ForwardOutput | BaseException:
        length = self.caches[slot].length
        try:
            logits, hidden = self._run(slot, ids.reshape(1, -1), np.ones((1, length + ids.shape[0]), dtype=np.int64))
        except BackendError as exc:
            return exc
        self._wrote(slot, length, int(ids.shape[0]))
        self.passes["single"] += 1
        return ForwardOutput(logits[0], None if hidden is None else hidden[0])

    def _batched(self, steps: dict[int, np.ndarray]) -> None:
        """One pass over rows 0 … the last stepping slot; the rows of other slots are dummies
        writing at their frontiers."""
        rows = max(steps) + 1
        lengths = [self.caches[r].length if r in steps else self._free(r) for r in range(rows)]
        if any(n >= self.capacity for n in lengths):  # a full row could not take its dummy
            for s, ids in steps.items():
                self._results[s] = self._single(s, ids)
            return
        ids = np.zeros((rows, 1), dtype=np.int64)
        mask = np.zeros((rows, max(lengths) + 1), dtype=np.int64)
        for r in range(rows):
            if r in steps:
                ids[r, 0] = steps[r][0]
            mask[r, :lengths[r] + 1] = 1
        t = time.perf_counter()
        try:
            logits, hidden = self._run(0, ids, mask)
        except BackendError as exc:
            for s in steps:
                self._results[s] = exc
            return
        self.costs.observe_rows(rows, (time.perf_counter() - t) * 1e3)  # it follows the contexts' lengths
        for s in steps:
            self._wrote(s, lengths[s], 1)
        self.passes["batched"] += 1
        self.passes["rows"] += len(steps)
        for s in steps:
            self._results[s] = ForwardOutput(logits[s], None if hidden is None else hidden[s])


class SlotModel:
    """The target as one slot sees it: what a pipeline and its rounds use of a ``DecoderModel``
    (``widths``, ``step``, ``prefill``, ``new_cache``), with every pass going through the runner."""

    def __init__(self, runner: BatchRunner, slot: int) -> None:
        model = runner.model
        self.runner, self.slot = runner, slot
        self.manifest, self.role, self.precision, self.backend = model.manifest, model.role, model.precision, model.backend
        self.widths, self.capacity, self.session = model.widths, runner.capacity, model.session

    def new_cache(self) -> SlotCache:
        return self.runner.caches[self.slot]

    @property
    def joint(self) -> bool:
        return self.runner.joint

    def offer(self, cache: SlotCache, ids: np.ndarray, confidence: np.ndarray, alone: int) -> ForwardOutput:
        """``BatchRunner.offer``: a prefix of ``ids`` is run, ``alone`` tokens when not shared."""
        return self.runner.offer(cache, ids, confidence, alone)

    def last_choice(self) -> dict | None:
        return self.runner.choices.pop(self.slot, None)

    def step(self, cache: SlotCache, ids: np.ndarray) -> ForwardOutput:
        if ids.shape[0] not in self.widths:
            raise ConfigError(f"width {ids.shape[0]} is not a listed {self.precision} target width {self.widths}")
        return self.runner.forward(cache, ids)

    def prefill(self, cache: SlotCache, ids: np.ndarray, chunk: int = PREFILL_CHUNK,
                hidden_sink: list | None = None, logits_sink=None) -> ForwardOutput:
        return prefill_in_chunks(self.runner.forward, cache, ids, chunk, hidden_sink, logits_sink)
