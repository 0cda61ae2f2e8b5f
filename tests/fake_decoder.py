"""A numpy stand-in for the target, for unit tests of the round and the width policies without
an exported model: the "model" is a Markov chain whose greedy next token after x is
``(7 x + 3) mod V``, and whose logits put ``margin`` on that token (sampled decoding sees a
real distribution)."""

from __future__ import annotations

import numpy as np

from dspark_edge.backends.base import ForwardOutput, KVCache


def next_token(x: int, vocab: int) -> int:
    return (7 * int(x) + 3) % vocab


class FakeDecoder:
    """``step(cache, ids)`` returns one row of logits per id, as a decoder pass over the cache
    would; it writes nothing (the cache is bookkeeping only) and counts its passes by width."""

    def __init__(self, vocab: int = 50, widths=(1, 2, 3, 4, 6, 8), capacity: int = 256, margin: float = 6.0):
        self.vocab, self.widths, self.capacity, self.margin = vocab, tuple(widths), capacity, margin
        self.passes: dict[int, int] = {}

    def new_cache(self) -> KVCache:
        return KVCache(self.capacity)

    def step(self, cache: KVCache, ids: np.ndarray) -> ForwardOutput:
        ids = np.asarray(ids, dtype=np.int64)
        assert cache.length + ids.size <= cache.capacity
        self.passes[ids.size] = self.passes.get(ids.size, 0) + 1
        logits = np.zeros((ids.size, self.vocab), dtype=np.float32)
        for i, x in enumerate(ids):
            logits[i, next_token(x, self.vocab)] = self.margin
        return ForwardOutput(logits=logits, hidden=None)

    def chain(self, start: int, n: int) -> list[int]:
        """The greedy answer of ``n`` tokens after ``start``."""
        out, x = [], start
        for _ in range(n):
            x = next_token(x, self.vocab)
            out.append(x)
        return out
