"""Training data for a DSpark drafter: the target's own greedy answers to the training prompts,
with what the drafter learns from at every position, computed once by the frozen target:

- ``aux``:  the target's hidden states at the engine's exposed layers, [T, H * layers] (fp16);
- ``top_ids`` / ``top_logp``: the target's top-K next-token log-probabilities, [T, K].

Written as shards (``shard-00000.npz`` …) of ``per_shard`` sequences, each renamed into place
when complete, so an interrupted run resumes at the first missing shard. Nothing here knows
about the drafter's architecture.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)


@dataclass
class Sequences:
    """Concatenated training sequences: sequence i is tokens[offsets[i]:offsets[i+1]], its
    answer starts at offsets[i] + prompt_lens[i]."""

    tokens: np.ndarray  # [T] int32
    offsets: np.ndarray  # [N+1] int64
    prompt_lens: np.ndarray  # [N] int32
    aux: np.ndarray  # [T, F] float16
    top_ids: np.ndarray  # [T, K] int32
    top_logp: np.ndarray  # [T, K] float16

    def __len__(self) -> int:
        return int(self.prompt_lens.shape[0])

    def span(self, i: int) -> tuple[int, int]:
        return int(self.offsets[i]), int(self.offsets[i + 1])


def shard_path(folder: Path, index: int) -> Path:
    return folder / f"shard-{index:05d}.npz"


def written_shards(folder: Path) -> list[Path]:
    """shard-00000.npz, shard-00001.npz … as far as they go in ``folder`` (a shard being written
    has another name until it is complete)."""
    out: list[Path] = []
    while shard_path(folder, len(out)).is_file():
        out.append(shard_path(folder, len(out)))
    return out


def shard_sequences(paths: list[Path]) -> Iterator[tuple[np.ndarray, int]]:
    """(prompt + answer ids, prompt length) of every sequence in these shards, in order, reading
    the token ids only (the features stay on disk)."""
    for path in paths:
        with np.load(path) as shard:
            ids, offsets, prompt_lens = shard["tokens"], shard["offsets"], shard["prompt_lens"]
        for i in range(prompt_lens.shape[0]):
            yield ids[int(offsets[i]):int(offsets[i + 1])], int(prompt_lens[i])


def generate_answers(model, prompts: list[list[int]], max_new_tokens: int, eos_id: int, pad_id: int,
                     batch: int) -> list[list[int]]:
    """Greedy answers, batched with left padding (the attention mask keeps padding inert)."""
    import torch

    answers: list[list[int]] = [[] for _ in prompts]
    for start in range(0, len(prompts), batch):
        chunk = prompts[start:start + batch]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for r, p in enumerate(chunk):
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=eos_id, pad_token_id=pad_id)
        for r in range(len(chunk)):
            gen = out[r, width:].tolist()
            if eos_id in gen:
                gen = gen[:gen.index(eos_id) + 1]
            answers[start + r] = gen
    return answers


def engine_features(decoder, seq: list[int], top_k: int, chunk: int = 128):
    """Teacher-forced pass of the target's engine over ``seq``: (aux [T, F] fp16, top-K ids,
    top-K log-probs). The engine is the one the runtime verifies with, so the drafter learns
    exactly the features and distributions it will see."""
    cache = decoder.new_cache()
    ids = np.asarray(seq, dtype=np.int64)
    aux, top_ids, top_logp = [], [], []
    for start in range(0, ids.shape[0], chunk):
        part = ids[start:start + chunk]
        out = decoder.session.forward(cache, part)
        cache.commit(part.shape[0])
        logits = out.logits.astype(np.float32)
        idx = np.argpartition(-logits, top_k, axis=-1)[:, :top_k]
        vals = np.take_along_axis(logits, idx, -1)
        order = np.argsort(-vals, axis=-1)
        idx, vals = np.take_along_axis(idx, order, -1), np.take_along_axis(vals, order, -1)
        m = logits.max(-1, keepdims=True)
        lse = m + np.log(np.exp(logits - m).sum(-1, keepdims=True))
        aux.append(out.hidden.astype(np.float16))
        top_ids.append(idx.astype(np.int32))
        top_logp.append((vals - lse).astype(np.float16))
    return np.concatenate(aux), np.concatenate(top_ids), np.concatenate(top_logp)


def write_shard(path: Path, decoder, seqs: list[tuple[list[int], list[int]]], top_k: int) -> None:
    """One shard of (prompt ids, answer ids) sequences with the engine's features, renamed into
    place when complete."""
    full = [p + a for p, a in seqs]
    feats = [engine_features(decoder, s, top_k) for s in full]
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, tokens=np.concatenate([np.asarray(s, dtype=np.int32) for s in full]),
             offsets=np.cumsum([0] + [len(s) for s in full]).astype(np.int64),
             prompt_lens=np.asarray([len(p) for p, _ in seqs], dtype=np.int32),
             aux=np.concatenate([f[0] for f in feats]), top_ids=np.concatenate([f[1] for f in feats]),
             top_logp=np.concatenate([f[2] for f in feats]))
    os.replace(tmp, path)


def _shard_key(tokens: np.ndarray, prompt_lens: np.ndarray) -> bytes:
    return hashlib.sha256(np.ascontiguousarray(tokens, dtype=np.int32).tobytes() + b"|"
                          + np.ascontiguousarray(prompt_lens, dtype=np.int32).tobytes()).digest()


def check_donor_folders(folders) -> None:
    """An ExportError naming the first of ``folders`` (``--reuse-features``) that is not a folder."""
    for folder in folders:
        if not Path(folder).is_dir():
            from dspark_edge.errors import ExportError

            raise ExportError(f"--reuse-features {folder}: not a folder; pass an earlier train-drafter --work folder")


class Donors:
    """Feature shards that earlier work folders (``train-drafter --reuse-features DIR``) already
    computed, taken instead of computing them again: each campaign run validates on every
    held-out answer so far and adds the same package text, whose features the previous run's
    folder holds. A donor shard is taken only when its token ids and prompt lengths equal the
    shard wanted, and when its first sequence's features, computed again here, agree with it
    (the same top-1 token at 99 % of positions and hidden features within 1e-2 relative): a
    folder made by another engine or model is detected at its first shard and not used."""

    RTOL = 1e-2
    TOP1 = 0.99

    def __init__(self, folders: list[Path], decoder, top_k: int) -> None:
        self._by_key: dict[bytes, Path] = {}
        check_donor_folders(folders)
        for folder in folders:
            for p in sorted(Path(folder).glob("*/*.npz")):
                if ".tmp" in p.name:
                    continue
                try:
                    with np.load(p) as z:
                        self._by_key.setdefault(_shard_key(z["tokens"], z["prompt_lens"]), p)
                except (OSError, KeyError, ValueError) as exc:
                    log.warning("--reuse-features: %s is not a feature shard (%s); not used", p, exc)
        self._decoder, self._top_k = decoder, top_k
        self._trusted: dict[Path, bool] = {}
        self.taken = 0

    def __len__(self) -> int:
        return len(self._by_key)

    def _agrees(self, path: Path) -> bool:
        with np.load(path) as z:
            tokens, offsets = z["tokens"], z["offsets"]
            n = int(offsets[1])
            aux, top = z["aux"][:n].astype(np.float32), z["top_ids"][:n, 0]
        mine = engine_features(self._decoder, tokens[:n].tolist(), self._top_k)
        mine_aux = mine[0].astype(np.float32)
        scale = max(float(np.abs(mine_aux).max()), 1e-6)
        ok = (mine_aux.shape == aux.shape and float(np.abs(mine_aux - aux).max()) <= self.RTOL * scale
              and float(np.mean(mine[1][:, 0] == top)) >= self.TOP1)
        if not ok:
            log.warning("--reuse-features: %s was made by another engine (its features differ from this engine's); "
                        "its folder is not used", path)
        return ok

    def take(self, seqs: list[tuple[list[int], list[int]]], dest: Path) -> bool:
        """Copy the donor shard holding exactly ``seqs`` to ``dest``; False when there is none
        (or its folder's features are not this engine's)."""
        if not seqs:
            return False
        key = _shard_key(np.concatenate([np.asarray(p + a, dtype=np.int32) for p, a in seqs]),
                         np.asarray([len(p) for p, _ in seqs], dtype=np.int32))
        src = self._by_key.get(key)
        if src is None:
            return False
        folder = src.parent.parent
        if folder not in self._trusted:
            self._trusted[folder] = self._agrees(src)
        if not self._trusted[folder]:
            return False
        tmp = dest.with_suffix(".tmp.npz")
        shutil.copyfile(src, tmp)
        os.replace(tmp, dest)
        self.taken += 1
        return True


def check_digest(folder: Path, name: str, digest: str, fix: str) -> None:
    """Shards in ``folder`` belong to the inputs with this digest: recorded in ``folder/name`` on
    first use; other inputs later (other installed packages, other options) are refused with an
    ExportError ending in ``fix``, never mixed in."""
    from dspark_edge.errors import ExportError

    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / name
    if not marker.is_file():
        marker.write_text(digest + "\n", encoding="utf-8")
    elif marker.read_text(encoding="utf-8").strip() != digest:
        raise ExportError(f"the shards in {folder} were made from other inputs; {fix}")


def fill_shards(paths: list[Path], make, label: str, progress=None, complete=None) -> None:
    """``make(i)`` for every shard path not written yet, or written but not ``complete(i)`` (it
    writes ``paths[i]`` and returns what it holds, for the progress line with the rate and ETA)."""
    todo = [i for i, p in enumerate(paths) if not p.is_file() or (complete is not None and not complete(i))]
    t0 = time.perf_counter()
    for done, i in enumerate(todo, 1):
        what = make(i)
        if progress:
            rate = (time.perf_counter() - t0) / done
            progress(f"{label} shard {i + 1}/{len(paths)}: {what} ({rate:.0f} s/shard, "
                     f"ETA {rate * (len(todo) - done) / 60:.1f} min)")


ANSWERS_PER_SHARD = 64


def answer_shards(work: Path, prompts: int) -> list[Path]:
    """The answer shards a ``train-drafter`` work folder holds for its first ``prompts`` prompts;
    a ConfigError naming the command when any is missing."""
    from dspark_edge.errors import ConfigError

    if prompts < 1:
        raise ConfigError(f"--prompts must be at least 1, got {prompts}")
    paths = [shard_path(work / "data", i) for i in range((prompts + ANSWERS_PER_SHARD - 1) // ANSWERS_PER_SHARD)]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise ConfigError(f"answer shards missing: {', '.join(missing)}; run `python -m export train-drafter` "
                          f"with --work {work} --prompts {prompts} first")
    return paths


def build_shards(model, decoder, tokenizer, prompts: list[dict], folder: Path, eos_id: int, pad_id: int,
                 max_new_tokens: int = 192, per_shard: int = ANSWERS_PER_SHARD, top_k: int = 16, progress=None,
                 known: dict[tuple[int, ...], list[int]] | None = None) -> list[Path]:
    """Write every missing shard; returns all shard paths in order. ``model`` (PyTorch) writes
    the greedy answers in one batch per shard, except those ``known`` holds (recorded answers
    keyed by prompt ids, same model and cap); ``decoder`` (the target's FP32 engine) gives the
    features."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = [shard_path(folder, i) for i in range((len(prompts) + per_shard - 1) // per_shard)]

    def make(i: int) -> str:
        recs = prompts[i * per_shard:(i + 1) * per_shard]
        prompt_ids = [tokenizer.encode_chat(r["messages"]) for r in recs]
        answers = [None if known is None else known.get(tuple(p)) for p in prompt_ids]
        todo = [j for j, a in enumerate(answers) if a is None]
        if todo:
            made = generate_answers(model, [prompt_ids[j] for j in todo], max_new_tokens, eos_id, pad_id, per_shard)
            for j, a in zip(todo, made):
                answers[j] = a
        write_shard(paths[i], decoder, list(zip(prompt_ids, answers)), top_k)
        reused = len(answers) - len(todo)
        return f"{sum(len(a) for a in answers)} answer tokens" + (f", {reused} recorded answers reused" if reused else "")

    def complete(i: int) -> bool:
        # A last shard written for fewer prompts is rewritten when more are asked for, so that
        # growing --prompts never skips the prompts between the old and the new shard boundary.
        return count_sequences([paths[i]]) >= len(prompts[i * per_shard:(i + 1) * per_shard])

    fill_shards(paths, make, "data", progress, complete)
    return paths


def answer_feature_shards(decoder, pairs: list[tuple[list[int], list[int]]], folder: Path, top_k: int = 16,
                          per_shard: int = ANSWERS_PER_SHARD, progress=None, donors: Donors | None = None) -> list[Path]:
    """Feature shards for recorded (prompt ids, answer ids) pairs, in order: nothing is
    generated, the engine only teacher-forces each pair. The pairs may grow between runs (a data
    campaign appends answers): shards already written are kept when their token ids equal the
    pairs', a last shorter shard is rewritten, and a shard holding other tokens is refused (an
    ExportError naming the fix), never mixed in."""
    from dspark_edge.errors import ExportError

    folder.mkdir(parents=True, exist_ok=True)
    paths = [shard_path(folder, i) for i in range((len(pairs) + per_shard - 1) // per_shard)]

    def rows(i: int) -> list[tuple[list[int], list[int]]]:
        return pairs[i * per_shard:(i + 1) * per_shard]

    def complete(i: int) -> bool:
        with np.load(paths[i]) as shard:
            tokens, n = shard["tokens"], int(shard["prompt_lens"].shape[0])
        want = np.concatenate([np.asarray(p + a, dtype=np.int64) for p, a in rows(i)[:n]])
        if not np.array_equal(tokens.astype(np.int64), want):
            raise ExportError(f"{paths[i]} holds other answers than the answers file's; pass another --work "
                              f"folder, or delete {folder} to compute the features again")
        return n >= len(rows(i))

    def make(i: int) -> str:
        what = f"{len(rows(i))} answers, {sum(len(a) for _, a in rows(i))} answer tokens"
        if donors is not None and donors.take(rows(i), paths[i]):
            return what + ", taken from an earlier work folder"
        write_shard(paths[i], decoder, rows(i), top_k)
        return what

    fill_shards(paths, make, "features", progress, complete)
    return paths


def count_sequences(paths: list[Path]) -> int:
    """Sequences in these shards, reading only their prompt lengths (not the features)."""
    total = 0
    for p in paths:
        with np.load(p) as shard:
            total += int(shard["prompt_lens"].shape[0])
    return total


def load_shards(paths: list[Path]) -> Sequences:
    parts = [np.load(p) for p in paths]
    tokens = np.concatenate([p["tokens"] for p in parts])
    offsets, base = [np.zeros(1, dtype=np.int64)], 0
    for p in parts:
        offsets.append(p["offsets"][1:] + base)
        base += int(p["offsets"][-1])
    return Sequences(tokens=tokens, offsets=np.concatenate(offsets),
                     prompt_lens=np.concatenate([p["prompt_lens"] for p in parts]),
                     aux=np.concatenate([p["aux"] for p in parts]),
                     top_ids=np.concatenate([p["top_ids"] for p in parts]),
                     top_logp=np.concatenate([p["top_logp"] for p in parts]))
