"""``python -m export ngram-table``: the n-gram drafter's corpus table
(``dspark_edge.drafters.ngram_table``) from the target's own greedy answers.

The answers are those a ``train-drafter`` work folder already holds (``<work>/data`` answer
shards, and ``<work>/copy`` copy-task answers when present), or the same packed into one file
by ``python -m export answers`` (``--answers``; the project ships the embedded default's):
only answer tokens are counted as
continuations, each with up to ``max_n`` tokens of context before it (prompt tokens included).
The table is written to a temporary file and renamed into place, so an engine folder never holds
a half-written one; ``--from`` installs a table built elsewhere (the one the project ships) after
checking it belongs to the engine's tokenizer.
"""

from __future__ import annotations

import itertools
import json
import shutil
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from dspark_edge.drafters.ngram_table import FILE_NAME, FORMAT, NgramTable, context_key
from dspark_edge.errors import ExportError
from dspark_edge.manifest import read_manifest
from dspark_edge.paths import output_file

from .atomic import export_command, replacing_file


def count_continuations(sequences, max_n: int) -> dict[int, dict[tuple[int, ...], Counter]]:
    """``sequences``: (token ids, index where the answer starts) pairs → for every context length
    n ≤ ``max_n``, each n-token context followed by an answer token → Counter of those tokens.
    With ``table_arrays``, the reference ``count_table`` is checked against (building a table
    uses ``count_table``)."""
    counts: dict[int, dict[tuple[int, ...], Counter]] = {n: defaultdict(Counter) for n in range(1, max_n + 1)}
    for tokens, answer_start in sequences:
        t = [int(x) for x in tokens]
        for n, table in counts.items():
            for j in range(max(n, answer_start), len(t)):
                table[tuple(t[j - n:j])][t[j]] += 1
    return counts


def table_arrays(counts: dict[int, dict[tuple[int, ...], Counter]]) -> dict[str, np.ndarray]:
    """The file's arrays: per context length, sorted context hashes, the most frequent next
    token (ties: the smallest id, so the table does not depend on counting order), its share,
    and how often the context occurred (capped at 65535)."""
    arrays: dict[str, np.ndarray] = {}
    for n, table in counts.items():
        rows = []
        for ctx, c in table.items():
            best = max(c.items(), key=lambda kv: (kv[1], -kv[0]))
            total = sum(c.values())
            rows.append((context_key(ctx), best[0], best[1] / total, min(total, 65535)))
        rows.sort()
        keys = np.asarray([r[0] for r in rows], dtype=np.int64)
        if keys.size and (np.diff(keys) == 0).any():
            raise ExportError(f"two {n}-token contexts share a hash; report this with the data used")
        arrays[f"keys_{n}"] = keys
        arrays[f"next_{n}"] = np.asarray([r[1] for r in rows], dtype=np.int32)
        arrays[f"share_{n}"] = np.asarray([r[2] for r in rows], dtype=np.float16)
        arrays[f"count_{n}"] = np.asarray([r[3] for r in rows], dtype=np.uint16)
    return arrays


_PRIME = 0x100000001B3  # context_key's multiplier
_CHECK_PRIME = 0x9E3779B97F4A7C15  # a second, independent hash: two contexts behind one key differ in it


def _hashes(tokens: np.ndarray, ends: np.ndarray, n: int, prime: int) -> np.ndarray:
    """``context_key`` of the n tokens before each position in ``ends``, for all of them at
    once (uint64 products wrap modulo 2^64, and the 63-bit mask then gives Python's result
    modulo 2^63). Other ``prime``s give the collision check's hash."""
    key = np.full(ends.size, n, dtype=np.uint64)
    mul, mask = np.uint64(prime), np.uint64((1 << 63) - 1)
    with np.errstate(over="ignore"):
        for i in range(n):
            key = (key * mul + tokens[ends - n + i].astype(np.uint64) + np.uint64(1)) & mask
    return key


