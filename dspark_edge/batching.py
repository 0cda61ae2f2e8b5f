"""Continuous batching: several generations, each in its own thread, over one loaded target.

Each generation decodes in a *slot*: one row of a KV buffer shaped [slots, kv heads, capacity,
head dim] per layer. A generation's target passes go through the ``BatchRunner``, which gathers
the passes of every active slot and runs them together: the width-1 steps of all slots in one
batched pass (each row at its own length), prefill chunks and wider speculative passes one slot
at a time, bound to that slot's row. A generation joins at its first pass and leaves when it
ends; the others go on meanwhile, so requests come and go at any round.

Why width-1 batches only: onnxruntime's CPU GroupQueryAttention (the fused graph's attention)
runs several new tokens after a cached context at batch size 1 only. A batched width-1 step
costs little more than a single one (the weights are read once for every row), while a
speculative pass of width k beside the batch costs a whole pass of its own. So a slot drafts
only while it is the only active one (``draft_room``); with others active, every slot takes
batched steps.

Guarantees: a slot's rows in a batched pass compute exactly what a pass of that slot alone
computes (each row reads and writes only its own K/V; the tests compare the outputs), so a
greedy answer is the one the request gets served alone. Rows of slots that are idle, or whose
pass this round is a separate one, are run as one-token dummies writing at their first
uncommitted position, before the separate passes; that position is never committed without
being written again. A gathering slot waits at most ``gather_s`` for the others: a slot busy
elsewhere (drafting, or a caller that stopped iterating its stream) never stalls the rest.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from .backends import ForwardOutput, KVCache
from .decoder import PREFILL_CHUNK, prefill_in_chunks
from .errors import BackendError, ConfigError

log = logging.getLogger(__name__)


class SlotCache(KVCache):
    """The committed length of one slot's row of the runner's KV buffers."""

    def __init__(self, capacity: int, slot: int) -> None:
        super().__init__(capacity)
        self.slot = slot


class BatchRunner:
    """Gathers the target passes of the active slots and runs them (see the module docstring).
    ``model``: a ``DecoderModel`` on the onnxruntime backend with the fused graph's shared K/V
    buffer layout. Thread-safe: each slot is driven by one thread at a time."""

    def __init__(self, model, slots: int, gather_s: float = 0.02) -> None:
        if model.backend != "onnxruntime" or not hasattr(model.session, "new_rows"):
            raise ConfigError("batching several requests needs the onnxruntime backend and the fused graph "
                              "(its shared K/V buffer); serve with --parallel 1 on this engine")
        if slots < 1:
            raise ConfigError(f"--parallel must be at least 1, got {slots}")
        self.model, self.session, self.slots = model, model.session, slots
        self.capacity = self.session.capacity
        self.gather_s = gather_s
        try:
            self._kv = self.session.new_rows(slots)
        except BackendError as exc:
            raise ConfigError(f"{exc}; serve with --parallel 1 on this engine") from None
        self.caches = [SlotCache(self.capacity, s) for s in range(slots)]
        self._cond = threading.Condition()
        self._active: set[int] = set()
        self._pending: dict[int, np.ndarray] = {}
        self._results: dict[int, ForwardOutput | BaseException] = {}
        self.passes = {"batched": 0, "rows": 0, "single": 0}  # counts, for tests and metrics

    # -- slots --------------------------------------------------------------------------------
    def join(self, slot: int) -> None:
        with self._cond:
            self._active.add(slot)

    def leave(self, slot: int) -> None:
        """The slot's generation ended: the others stop waiting for it."""
        with self._cond:
            self._active.discard(slot)
            self._pending.pop(slot, None)
            self.caches[slot].reset()
            self._cond.notify_all()

    def draft_room(self, slot: int) -> int | None:
        """How many drafts the slot may verify this round: None (no limit) while it is the only
        active slot, 0 while others are active (their width-1 steps batch with its own)."""
        with self._cond:
            return None if self._active <= {slot} else 0

    # -- passes -------------------------------------------------------------------------------
    def forward(self, cache: SlotCache, ids: np.ndarray) -> ForwardOutput:
        """Run ``ids`` after the slot's committed positions, batched with the other active
        slots' passes of this round; commits nothing. The outputs are the caller's own."""
        width = int(ids.shape[0])
        if width < 1 or cache.length + width > cache.capacity:
            raise BackendError(f"cannot run {width} new tokens after {cache.length} of {cache.capacity} "
                               "KV positions: the context is full (raise max_context when loading)")
        slot = cache.slot
        deadline = time.monotonic() + self.gather_s
        with self._cond:
            if slot not in self._active:
                raise BackendError(f"slot {slot} runs a pass without having joined the batch")
            self._pending[slot] = np.asarray(ids, dtype=np.int64)
            while slot not in self._results:  # a pass runs holding the lock: none is under way here
                if self._pending.keys() >= self._active or time.monotonic() >= deadline:
                    self._execute()
                else:
                    self._cond.wait(timeout=max(0.0005, deadline - time.monotonic()))
            out = self._results.pop(slot)
        if isinstance(out, BaseException):
            raise out
        return out

    def _execute(self) -> None:
        """Run every pending pass (called holding the lock; other slots wait meanwhile)."""
        jobs, self._pending = self._pending, {}
        try:
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

    def _run(self, first: int, ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        return self.session.run_rows(self._kv, first, ids, mask)

    def _single(self, slot: int, ids: np.ndarray) -> ForwardOutput | BaseException:
        length = self.caches[slot].length
        try:
            logits, hidden = self._run(slot, ids.reshape(1, -1), np.ones((1, length + ids.shape[0]), dtype=np.int64))
        except BackendError as exc:
            return exc
        self.passes["single"] += 1
        return ForwardOutput(logits[0], None if hidden is None else hidden[0])

    def _batched(self, steps: dict[int, np.ndarray]) -> None:
        """One pass over rows 0 … the last stepping slot; the rows of other slots are dummies
        writing at their first uncommitted position."""
        rows = max(steps) + 1
        lengths = [c.length for c in self.caches[:rows]]
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
        try:
            logits, hidden = self._run(0, ids, mask)
        except BackendError as exc:
            for s in steps:
                self._results[s] = exc
            return
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

    def step(self, cache: SlotCache, ids: np.ndarray) -> ForwardOutput:
        if ids.shape[0] not in self.widths:
            raise ConfigError(f"width {ids.shape[0]} is not a listed {self.precision} target width {self.widths}")
        return self.runner.forward(cache, ids)

    def prefill(self, cache: SlotCache, ids: np.ndarray, chunk: int = PREFILL_CHUNK,
                hidden_sink: list | None = None) -> ForwardOutput:
        return prefill_in_chunks(self.runner.forward, cache, ids, chunk, hidden_sink)
