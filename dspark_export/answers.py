"""The target's recorded greedy answers, packed into one small file.

Generating the answers is the slow part of ``train-drafter`` (about 20 ms a token on a 2-core
CPU, PyTorch batched greedy decoding) and everything else the project derives from them is fast:
the n-gram table and its calibration (``ngram-table``) count and replay token ids, and the
drafter's features are one teacher-forced pass of the engine (about 10x faster than
generating). ``python -m export answers`` packs the token ids of a ``train-drafter`` work
folder's answer shards (``data/``: training prompts, ``copy/``: copy tasks; the features stay
behind) into one compressed file, which is small enough to keep with the project:

    python -m export answers --target engines/smollm2-135m --work runs/drafter \\
        --output drafters/smollm2-135m-answers.npz

``train-drafter --answers FILE`` then takes the answer of every prompt the file holds instead
of generating it (same prompt token ids, same model, same ``--max-new-tokens``), and
``ngram-table --answers FILE`` counts the file instead of a work folder. A file is refused for
another model or tokenizer, never silently mixed in.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dspark_edge.errors import ExportError
from dspark_edge.manifest import Manifest, read_manifest

from .atomic import export_command, replacing_file

FORMAT = 1
# A training prompt's answer; a copy task's; a self-written prompt's; a task prompt's (data_engine).
# Files store the index, so new kinds are only ever appended.
KINDS = ("prompt", "copy", "magpie", "task")


@dataclass(frozen=True)
class Answers:
    """Sequences of prompt ids followed by the target's greedy answer ids."""

    tokens: np.ndarray  # all sequences end to end
    offsets: np.ndarray  # [n + 1]
    prompt_lens: np.ndarray  # [n]
    kinds: np.ndarray  # [n] index into KINDS
    meta: dict

    def __len__(self) -> int:
        return int(self.prompt_lens.shape[0])

    def pair(self, i: int) -> tuple[list[int], list[int]]:
        a, b, p = int(self.offsets[i]), int(self.offsets[i + 1]), int(self.prompt_lens[i])
        ids = self.tokens[a:b].tolist()
        return ids[:p], ids[p:]

    def by_prompt(self) -> dict[tuple[int, ...], list[int]]:
        """Answer ids keyed by prompt ids (what ``train-drafter`` looks prompts up by)."""
        return {tuple(p): a for p, a in (self.pair(i) for i in range(len(self)))}

    def sequences(self) -> list[tuple[np.ndarray, int]]:
        """(prompt + answer ids, prompt length) per answer, as ``ngram-table`` counts them."""
        return [(self.tokens[int(self.offsets[i]):int(self.offsets[i + 1])].astype(np.int64), int(self.prompt_lens[i]))
                for i in range(len(self))]


def write_answers(output: Path, seqs: list, prompt_lens, kinds, vocab_size: int, meta: dict,
                  progress=print, label: str = "") -> Path:
    """Write one answers file (this module's format) to ``output``, renamed into place when
    complete: ``seqs`` (prompt + answer ids each), their prompt lengths and kinds (indices into
    KINDS); ``meta`` gains the format, the per-kind counts and the answer token count."""
    prompt_lens, kinds = np.asarray(prompt_lens), np.asarray(kinds)
    dtype = np.uint16 if vocab_size <= 2**16 else np.int32
    answer_tokens = int(sum(len(s) for s in seqs) - int(prompt_lens.sum()))
    counts = {k: int((kinds == i).sum()) for i, k in enumerate(KINDS)}
    meta = {**meta, "format": FORMAT, "answers": counts, "answer_tokens": answer_tokens}
    with replacing_file(output) as tmp:
        np.savez_compressed(tmp, meta=np.asarray(json.dumps(meta, sort_keys=True)),
                            tokens=np.concatenate(seqs).astype(dtype),
                            offsets=np.cumsum([0] + [len(s) for s in seqs]).astype(np.int64),
                            prompt_lens=prompt_lens.astype(np.int32), kinds=kinds.astype(np.int8))
    progress(f"{label}wrote {output}: {len(seqs)} answers ({', '.join(f'{v} {k}' for k, v in counts.items())}), "
             f"{answer_tokens} answer tokens, {output.stat().st_size / 1e6:.2f} MB")
    return output


def pack_answers(target: Path, work: Path, output: Path, progress=print) -> Path:
    """Write the answers of ``work``'s shards to ``output`` (renamed into place when complete)."""
    from .drafter.data import shard_sequences, written_shards

    manifest = read_manifest(target)
    groups = [written_shards(work / "data"), written_shards(work / "copy")]  # KINDS[0], KINDS[1]
    if not groups[0]:
        raise ExportError(f"{work / 'data'} holds no answer shards; write them with `python -m export train-drafter "
                          f"--target {target} --output DIR --work {work} --steps 1`")
    options = work / "options.json"
    max_new = json.loads(options.read_text()).get("max_new_tokens") if options.is_file() else None
    if max_new is None:
        raise ExportError(f"{options} is missing: it records the answers' --max-new-tokens; pack a folder "
                          "written by `python -m export train-drafter`")
    seqs, prompt_lens, kinds = [], [], []
    for kind, paths in enumerate(groups):
        for ids, plen in shard_sequences(paths):
            seqs.append(ids)
            prompt_lens.append(plen)
            kinds.append(kind)
    meta = {"model": manifest.model.name, "source_sha256": manifest.model.source_sha256,
            "tokenizer_sha256": manifest.file_entry(manifest.tokenizer.file).sha256, "max_new_tokens": int(max_new),
            "work": str(work), "command": export_command()}
    return write_answers(output, seqs, prompt_lens, kinds, manifest.model.vocab_size, meta, progress)