def count_table(sequences, max_n: int, min_count: int = 1) -> dict[str, np.ndarray]:
    """``table_arrays(count_continuations(sequences, max_n))``, counted with array operations
    (a sort of every position's context hash instead of a Python object per context), keeping only
    the contexts seen at least ``min_count`` times (1: all). Equal to that reference
    whenever ``min_count`` is 1 (a test compares them); like it, it refuses two contexts that
    share a hash, found here by a second hash that differs within one key."""
    lengths = np.asarray([len(t) for t, _ in sequences], dtype=np.int64)
    tokens = (np.concatenate([np.asarray(t, dtype=np.int64) for t, _ in sequences]) if len(sequences)
              else np.zeros(0, dtype=np.int64))
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if len(sequences) else lengths
    answer = np.asarray([a for _, a in sequences], dtype=np.int64)
    seq = np.repeat(np.arange(lengths.size), lengths)
    local = np.arange(tokens.size) - starts[seq]
    arrays: dict[str, np.ndarray] = {}
    for n in range(1, max_n + 1):
        ends = np.flatnonzero(local >= np.maximum(n, answer[seq]))  # positions j: context t[j-n:j], next t[j]
        keys, nxt = _hashes(tokens, ends, n, _PRIME), tokens[ends]
        order = np.lexsort((nxt, keys))
        keys, nxt, check = keys[order], nxt[order], _hashes(tokens, ends[order], n, _CHECK_PRIME)
        new_key = np.concatenate([[True], keys[1:] != keys[:-1]]) if keys.size else np.zeros(0, bool)
        group = np.cumsum(new_key) - 1
        if (check != check[np.flatnonzero(new_key)][group]).any():
            raise ExportError(f"two {n}-token contexts share a hash; report this with the data used")
        new_pair = new_key | np.concatenate([[True], nxt[1:] != nxt[:-1]]) if keys.size else new_key
        first = np.flatnonzero(new_pair)  # each (context, next token) pair's first row
        pair_count = np.diff(np.append(first, keys.size))
        pair_key, pair_next, pair_group = keys[first], nxt[first], group[first]
        total = np.bincount(pair_group, weights=pair_count, minlength=int(group[-1]) + 1 if keys.size else 0)
        # the most frequent next token of each context; between equal counts, the smallest id
        best = np.lexsort((pair_next, -pair_count, pair_group))
        best = best[np.concatenate([[True], pair_group[best][1:] != pair_group[best][:-1]])] if best.size else best
        kept = total[pair_group[best]] >= min_count
        best = best[kept]
        arrays[f"keys_{n}"] = pair_key[best].astype(np.int64)
        arrays[f"next_{n}"] = pair_next[best].astype(np.int32)
        arrays[f"share_{n}"] = (pair_count[best] / total[pair_group[best]]).astype(np.float16)
        arrays[f"count_{n}"] = np.minimum(total[pair_group[best]], 65535).astype(np.uint16)
    return arrays


def calibration_rows(table: NgramTable, sequences, k: int = 7) -> tuple[np.ndarray, np.ndarray]:
    """Replays the drafter (prompt lookup + ``table``) over held-out answers, k drafts a round,
    as greedy decoding would run it: every draft the verification judges (up to the first
    rejection) gives the confidence model's inputs and whether it was accepted."""
    from dspark_edge.drafters import DraftRequest, NgramDrafter

    xs, ys = [], []
    rng = np.random.default_rng(0)
    for tokens, answer_start in sequences:
        ids = [int(t) for t in tokens]
        prompt, answer = ids[:answer_start], ids[answer_start:]
        drafter = NgramDrafter(table=table, record_features=True)
        drafter.begin(prompt)
        j = 0
        while j < len(answer) - 1:
            draft = drafter.propose(DraftRequest(prompt + answer[:j], min(k, len(answer) - j - 1), 0.0, 0, 1.0), rng)
            got = draft.tokens.tolist()
            acc = 0
            while acc < len(got) and got[acc] == answer[j + acc]:
                acc += 1
            if got:
                judged = min(len(got), acc + 1)
                xs.append(drafter.last_features[:judged])
                ys.append(np.arange(judged) < acc)
                drafter.feedback(len(got), acc, prompt + answer[:j + acc + 1])
            j += acc + 1
    if not xs:
        return np.zeros((0, 0)), np.zeros(0)
    return np.concatenate(xs), np.concatenate(ys).astype(np.float64)


