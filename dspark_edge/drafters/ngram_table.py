"""A corpus n-gram table for the n-gram drafter: for every context of 1…``max_n`` tokens seen in
a corpus of the target's own answers, the token that most often followed it and how often
(its share among all continuations of that context).

Prompt lookup (``ngram.py``) only proposes text that already occurred in this conversation; the
table adds the target's habitual phrasing ("Here is a", "```python\\ndef", "In summary,") where
the conversation has no match. It is built by ``python -m export ngram-table`` from the target's
greedy answers and lives in the engine folder as ``ngram_table.npz``:

- ``keys_<n>`` [E_n] int64, sorted: the hash (``context_key``) of each n-token context;
- ``next_<n>`` [E_n] int32: the most frequent next token; ``share_<n>`` [E_n] float16: its share;
- ``count_<n>`` [E_n] uint16 (format 2): how often the context occurred (capped at 65535);
- ``meta``: JSON (format, the tokenizer's and the target model's sha256, how many answers and
  tokens it was built from, the command, and, format 2, the drafter's confidence calibration:
  ``ngram.CALIBRATION``).

A lookup is one binary search per context length: O(log E) with no Python objects per entry, so
a context costs 18 bytes of memory (1.8 MB for 10^5 contexts). Format 1 tables (no counts, no
calibration) are still read; the drafter then estimates its confidences online. Hash collisions (2^-63 per pair) could
only produce a wrong draft, which verification rejects; output never depends on the table.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import NPZ_ERRORS, ConfigError, EngineError

log = logging.getLogger(__name__)

FORMAT = 2
READABLE = (1, 2)
FILE_NAME = "ngram_table.npz"
_MASK = (1 << 63) - 1


def context_key(tokens: Sequence[int]) -> int:
    """A 63-bit hash of a token tuple; the length is part of it. Shared by the builder and the
    runtime, so it must never change for a given ``FORMAT``."""
    key = len(tokens)
    for t in tokens:
        key = (key * 0x100000001B3 + int(t) + 1) & _MASK
    return key


@dataclass(frozen=True)
class TableDraft:
    tokens: list[int]
    context_lengths: list[int]  # the context length each token was looked up with
    shares: list[float]  # each token's share among the continuations of its context
    counts: list[int]  # how often its context occurred in the corpus (0: the table does not say)


class NgramTable:
    """The arrays of one table file, searched by ``continue_from``."""

    def __init__(self, keys: dict[int, np.ndarray], nexts: dict[int, np.ndarray], shares: dict[int, np.ndarray],
                 meta: dict, counts: dict[int, np.ndarray] | None = None) -> None:
        self.keys, self.nexts, self.shares, self.meta, self.counts = keys, nexts, shares, meta, counts
        self.lengths = sorted(keys, reverse=True)  # longest context first

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], meta: dict | None = None) -> "NgramTable":
        """A table from the file's arrays (``keys_<n>``, ``next_<n>``, ``share_<n>``, ``count_<n>``)."""
        lengths = sorted(int(k.split("_")[1]) for k in arrays if k.startswith("keys_"))
        counts = ({n: arrays[f"count_{n}"] for n in lengths} if all(f"count_{n}" in arrays for n in lengths)
                  else None)
        return cls({n: arrays[f"keys_{n}"].astype(np.int64) for n in lengths},
                   {n: arrays[f"next_{n}"].astype(np.int32) for n in lengths},
                   {n: arrays[f"share_{n}"].astype(np.float32) for n in lengths}, dict(meta or {}),
                   counts)

    @property
    def calibration(self) -> dict | None:
        """The drafter's confidence calibration fitted when the table was built, if any."""
        cal = self.meta.get("calibration")
        return cal if isinstance(cal, dict) and self.counts is not None else None

    @property
    def entries(self) -> int:
        return int(sum(k.size for k in self.keys.values()))

    @classmethod
    def load(cls, path: str | Path, tokenizer_sha256: str | None = None, source_sha256: str | None = None) -> "NgramTable":
        """Read and check a table. A table built with another tokenizer is refused (its ids mean
        other tokens); one built from another model with this tokenizer is used with a warning
        (drafts never change the output, only how often they are accepted)."""
        path = Path(path)
        try:
            with np.load(path, allow_pickle=False) as z:
                meta = json.loads(str(z["meta"]))
                if meta.get("format") not in READABLE:
                    raise EngineError(f"{path} is an n-gram table of format {meta.get('format')!r}; this dspark_edge "
                                      f"reads formats {', '.join(map(str, READABLE))}: rebuild it with "
                                      "`python -m export ngram-table`")
                lengths = [int(n) for n in meta["context_lengths"]]
                keys = {n: z[f"keys_{n}"].astype(np.int64) for n in lengths}
                nexts = {n: z[f"next_{n}"].astype(np.int32) for n in lengths}
                shares = {n: z[f"share_{n}"].astype(np.float32) for n in lengths}
                counts = {n: z[f"count_{n}"].astype(np.int32) for n in lengths} if meta["format"] >= 2 else None
        except EngineError:
            raise
        except NPZ_ERRORS as exc:
            # a truncated or empty file, a damaged zip member (or its compressed data), meta that is not the table's
            raise EngineError(f"{path} is not a readable n-gram table ({type(exc).__name__}: {str(exc)[:160]}); "
                              "rebuild it with `python -m export ngram-table`, or remove it") from None
        for n in lengths:
            same = keys[n].shape == nexts[n].shape == shares[n].shape and (counts is None or counts[n].shape == keys[n].shape)
            if not same or (np.diff(keys[n]) <= 0).any():
                raise EngineError(f"{path}: the {n}-token contexts are not a sorted table; rebuild it with "
                                  "`python -m export ngram-table`")
        if tokenizer_sha256 and meta.get("tokenizer_sha256") != tokenizer_sha256:
            raise ConfigError(f"{path} was built for another tokenizer (sha256 {str(meta.get('tokenizer_sha256'))[:12]}…, "
                              f"the engine's is {tokenizer_sha256[:12]}…): rebuild it for this engine with "
                              "`python -m export ngram-table`, or remove it")
        if source_sha256 and meta.get("source_sha256") != source_sha256:
            log.warning("%s was built from another model's answers (same tokenizer); its drafts will be accepted "
                        "less often", path)
        return cls(keys, nexts, shares, meta, counts)

    @classmethod
    def load_for(cls, path: str | Path, manifest) -> "NgramTable":
        """``load`` checked against an engine's manifest (its tokenizer file and model)."""
        return cls.load(path, manifest.file_entry(manifest.tokenizer.file).sha256, manifest.model.source_sha256)

    def lookup(self, context: Sequence[int], min_n: int = 1) -> tuple[int, int, float, int] | None:
        """(next token, context length used, share, context count or 0) for the longest known
        suffix of ``context`` of at least ``min_n`` tokens, or None."""
        for n in self.lengths:
            if n < min_n or len(context) < n:
                continue
            keys = self.keys[n]
            key = context_key(context[-n:])
            i = int(np.searchsorted(keys, key))
            if i < keys.size and int(keys[i]) == key:
                count = int(self.counts[n][i]) if self.counts is not None else 0
                return int(self.nexts[n][i]), n, float(self.shares[n][i]), count
        return None

    def continue_from(self, context: Sequence[int], k: int, min_n: int = 1) -> TableDraft:
        """Up to ``k`` tokens, each the table's continuation of the context extended by the ones
        before it; the first needs a context of at least ``min_n`` tokens."""
        longest = max(self.lengths, default=1)
        ctx = list(context[-longest:])
        out = TableDraft([], [], [], [])
        for i in range(k):
            hit = self.lookup(ctx, min_n if i == 0 else 1)
            if hit is None:
                break
            tok, n, share, count = hit
            out.tokens.append(tok)
            out.context_lengths.append(n)
            out.shares.append(share)
            out.counts.append(count)
            ctx = ctx[1:] + [tok] if len(ctx) >= longest else ctx + [tok]
        return out