def merge_answers(target: Path, files: list[Path], output: Path, progress=print) -> Path:
    """Write the answers of ``files`` (answers files of ``target``'s model, one answer cap) to
    ``output``, in the order given, each file's answers in its own order; an answer whose prompt
    an earlier one already has is dropped, so no prompt is both trained on and held out. The
    order matters: ``train-drafter --data-from N`` names the answers a run has not trained on by
    index, so a grown campaign file lists the old file first."""
    manifest = read_manifest(target)
    if len(files) < 2:
        raise ExportError("--merge takes two or more answers files")
    parts = [load_answers(Path(f), manifest) for f in files]
    caps = {int(p.meta.get("max_new_tokens", -1)) for p in parts}
    if len(caps) > 1:
        raise ExportError(f"the files hold answers of different caps ({sorted(caps)} tokens); merge files written "
                          "with one --max-new-tokens")
    seen: set[bytes] = set()
    seqs, prompt_lens, kinds, sources = [], [], [], []
    for path, part in zip(files, parts):
        kept = dropped = 0
        for i in range(len(part)):
            a, b, plen = int(part.offsets[i]), int(part.offsets[i + 1]), int(part.prompt_lens[i])
            key = part.tokens[a:a + plen].astype(np.int64).tobytes()
            if key in seen:
                dropped += 1
                continue
            seen.add(key)
            seqs.append(part.tokens[a:b])
            prompt_lens.append(plen)
            kinds.append(int(part.kinds[i]))
            kept += 1
        sources.append({"file": Path(path).name, "first": len(seqs) - kept, "answers": kept,
                        "duplicates_dropped": dropped, "made_by": part.meta.get("made_by", "python -m export answers")})
        progress(f"{path}: {kept} answers at {len(seqs) - kept}–{len(seqs) - 1}"
                 + (f", {dropped} whose prompt came earlier dropped" if dropped else ""))
    meta = {"model": manifest.model.name, "source_sha256": manifest.model.source_sha256,
            "tokenizer_sha256": manifest.file_entry(manifest.tokenizer.file).sha256, "max_new_tokens": caps.pop(),
            "parts": sources, "command": export_command(),
            "made_by": "; ".join(f"{s['made_by']} ({s['answers']} from {s['first']})" for s in sources)}
    return write_answers(output, seqs, prompt_lens, kinds, manifest.model.vocab_size, meta, progress)


def load_answers(path: Path, manifest: Manifest, max_new_tokens: int | None = None) -> Answers:
    """The answers in ``path``, checked against the engine's model and tokenizer (and the answer
    length cap when given); an ExportError naming the mismatch otherwise."""
    if not path.is_file():
        raise ExportError(f"{path} does not exist; pack answers with `python -m export answers --work WORK`")
    try:
        with np.load(path) as f:
            meta = json.loads(str(f["meta"]))
            answers = Answers(tokens=f["tokens"], offsets=f["offsets"], prompt_lens=f["prompt_lens"], kinds=f["kinds"],
                              meta=meta)
    except (OSError, KeyError, ValueError) as exc:
        raise ExportError(f"{path}: not an answers file ({exc}); pack one with `python -m export answers`") from exc
    if meta.get("format") != FORMAT:
        raise ExportError(f"{path}: answers format {meta.get('format')}, this exporter reads format {FORMAT}")
    tok_sha = manifest.file_entry(manifest.tokenizer.file).sha256
    if meta.get("tokenizer_sha256") != tok_sha:
        raise ExportError(f"{path} was recorded with another tokenizer than {manifest.model.name}'s; record answers "
                          "for this engine with `python -m export train-drafter` (and pack them)")
    if meta.get("source_sha256") != manifest.model.source_sha256:
        raise ExportError(f"{path} holds the answers of another model ({meta.get('model')}, source "
                          f"{str(meta.get('source_sha256'))[:12]}…) than this engine's ({manifest.model.name}, "
                          f"{manifest.model.source_sha256[:12]}…)")
    if max_new_tokens is not None and meta.get("max_new_tokens") != max_new_tokens:
        raise ExportError(f"{path} holds answers capped at {meta.get('max_new_tokens')} tokens, not "
                          f"--max-new-tokens {max_new_tokens}; pass --max-new-tokens {meta.get('max_new_tokens')} "
                          "or leave out --answers")
    n = answers.prompt_lens.shape[0]
    if answers.offsets.shape != (n + 1,) or answers.kinds.shape != (n,) or int(answers.offsets[-1]) != answers.tokens.size:
        raise ExportError(f"{path}: its arrays disagree (the file is damaged); pack it again")
    return answers