def fit_logistic(x: np.ndarray, y: np.ndarray, l2: float = 1e-3) -> np.ndarray:
    """Weights of P(accepted) = σ(x·w), by L-BFGS on the mean log-loss plus ``l2``·|w|²."""
    import torch

    xt, yt = torch.as_tensor(x, dtype=torch.float64), torch.as_tensor(y, dtype=torch.float64)
    w = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w], lr=1.0, max_iter=200, tolerance_grad=1e-9, line_search_fn="strong_wolfe")

    def loss():
        opt.zero_grad()
        v = torch.nn.functional.binary_cross_entropy_with_logits(xt @ w, yt) + l2 * (w * w).sum()
        v.backward()
        return v

    opt.step(loss)
    return w.detach().numpy()


def _scores(p: np.ndarray, y: np.ndarray) -> dict:
    from .drafter.calibrate import auroc, ece

    p = np.clip(p, 1e-6, 1 - 1e-6)
    return {"log_loss": round(float(-(y * np.log(p) + (1 - y) * np.log(1 - p)).mean()), 4),
            "ece": round(float(ece(p, y)), 4), "auroc": round(float(auroc(p, y)), 4)}


MIN_HELD_OUT = 4  # answers held out for the confidence model's fit, at least
MIN_JUDGED = 200  # judged drafts they must give, at least


def fit_calibration(sequences, max_n: int, hold_every: int = 8, progress=print, min_count: int = 1) -> dict | None:
    """The drafter's confidence model: a table counted from all answers but every
    ``hold_every``-th (keeping the contexts seen ``min_count`` times, as the table it calibrates
    does), replayed on those held out (``calibration_rows``), a logistic fit. Its
    quality is reported by a two-fold fit on the held-out rows (fit on one half, scored on the
    other), against a constant at the mean acceptance. None (with a message) when the answers
    are too few to fit it."""
    from dspark_edge.drafters.ngram import FEATURES

    held = sequences[::hold_every]
    rest = [s for i, s in enumerate(sequences) if i % hold_every]
    table = NgramTable.from_arrays(count_table(rest, max_n, min_count)) if rest else None
    x, y = calibration_rows(table, held) if table is not None else (np.zeros((0, 0)), np.zeros(0))
    if len(held) < MIN_HELD_OUT or y.size < MIN_JUDGED or y.min() == y.max():
        progress(f"    not calibrated: {len(sequences)} answers hold out {len(held)} (every {hold_every}th) with "
                 f"{y.size} judged drafts; a fit needs {MIN_HELD_OUT} answers and {MIN_JUDGED} drafts, accepted "
                 "and rejected. The drafter will estimate its confidences online.")
        return None
    progress(f"    {len(held)} held-out answers gave {len(y)} judged drafts ({y.mean():.1%} accepted)")
    half = np.arange(len(y)) % 2 == 0  # interleaved halves: both see every kind of answer
    p = np.empty_like(y)
    for a, b in ((half, ~half), (~half, half)):
        p[b] = 1.0 / (1.0 + np.exp(-(x[b] @ fit_logistic(x[a], y[a]))))
    w = fit_logistic(x, y)
    report = {"features": list(FEATURES), "weights": [round(float(v), 6) for v in w],
              "held_out_answers": len(held), "judged_drafts": int(len(y)), "accepted": round(float(y.mean()), 4),
              "two_fold": _scores(p, y), "constant": _scores(np.full_like(y, y.mean()), y)}
    progress(f"    two-fold held-out log-loss {report['two_fold']['log_loss']} (a constant: "
             f"{report['constant']['log_loss']}), ECE {report['two_fold']['ece']:.3f}, "
             f"AUROC {report['two_fold']['auroc']:.3f}")
    return report


