"""The backend protocol: a decoder graph that owns a preallocated KV buffer.

A ``KVCache`` holds the K/V of ``length`` committed positions. ``forward`` writes the K/V of
the new tokens at positions ``length .. length+S-1`` and returns their logits (and hidden
states); it does not commit them. The caller commits what it keeps and so rolls back by
never committing the rest: positions past ``length`` are overwritten by the next forward.
Backends know nothing about tokenization, sampling or speculation.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..config import check_field_types
from ..errors import BackendError, ConfigError

MIN_CONTEXT = 16  # tokens: the smallest KV cache a load accepts
MAX_THREADS_PER_CORE = 4


@dataclass(frozen=True)
class BackendOptions:
    """How to open a session. ``providers`` are ONNX Runtime execution provider names in
    priority order, ``provider_options`` one dict per provider (e.g. ``{"device_id": "0"}``
    for CUDA); ``fallback_to_cpu`` allows (logged) use of the CPU provider when a requested
    one is unavailable, otherwise that is an error. ``device_id`` is the CUDA device of the
    TensorRT backend (and of a GPU provider whose options do not name one)."""

    providers: tuple[str, ...] = ("CPUExecutionProvider",)
    provider_options: tuple[dict, ...] = ()
    intra_op_threads: int | None = None
    allow_spinning: bool = True
    # Run on the process-wide ONNX Runtime thread pool (created by the first session that asks,
    # with ``intra_op_threads`` threads) instead of a pool of the session's own; ``allow_spinning``
    # does not apply to it. For a target and a drafter with a graph of its own, which take turns
    # on the same cores: one set of threads instead of two competing sets (docs/notes/2026-11-30-to-12-02-measurements.md,
    # "Self-drafting"); `python -m dspark_edge` sets it for them. Process-wide for good: once one
    # session uses the pool, onnxruntime refuses sessions with pools of their own, so every later
    # session this package opens uses it too, and other code in the process must set
    # ``SessionOptions.use_per_session_threads = False``.
    shared_threads: bool = False
    max_context: int = 2048
    fallback_to_cpu: bool = False
    device_id: int = 0

    def option_dicts(self) -> list[dict]:
        """``provider_options``, or an empty dict per provider when none were given."""
        return list(self.provider_options) or [{} for _ in self.providers]

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.device_id < 0:
            raise ConfigError(f"device_id must be >= 0, got {self.device_id}")
        if self.max_context < MIN_CONTEXT:
            raise ConfigError(f"max_context must be >= {MIN_CONTEXT} tokens (a prompt, a verify pass and its "
                              f"drafts must fit), got {self.max_context}")
        cores = os.cpu_count() or 1
        if self.intra_op_threads is not None and not 1 <= self.intra_op_threads <= MAX_THREADS_PER_CORE * cores:
            raise ConfigError(f"intra_op_threads must be between 1 and {MAX_THREADS_PER_CORE * cores} "
                              f"({MAX_THREADS_PER_CORE}× this machine's {cores} cores: more threads only wait on "
                              f"each other) or None, got {self.intra_op_threads}")


@dataclass
class ForwardOutput:
    logits: np.ndarray  # [S, V] float32
    hidden: np.ndarray | None  # [S, H * len(hidden_state_layers)] float32, or None


def output_buffers(kept: dict[int, tuple[np.ndarray, np.ndarray | None]], cached_widths: frozenset[int],
                   width: int, vocab: int, hidden_width: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Host arrays for one call's outputs: logits [1, width, vocab] and hidden states
    [1, width, hidden_width] (None when 0). Kept in ``kept`` and reused for the decode widths
    (``cached_widths``) only: a prefill chunk's length varies with every prompt, and a buffer
    per length seen would grow without bound in a long-running process."""
    bufs = kept.get(width)
    if bufs is None:
        logits = np.empty((1, width, vocab), dtype=np.float32)
        hidden = np.empty((1, width, hidden_width), dtype=np.float32) if hidden_width else None
        bufs = (logits, hidden)
        if width in cached_widths:
            kept[width] = bufs
    return bufs


class KVCache:
    """Bookkeeping of a preallocated KV buffer: ``length`` committed positions of ``capacity``."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.length = 0

    def commit(self, n: int) -> None:
        """Keep ``n`` more positions (written by the last forward)."""
        if n < 0 or self.length + n > self.capacity:
            raise BackendError(f"cannot commit {n} positions at length {self.length} of {self.capacity}")
        self.length += n

    def rollback(self, length: int) -> None:
        """Forget every position at or after ``length``."""
        if not 0 <= length <= self.length:
            raise BackendError(f"cannot roll back to {length}: only {self.length} positions are committed")
        self.length = length

    def reset(self) -> None:
        self.length = 0

    @property
    def free(self) -> int:
        return self.capacity - self.length


class DecoderSession(Protocol):
    capacity: int
    cached_widths: frozenset[int]  # widths whose output buffers are reused (the decode widths)
    max_step: int  # the most new tokens one forward call takes

    def new_cache(self) -> KVCache: ...

    def forward(self, cache: KVCache, ids: np.ndarray) -> ForwardOutput: ...
