"""``python -m export ngram-table``: the n-gram drafter's corpus table
(``dspark_edge.drafters.ngram_table``) from the target's own greedy answers.

The answers are those a ``train-drafter`` work folder already holds (``<work>/data`` answer
shards, and ``<work>/copy`` copy-task answers when present): only answer tokens are counted as
continuations, each with up to ``max_n`` tokens of context before it (prompt tokens included).
The table is written to a temporary file and renamed into place, so an engine folder never holds
a half-written one; ``--from`` installs a table built elsewhere (the one the project ships) after
checking it belongs to the engine's tokenizer.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import sys
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from dspark_edge.drafters.ngram_table import FILE_NAME, FORMAT, NgramTable, context_key
from dspark_edge.errors import ExportError
from dspark_edge.manifest import read_manifest


def count_continuations(sequences, max_n: int) -> dict[int, dict[tuple[int, ...], Counter]]:
    """``sequences``: (token ids, index where the answer starts) pairs → for every context length
    n ≤ ``max_n``, each n-token context followed by an answer token → Counter of those tokens."""
    counts: dict[int, dict[tuple[int, ...], Counter]] = {n: defaultdict(Counter) for n in range(1, max_n + 1)}
    for tokens, answer_start in sequences:
        t = [int(x) for x in tokens]
        for n, table in counts.items():
            for j in range(max(n, answer_start), len(t)):
                table[tuple(t[j - n:j])][t[j]] += 1
    return counts


def table_arrays(counts: dict[int, dict[tuple[int, ...], Counter]]) -> dict[str, np.ndarray]:
    """The file's arrays: per context length, sorted context hashes, the most frequent next
    token (ties: the smallest id, so the table does not depend on counting order) and its share."""
    arrays: dict[str, np.ndarray] = {}
    for n, table in counts.items():
        rows = []
        for ctx, c in table.items():
            best = max(c.items(), key=lambda kv: (kv[1], -kv[0]))
            rows.append((context_key(ctx), best[0], best[1] / sum(c.values())))
        rows.sort()
        keys = np.asarray([r[0] for r in rows], dtype=np.int64)
        if keys.size and (np.diff(keys) == 0).any():
            raise ExportError(f"two {n}-token contexts share a hash; report this with the data used")
        arrays[f"keys_{n}"] = keys
        arrays[f"next_{n}"] = np.asarray([r[1] for r in rows], dtype=np.int32)
        arrays[f"share_{n}"] = np.asarray([r[2] for r in rows], dtype=np.float16)
    return arrays


def _answer_sequences(work: Path, prompts: int | None):
    from .drafter.data import answer_shards, shard_path

    data_dir = work / "data"
    if not data_dir.is_dir():
        raise ExportError(f"{work} holds no answer shards ({data_dir} is missing); write them with "
                          f"`python -m export train-drafter --target ENGINE --output DIR --work {work} --steps 1`")
    def written(folder: Path) -> list[Path]:
        # shard-00000.npz, shard-00001.npz … as far as they go (a shard being written has
        # another name until it is complete)
        out: list[Path] = []
        while shard_path(folder, len(out)).is_file():
            out.append(shard_path(folder, len(out)))
        return out

    paths = written(data_dir) if prompts is None else answer_shards(work, prompts)
    if not paths:
        raise ExportError(f"{data_dir} holds no answer shards (shard-00000.npz …)")
    copy = written(work / "copy")
    seqs, answers, tokens = [], 0, 0
    for group in (paths, copy):
        for path in group:
            with np.load(path) as shard:  # the tokens only: the features stay on disk
                ids, offsets, prompt_lens = shard["tokens"], shard["offsets"], shard["prompt_lens"]
            for i in range(prompt_lens.shape[0]):
                if group is paths and prompts is not None and answers >= prompts:
                    break
                a, b, p = int(offsets[i]), int(offsets[i + 1]), int(prompt_lens[i])
                seqs.append((ids[a:b], p))
                answers += 1
                tokens += b - a - p
    return seqs, answers, tokens, len(paths), len(copy)


@contextlib.contextmanager
def _replacing(path: Path) -> Iterator[Path]:
    """A temporary path beside ``path``, renamed onto it when the block succeeds and removed
    otherwise: ``path`` is either the old file or the complete new one, never half of one."""
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}.npz")  # .npz: savez keeps the name as is
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        yield tmp
        os.replace(tmp, path)
    except OSError as exc:  # disk full, permissions: say so; what was there stays
        raise ExportError(f"writing {path} failed ({exc}); {path} is unchanged") from exc
    finally:
        tmp.unlink(missing_ok=True)


def build_table(target: Path, work: Path, prompts: int | None = None, max_n: int = 4, output: Path | None = None,
                progress=print) -> Path:
    """Count the answers in ``work`` and write the table to ``output`` (default: the engine
    folder's ``ngram_table.npz``)."""
    if not 1 <= max_n <= 8:
        raise ExportError(f"--max-n must be in 1..8, got {max_n}")
    manifest = read_manifest(target)
    seqs, answers, tokens, n_shards, n_copy = _answer_sequences(work, prompts)
    progress(f"[1/2] counting continuations in {answers} answers ({tokens} answer tokens; {n_shards} answer "
             f"shard(s), {n_copy} copy-task shard(s))")
    arrays = table_arrays(count_continuations(seqs, max_n))
    tok_sha = manifest.file_entry(manifest.tokenizer.file).sha256
    entries = {n: int(arrays[f"keys_{n}"].size) for n in range(1, max_n + 1)}
    meta = {"format": FORMAT, "context_lengths": list(range(1, max_n + 1)), "entries": entries,
            "tokenizer_sha256": tok_sha, "source_sha256": manifest.model.source_sha256, "model": manifest.model.name,
            "answers": answers, "answer_tokens": tokens, "work": str(work),
            "command": ("python -m export " + " ".join(shlex.quote(a) for a in sys.argv[1:])) if sys.argv[1:] else ""}
    out = output or target / FILE_NAME
    with _replacing(out) as tmp:
        np.savez_compressed(tmp, meta=np.asarray(json.dumps(meta, sort_keys=True)), **arrays)
    progress(f"[2/2] wrote {out}: {sum(entries.values())} contexts ({', '.join(f'{n}: {e}' for n, e in entries.items())}), "
             f"{out.stat().st_size / 1e6:.1f} MB")
    return out


def install_table(target: Path, source: Path, progress=print) -> Path:
    """Copy a table file into the engine folder after checking it belongs to its tokenizer."""
    manifest = read_manifest(target)
    if not source.is_file():
        raise ExportError(f"{source} does not exist; build a table with `python -m export ngram-table --work WORK`")
    table = NgramTable.load_for(source, manifest)
    out = target / FILE_NAME
    with _replacing(out) as tmp:
        shutil.copyfile(source, tmp)
    progress(f"installed {source} into {out}: {table.entries} contexts from {table.meta.get('answers')} answers")
    return out