def _answer_sequences(work: Path, prompts: int | None):
    from .drafter.data import answer_shards, shard_sequences, written_shards

    data_dir = work / "data"
    if not data_dir.is_dir():
        raise ExportError(f"{work} holds no answer shards ({data_dir} is missing); write them with "
                          f"`python -m export train-drafter --target ENGINE --output DIR --work {work} --steps 1`")
    paths = written_shards(data_dir) if prompts is None else answer_shards(work, prompts)
    if not paths:
        raise ExportError(f"{data_dir} holds no answer shards (shard-00000.npz …)")
    copy = written_shards(work / "copy")
    seqs = list(itertools.islice(shard_sequences(paths), prompts)) + list(shard_sequences(copy))
    tokens = sum(len(ids) - p for ids, p in seqs)
    return seqs, len(seqs), tokens, len(paths), len(copy)


def build_table(target: Path, work: Path | None, prompts: int | None = None, max_n: int = 4, output: Path | None = None,
                progress=print, calibrate: bool = True, answers: Path | None = None, min_count: int = 1) -> Path:
    """Count the answers in ``work`` (or in the packed ``answers`` file) and write the table to
    ``output`` (default: the engine folder's ``ngram_table.npz``), with the drafter's confidence
    calibration unless ``calibrate`` is false; only contexts seen ``min_count`` times or more."""
    if not 1 <= max_n <= 8:
        raise ExportError(f"--max-n must be in 1..8, got {max_n}")
    if not 1 <= min_count <= 65535:
        raise ExportError(f"--min-count must be in 1..65535 (the table counts to 65535), got {min_count}")
    if (work is None) == (answers is None):
        raise ExportError("count either a work folder (--work) or an answers file (--answers)")
    manifest = read_manifest(target)
    out = Path(output or target / FILE_NAME)
    if out.is_dir() or out.parent.is_dir():  # before the counting: a folder that is missing is created
        output_file(out, "--output")
    steps = 3 if calibrate else 2
    if answers is not None:
        from .answers import load_answers

        packed = load_answers(answers, manifest)
        seqs = packed.sequences()
        n_answers, tokens = len(seqs), sum(len(s) - p for s, p in seqs)
        where = f"{answers}"
    else:
        seqs, n_answers, tokens, n_shards, n_copy = _answer_sequences(work, prompts)
        where = f"{n_shards} answer shard(s), {n_copy} copy-task shard(s)"
    kept = "" if min_count == 1 else f"; keeping contexts seen {min_count} times or more"
    progress(f"[1/{steps}] counting continuations in {n_answers} answers ({tokens} answer tokens; {where}{kept})")
    arrays = count_table(seqs, max_n, min_count)
    calibration = None
    if calibrate:
        progress(f"[2/{steps}] calibrating the drafter's confidences on held-out answers")
        calibration = fit_calibration(seqs, max_n, progress=progress, min_count=min_count)
    tok_sha = manifest.file_entry(manifest.tokenizer.file).sha256
    entries = {n: int(arrays[f"keys_{n}"].size) for n in range(1, max_n + 1)}
    meta = {"format": FORMAT, "context_lengths": list(range(1, max_n + 1)), "entries": entries,
            "tokenizer_sha256": tok_sha, "source_sha256": manifest.model.source_sha256, "model": manifest.model.name,
            "answers": n_answers, "answer_tokens": tokens, "work": str(work if answers is None else answers),
            "min_count": min_count,
            "calibration": calibration,
            "command": export_command()}
    with replacing_file(out) as tmp:
        np.savez_compressed(tmp, meta=np.asarray(json.dumps(meta, sort_keys=True)), **arrays)
    progress(f"[{steps}/{steps}] wrote {out}: {sum(entries.values())} contexts ({', '.join(f'{n}: {e}' for n, e in entries.items())}), "
             f"{out.stat().st_size / 1e6:.1f} MB")
    return out


def install_table(target: Path, source: Path, progress=print) -> Path:
    """Copy a table file into the engine folder after checking it belongs to its tokenizer."""
    manifest = read_manifest(target)
    if not source.is_file():
        raise ExportError(f"{source} does not exist; build a table with `python -m export ngram-table --work WORK`")
    table = NgramTable.load_for(source, manifest)
    out = target / FILE_NAME
    with replacing_file(out) as tmp:
        shutil.copyfile(source, tmp)
    progress(f"installed {source} into {out}: {table.entries} contexts from {table.meta.get('answers')} answers")
    return out
