"""``python -m export data``: the target's own answers at scale, for training drafters.

A drafter learns to predict what the target says, so its training data is the target's own
greedy answers; the number of answers is what limits a drafter trained on this project's CPU.
This engine writes them in batches, in resumable shards of token ids, on one of two backends:

- ``genai`` (default): onnxruntime-genai over the engine's own FP32 graph (the graph the runtime
  verifies with, so a batched answer is the answer the runtime gives one prompt at a time; a
  test checks it);
- ``torch``: the engine's source model in PyTorch, FP32 (TF32 off), on ``--device`` (``cuda`` on
  a machine with an NVIDIA GPU: tens of thousands of answers in minutes). The model must be the
  one the engine was exported from (its sha256 is checked against the manifest's). Its answers
  are the same model's greedy answers computed in another order of sums, so a near-tie can break
  the other way; the work folder records the backend and never mixes the two.

Prompts, in this order (none of them the benchmark prompts, ``dspark_edge/data/prompts.jsonl``):

- ``prompt``: the project's templated training prompts (``drafter/prompts.py``);
- ``copy``:   copy tasks over installed documents (summarise, rewrite, explain a given text);
- ``task``:   with ``--tasks N``, task prompts from larger templated families and passage tasks
  over the target's own earlier answers (``--passages FILE``, an answers file), none near a
  benchmark prompt (``drafter/prompts.py``, ``task_prompts``);
- ``magpie``: user messages the target writes itself: given the chat template up to the start
  of a user turn, the target samples a user message (the Magpie method: Xu et al. 2024,
  "Magpie: Alignment Data Synthesis from Scratch by Prompting Aligned LLMs with Nothing").
  A message is kept when it ended by itself, holds 3-120 words of mostly plain text, carries no
  special-token text, is new (case and spacing folded) and shares at most half its words with
  any benchmark prompt. With ``--openers`` each batch's messages begin with an opening drawn from
  ``drafter/prompts.py``'s ``MESSAGE_OPENERS`` ("Write a short story about", "Why is",
  "Summarise this:", …) that the target continues, so they spread over the kinds of request
  people make rather than the open requests unseeded messages mostly are (recorded with the
  opening, kind ``magpie``).

The work folder:

- ``engine.json``: what the answers are answers of (model, tokenizer, graph, cap); a folder made
  for another engine or cap is refused, never mixed in;
- ``prompts.jsonl``: every prompt in the order answered (kind, messages, provenance), appended a
  batch at a time; a line cut by a kill is dropped on the next start, and records that do not
  match the prompts the shards answered (or are missing) are rebuilt from the shards;
- ``answers/shard-NNNNN.npz``: the token ids of ``per_shard`` consecutive prompts and their
  answers, renamed into place when complete, so a run resumes at the first missing shard.

``--output FILE`` packs every answered shard into one answers file (``answers.py``) that
``train-drafter --answers`` and ``ngram-table --answers`` read, small enough to commit.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dspark_edge.errors import ExportError
from dspark_edge.manifest import Manifest, engine_path, read_manifest

from .answers import KINDS

log = logging.getLogger(__name__)

Progress = Callable[[str], None]
MAX_WORDS = 120
MIN_WORDS = 3
GENAI_MAX_BATCH = 32  # onnxruntime-genai's generator refuses more rows than this on the CPU
MAX_FRUITLESS = 8  # batches of self-written messages in a row with none kept before giving up
BACKENDS = ("genai", "torch")
MADE_BY = {"genai": "python -m export data (onnxruntime-genai, batched greedy over the engine's FP32 graph)",
           "torch": "python -m export data --backend torch (PyTorch FP32, batched greedy over the engine's source "
                    "model)"}


@dataclass(frozen=True)
class DataOptions:
    target_engine: Path
    work: Path
    answers: int = 2000  # prompts answered in all (the templated and copy prompts count)
    prompts: int | None = None  # templated prompts first (None: all of them)
    copy_prompts: int = 512
    tasks: int = 0  # task prompts after the copy tasks
    passages: Path | None = None  # an answers file whose answers give the task prompts' passages
    max_new_tokens: int = 192
    batch: int = 32
    per_shard: int = 256
    magpie_tokens: int = 96  # the cap of a self-written user message
    openers: bool = False  # self-written messages begin with an opening from MESSAGE_OPENERS
    temperature: float = 1.0
    top_p: float = 0.95
    threads: int | None = None
    seed: int = 0
    output: Path | None = None
    pack_first: int | None = None  # with output: pack only the folder's first N answers (a grown folder, the old layout)
    backend: str = "genai"  # "genai" | "torch"
    device: str = "cpu"  # torch only: "cpu", "cuda", "cuda:N"
    source: str = "default"  # torch only: the engine's source model (export's --source)

    def __post_init__(self) -> None:
        for name in ("answers", "max_new_tokens", "batch", "per_shard", "magpie_tokens"):
            if getattr(self, name) < 1:
                raise ExportError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        for name in ("prompts", "copy_prompts", "tasks"):
            if (getattr(self, name) or 0) < 0:
                raise ExportError(f"--{name.replace('_', '-')} must be 0 (none) or more, got {getattr(self, name)}")
        if self.pack_first is not None and (self.pack_first < 1 or self.output is None):
            raise ExportError(f"--pack-first {self.pack_first}: pass a count of at least 1, with --output (it packs "
                              "only the work folder's first N answers)")
        if self.passages is not None and not self.tasks:
            raise ExportError("--passages feeds the task prompts' passage tasks; pass --tasks N with it")
        if self.passages is not None and not Path(self.passages).is_file():
            raise ExportError(f"--passages {self.passages} does not exist; pass an answers file (`python -m export "
                              "data --output` or `python -m export answers`)")
        if self.backend not in BACKENDS:
            raise ExportError(f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ExportError(f"--device must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.backend == "genai" and self.batch > GENAI_MAX_BATCH:
            raise ExportError(f"--batch {self.batch}: onnxruntime-genai generates at most {GENAI_MAX_BATCH} rows at a "
                              f"time; pass --batch {GENAI_MAX_BATCH} or less, or --backend torch for larger batches")
        if self.backend != "torch" and (self.device != "cpu" or self.source != "default"):
            raise ExportError("--device and --source choose the PyTorch backend's device and model; pass "
                              "--backend torch with them (the genai backend runs the engine's own graph on the CPU)")
        if not 0 < self.temperature <= 2 or not 0 < self.top_p <= 1:
            raise ExportError(f"--temperature must be in (0, 2] and --top-p in (0, 1], got {self.temperature} "
                              f"and {self.top_p}")
        if not (Path(self.target_engine) / "manifest.json").is_file():
            raise ExportError(f"{self.target_engine} is not an engine folder (no manifest.json); export the target "
                              "first with `python -m export target`")


def _import_genai():
    try:
        import onnxruntime_genai as og
    except ImportError as exc:
        raise ExportError("the data engine runs on onnxruntime-genai; install the exporter's extras "
                          "(pip install '.[export-fused]')") from exc
    return og


class _Answers:
    """What both backends share: which prompts can be batched, the greedy call, and an answer
    cut after its first EOS. A backend sets ``pad``, ``context``, ``eos_ids`` and implements
    ``_run(rows, max_new, **search)``; ``GREEDY`` is its search options for greedy decoding."""

    GREEDY: dict = {"do_sample": False}

    def __init__(self, manifest: Manifest) -> None:
        m = manifest.model
        self.eos_ids = frozenset(int(t) for t in manifest.tokenizer.eos_ids)
        self.pad = m.vocab_size - 1  # a token the answers may hold, but a prompt may not (checked)
        self.context = min(m.max_position_embeddings, 4096)

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def usable(self, prompt: list[int], max_new: int) -> bool:
        """Whether ``prompt`` can be batched: no pad id in it, and room for ``max_new`` tokens."""
        return self.pad not in prompt and len(prompt) + max_new <= self.context

    def _run(self, rows: list[list[int]], max_new: int, **search) -> list[list[int]]:
        raise NotImplementedError

    def _cut(self, new: list[int], max_new: int) -> list[int]:
        ends = [j for j, t in enumerate(new) if t in self.eos_ids]
        return new[:ends[0] + 1] if ends else new[:max_new]

    def greedy(self, prompts: list[list[int]], max_new: int) -> list[list[int]]:
        """Each prompt's greedy answer: at most ``max_new`` tokens, ending with EOS when it ended."""
        for p in prompts:
            if not self.usable(p, max_new):
                raise ExportError(f"a prompt of {len(p)} tokens holds the pad id {self.pad} or leaves no room for "
                                  f"{max_new} new tokens in {self.context} positions")
        return self._run(prompts, max_new, **self.GREEDY)


class BatchedTarget(_Answers):
    """The engine's FP32 graph under onnxruntime-genai: greedy answers and sampled continuations
    for a batch of prompts at a time. Prompts are right-padded (the graph's attention keeps each
    row's own length; left padding changes the answers) with a pad id no prompt may contain."""

    def __init__(self, engine_dir: Path, manifest: Manifest, threads: int | None = None) -> None:
        og = _import_genai()
        self._og = og
        if manifest.io.kv_layout != "shared_buffer":
            raise ExportError(f"{engine_dir}: the data engine runs the fused graph (kv_layout shared_buffer), this "
                              f"engine has {manifest.io.kv_layout}; export the target with --graph fused")
        variant = next((v for v in manifest.variants if v.role == "target" and v.precision == "fp32"), None)
        if variant is None:
            raise ExportError(f"{engine_dir} has no fp32 target; the answers come from the FP32 target")
        super().__init__(manifest)
        m = manifest.model
        graph = engine_path(engine_dir, variant.file)
        self._dir = Path(tempfile.mkdtemp(prefix="dspark-data-"))
        for f in graph.parent.iterdir():
            if f.name.startswith(graph.name):  # model.onnx and its external weights
                os.symlink(f.resolve(), self._dir / f.name)
        table = manifest.embedding_table(variant.file)
        if table is not None:  # the embedding table the graph's external data entry names
            os.symlink(engine_path(engine_dir, table.file).resolve(), self._dir / Path(table.file).name)
        io = manifest.io
        # onnxruntime-genai runs one intra-op thread unless told otherwise: use every core.
        session = {"log_id": "dspark_export.data", "provider_options": [],
                   "intra_op_num_threads": int(threads or os.cpu_count() or 1)}
        config = {
            "model": {
                "bos_token_id": manifest.tokenizer.bos_id if manifest.tokenizer.bos_id is not None else min(self.eos_ids),
                "context_length": self.context,
                "decoder": {
                    "session_options": session, "filename": graph.name, "head_size": m.head_dim,
                    "hidden_size": m.hidden_size, "num_attention_heads": m.num_heads,
                    "num_hidden_layers": m.num_layers, "num_key_value_heads": m.num_kv_heads,
                    "inputs": {"input_ids": io.input_ids, "attention_mask": io.attention_mask,
                               "past_key_names": io.past_key.replace("{layer}", "%d"),
                               "past_value_names": io.past_value.replace("{layer}", "%d")},
                    "outputs": {"logits": io.logits, "present_key_names": io.present_key.replace("{layer}", "%d"),
                                "present_value_names": io.present_value.replace("{layer}", "%d")},
                },
                "eos_token_id": list(manifest.tokenizer.eos_ids), "pad_token_id": self.pad,
                "type": "llama", "vocab_size": m.vocab_size,
            },
            "search": {"do_sample": False, "max_length": self.context, "num_beams": 1,
                       "past_present_share_buffer": True},
        }
        (self._dir / "genai_config.json").write_text(json.dumps(config))
        try:
            self._model = og.Model(str(self._dir))
        except Exception as exc:  # onnxruntime-genai raises plain RuntimeErrors
            self.close()
            raise ExportError(f"onnxruntime-genai cannot open {graph}: {exc}") from exc

    def close(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)

    def _run(self, rows: list[list[int]], max_new: int, **search) -> list[list[int]]:
        width = max(len(r) for r in rows)
        ids = np.full((len(rows), width), self.pad, dtype=np.int32)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = r
        params = self._og.GeneratorParams(self._model)
        params.set_search_options(max_length=width + max_new, batch_size=len(rows), **search)
        gen = self._og.Generator(self._model, params)
        gen.append_tokens(ids)
        while not gen.is_done():
            gen.generate_next_token()
        return [self._cut([int(t) for t in gen.get_sequence(i)[width:]], max_new) for i in range(len(rows))]

    def sample(self, prefix: list[int], rows: int, max_new: int, temperature: float, top_p: float,
               seed: int) -> list[list[int]]:
        """``rows`` sampled continuations of one prefix (one draw of the generator's seeded RNG)."""
        return self._run([prefix] * rows, max_new, do_sample=True, temperature=temperature, top_p=top_p, top_k=0,
                         random_seed=seed)


class TorchTarget(_Answers):
    """The engine's source model in PyTorch, FP32 with TF32 off, on ``device``: the calls of
    ``BatchedTarget``. Prompts are left-padded under an attention mask, from which the model
    takes each row's positions, so a row's answer does not depend on the others (up to the order
    of sums)."""

    def __init__(self, engine_dir: Path, manifest: Manifest, source: str = "default", device: str = "cpu",
                 threads: int | None = None) -> None:
        try:
            import torch
        except ImportError as exc:
            raise ExportError("--backend torch needs PyTorch (pip install torch==2.13.0 for the CPU build; the "
                              "build of your CUDA on a GPU machine)") from exc
        from .sources import load_source, resolve_source, source_digest

        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ExportError(f"--device {device}: this PyTorch sees no CUDA GPU (torch {torch.__version__}); "
                              "use --device cpu, or a CUDA build of PyTorch on a machine with an NVIDIA GPU")
        src = resolve_source(source)
        digest = source_digest(src)
        if manifest.model.source_sha256 and digest != manifest.model.source_sha256:
            raise ExportError(f"{src.description} (sha256 {digest[:16]}…) is not the model {engine_dir} was exported "
                              f"from (sha256 {manifest.model.source_sha256[:16]}…); pass that model as --source")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        if threads:
            torch.set_num_threads(int(threads))
        super().__init__(manifest)
        self._torch = torch
        self.device = device
        model, _ = load_source(src)
        self._model = model.to(device)

    def close(self) -> None:
        self._model = None
        if self.device.startswith("cuda"):
            self._torch.cuda.empty_cache()

    GREEDY = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}  # not the model's defaults

    def _run(self, rows: list[list[int]], max_new: int, **search) -> list[list[int]]:
        torch = self._torch
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
            mask[i, width - len(r):] = 1
        with torch.inference_mode():
            seqs = self._model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                        max_new_tokens=max_new, min_new_tokens=1, pad_token_id=self.pad,
                                        eos_token_id=sorted(self.eos_ids), num_beams=1, use_cache=True,
                                        **search).cpu().numpy()
        return [self._cut([int(t) for t in seqs[i, width:]], max_new) for i in range(len(rows))]

    def sample(self, prefix: list[int], rows: int, max_new: int, temperature: float, top_p: float,
               seed: int) -> list[list[int]]:
        """``rows`` sampled continuations of one prefix, drawn from a generator seeded with ``seed``."""
        self._torch.manual_seed(seed)
        return self._run([prefix] * rows, max_new, do_sample=True, temperature=temperature, top_p=top_p, top_k=0)


def open_target(engine_dir: Path, manifest: Manifest, opts: DataOptions) -> BatchedTarget | TorchTarget:
    """The backend ``opts`` names, over ``engine_dir``'s model."""
    if opts.backend == "torch":
        return TorchTarget(engine_dir, manifest, opts.source, opts.device, opts.threads)
    return BatchedTarget(engine_dir, manifest, opts.threads)


# -- self-written user messages (Magpie) ---------------------------------------------------------

_SPACES = re.compile(r"\s+")
_WORDS = re.compile(r"[a-z0-9']+")


def _fold(text: str) -> str:
    return _SPACES.sub(" ", text.strip().lower())


def _words(text: str) -> set[str]:
    return set(_WORDS.findall(text.lower()))


class MessageFilter:
    """Which self-written user messages are kept (the module docstring states the rule); counts
    why the others were dropped."""

    def __init__(self, held_out: list[str], seen: list[str] = ()) -> None:
        self._held_out = [_words(t) for t in held_out]
        self._seen = {_fold(t) for t in seen}
        self.dropped: dict[str, int] = {}

    def _drop(self, why: str) -> bool:
        self.dropped[why] = self.dropped.get(why, 0) + 1
        return False

    def near_benchmark(self, text: str) -> bool:
        """Whether ``text`` shares more than half the words of the shorter of it and a benchmark
        prompt."""
        mine = _words(text)
        return any(mine and other and len(mine & other) > 0.5 * min(len(mine), len(other))
                   for other in self._held_out)

    def keep(self, text: str, ended: bool) -> bool:
        if not ended:
            return self._drop("unfinished")
        words = text.split()
        if not MIN_WORDS <= len(words) <= MAX_WORDS:
            return self._drop("length")
        if "<|" in text or "|>" in text:
            return self._drop("special text")
        plain = sum(c.isascii() and (c.isprintable() or c in "\n\t") for c in text)
        if plain < 0.95 * len(text):
            return self._drop("not plain text")
        if self.near_benchmark(text):
            return self._drop("near a benchmark prompt")
        key = _fold(text)
        if key in self._seen:
            return self._drop("duplicate")
        self._seen.add(key)
        return True


def user_turn_prefix(tokenizer) -> list[int]:
    """The chat template rendered up to where a user message's text begins (the system turn the
    template adds by default included), as token ids."""
    mark = "\x00dspark-user-message\x00"
    text = tokenizer.render_chat([{"role": "user", "content": mark}], add_generation_prompt=False)
    if mark not in text:
        raise ExportError("the engine's chat template does not place a user message's text; self-written "
                          "prompts need a chat template")
    return tokenizer.encode(text[:text.index(mark)])


def _agrees(record: dict, rebuilt: dict) -> bool:
    return rebuilt["kind"] == "unrecoverable" or (
        record.get("kind") == rebuilt["kind"] and bool(record.get("messages"))
        and record["messages"][-1].get("content") == rebuilt["messages"][-1]["content"])


def _reconcile(prompts_file: Path, records: list[dict], shards: list[Path], tokenizer, progress) -> list[dict]:
    """The prompt records, checked against what the shards answered: a record whose kind or user
    message differs from its shard's prompt tokens, or that is missing (a prompts file restored
    from an older copy while a run appended to it), is rebuilt from the shard (``recover_records``)
    and the file rewritten atomically; records past the answered ones are kept."""
    rebuilt = recover_records(shards, tokenizer)
    bad = [i for i, r in enumerate(rebuilt) if i >= len(records) or not _agrees(records[i], r)]
    if not bad:
        return records
    wrong = set(bad)
    fixed = [rebuilt[i] if i in wrong else r for i, r in enumerate(records[:len(rebuilt)])]
    fixed += rebuilt[len(fixed):] + records[len(rebuilt):]
    tmp = prompts_file.with_name(prompts_file.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in fixed), encoding="utf-8")
    os.replace(tmp, prompts_file)
    progress(f"[data] {prompts_file}: {len(bad)} of the {len(rebuilt)} answered prompts' records were missing or "
             "did not match their shards; rebuilt from the shards' prompt tokens (marked \"recovered\")")
    return fixed


def recover_records(shards: list[Path], tokenizer) -> list[dict]:
    """Prompt records for the prompts ``shards`` answered, rebuilt from the
    shards' prompt tokens: the kind, and the last user message cut out of the decoded prompt
    after the chat template's user-turn opening (a system message before it is not kept), so
    the duplicate filter knows a self-written message again. A shard that skipped prompts (too
    long) cannot say which of its rows is which prompt: its records keep their place with kind
    "unrecoverable" and no messages."""
    mark = "\x00dspark-user-message\x00"
    plain, _, tail = tokenizer.render_chat([{"role": "user", "content": mark}]).partition(mark)
    with_system = tokenizer.render_chat([{"role": "system", "content": "\x01"}, {"role": "user", "content": mark}])
    other = with_system[:with_system.index(mark)] if mark in with_system else plain
    opening = os.path.commonprefix([plain[::-1], other[::-1]])[::-1]  # the user turn's own opening
    out: list[dict] = []
    for path in shards:
        with np.load(path) as f:  # each member read once (an NpzFile reads it again at every access)
            asked, tokens, offsets, lens, kinds = (int(f["asked"]), f["tokens"], f["offsets"], f["prompt_lens"],
                                                   f["kinds"])
        if len(lens) != asked:
            out += [{"kind": "unrecoverable", "recovered": path.name} for _ in range(asked)]
            continue
        for row in range(asked):
            text = tokenizer.decode(tokens[offsets[row]:offsets[row] + lens[row]].tolist(), skip_special_tokens=False)
            at = text.rfind(opening) + len(opening) if opening and opening in text else 0
            end = len(text) - len(tail) if tail and text.endswith(tail) else len(text)
            out.append({"kind": KINDS[int(kinds[row])], "messages": [{"role": "user", "content": text[at:max(at, end)]}],
                        "recovered": path.name})
    return out


# -- the work folder -----------------------------------------------------------------------------

def _shard(work: Path, i: int) -> Path:
    return work / "answers" / f"shard-{i:05d}.npz"


def written(work: Path) -> list[Path]:
    out: list[Path] = []
    while _shard(work, len(out)).is_file():
        out.append(_shard(work, len(out)))
    return out


def read_prompts(path: Path) -> list[dict]:
    """The prompts file's records; a last line cut short (a kill mid-write) is dropped from the file."""
    if not path.is_file():
        return []
    raw = path.read_bytes()
    keep = raw[:raw.rfind(b"\n") + 1]
    if len(keep) != len(raw):
        log.warning("%s: dropping a last line cut short (%d bytes)", path, len(raw) - len(keep))
        with open(path, "r+b") as f:
            f.truncate(len(keep))
    try:  # lines end at "\n" only: a model-written message may hold U+2028 or U+0085 as it is
        return [json.loads(line) for line in keep.decode("utf-8").split("\n") if line]
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ExportError(f"{path} is damaged ({exc}); delete the work folder to start again") from exc


def _append(path: Path, records: list[dict]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        f.flush()
        os.fsync(f.fileno())


def engine_identity(manifest: Manifest, engine_dir: Path, opts: DataOptions, passages: list[str] | None = None) -> dict:
    variant = next(v for v in manifest.variants if v.role == "target" and v.precision == "fp32")
    return {"model": manifest.model.name, "source_sha256": manifest.model.source_sha256,
            "tokenizer_sha256": manifest.file_entry(manifest.tokenizer.file).sha256,
            "graph_sha256": manifest.file_entry(variant.file).sha256, "max_new_tokens": opts.max_new_tokens,
            "seed": opts.seed, "prompts": opts.prompts, "copy_prompts": opts.copy_prompts,
            **({"backend": "torch"} if opts.backend == "torch" else {}),  # genai folders predate the key
            **({"openers": True} if opts.openers else {}),  # (and folders without openers that key)
            **({"tasks": opts.tasks, "passages_sha256": passages_digest(passages)} if opts.tasks else {})}
    # (folders without task prompts predate those keys)


def passages_digest(passages: list[str] | None) -> str | None:
    """sha256 of the passage texts themselves (not of the file they came from: a file packed
    again holds the same answers in other bytes)."""
    if passages is None:
        return None
    import hashlib

    return hashlib.sha256("\0".join(passages).encode("utf-8")).hexdigest()


def check_work(work: Path, identity: dict) -> None:
    work.mkdir(parents=True, exist_ok=True)
    marker = work / "engine.json"
    if not marker.is_file():
        marker.write_text(json.dumps(identity, indent=1, sort_keys=True) + "\n")
        return
    try:
        before = json.loads(marker.read_text())
    except (OSError, ValueError) as exc:
        raise ExportError(f"{marker} is damaged ({exc}); delete {work} to start again") from exc
    diff = sorted(k for k in {*identity, *before} if before.get(k) != identity.get(k))
    if diff == ["graph_sha256"]:
        # The same source model, tokenizer and options in a graph written another way (a newer
        # exporter): the FP32 answers are the same model's, so the work goes on with it.
        log.warning("%s: the target's FP32 graph differs from the one its answers began with (same source "
                    "model and tokenizer: re-exported); going on with it", work)
        marker.write_text(json.dumps(identity, indent=1, sort_keys=True) + "\n")
    elif diff:
        raise ExportError(f"{work} holds answers of another engine or options ({', '.join(diff)} differ); "
                          "pass another --work folder, or the options it was made with")


def _held_out_texts() -> list[str]:
    from dspark_edge.bench import load_prompts

    return [m["content"] for r in load_prompts() for m in r["messages"] if m["role"] == "user"]


def _fixed_prompts(tokenizer, opts: DataOptions, passages: list[str] = ()) -> Iterator[dict]:
    """The templated prompts, then the copy tasks, then the task prompts (those near a
    benchmark prompt left out)."""
    from .drafter.prompts import copy_prompts, training_prompts
    from .drafter.text import package_documents

    for r in training_prompts(opts.seed)[:opts.prompts]:
        yield {"kind": "prompt", "messages": r["messages"]}
    if opts.copy_prompts:
        for r in copy_prompts(package_documents(), opts.copy_prompts, opts.seed):
            yield {"kind": "copy", "messages": r["messages"]}
    if opts.tasks:
        from .drafter.prompts import task_prompts

        near = MessageFilter(_held_out_texts())
        for r in task_prompts(opts.tasks, opts.seed, passages):
            if not near.near_benchmark(r["messages"][-1]["content"]):
                yield {"kind": "task", "messages": r["messages"]}


def _passages(path: Path, manifest: Manifest, tokenizer, count: int) -> list[str]:
    """Up to ``count`` prose paragraphs from the answers in ``path`` (in its order; copy tasks'
    answers skipped: they restate package text)."""
    from .answers import load_answers
    from .drafter.prompts import answer_passages

    answers = load_answers(Path(path), manifest)
    out: list[str] = []
    for i in range(len(answers)):
        if KINDS[int(answers.kinds[i])] == "copy":
            continue
        out += answer_passages([tokenizer.decode(answers.pair(i)[1])])
        if len(out) >= count:
            break
    return out


def run(opts: DataOptions, progress: Progress = print) -> dict:
    """Answer prompts until ``opts.answers`` are answered (resuming the work folder); pack them
    into ``opts.output`` when given. Returns the run's counts and rates."""
    from dspark_edge.tokenizer import Tokenizer

    engine = Path(opts.target_engine)
    manifest = read_manifest(engine)
    tokenizer = Tokenizer.from_engine(engine, manifest)
    passages = _passages(opts.passages, manifest, tokenizer, opts.tasks) if opts.passages else None
    check_work(opts.work, engine_identity(manifest, engine, opts, passages))
    prompts_file = opts.work / "prompts.jsonl"
    records = read_prompts(prompts_file)
    (opts.work / "answers").mkdir(exist_ok=True)
    shards = written(opts.work)
    done = sum(_asked(p) for p in shards)
    records = _reconcile(prompts_file, records, shards, tokenizer, progress)
    kept = sum(_kept(p) for p in shards)
    skipped = f" ({done - kept} too long for the context, not in the shards)" if done > kept else ""
    if done >= opts.answers:
        progress(f"[data] {engine}: {done} prompts answered in {opts.work}, {kept} answers recorded{skipped}; "
                 f"--answers {opts.answers} asks for no more")
    else:
        progress(f"[data] {engine}: {done} of {opts.answers} prompts answered in {opts.work}{skipped}"
                 + (f"; {len(records)} prompts recorded" if records else ""))
    stats = {"answered_before": done, "answer_tokens": 0, "answer_s": 0.0, "magpie_kept": 0, "magpie_drawn": 0,
             "magpie_s": 0.0}
    if done >= opts.answers:
        return _finish(opts, manifest, stats, progress)
    filt = MessageFilter(_held_out_texts(), [r["messages"][-1]["content"] for r in records if r["kind"] == "magpie"])
    prefix = user_turn_prefix(tokenizer)
    fixed = list(_fixed_prompts(tokenizer, opts, passages or []))
    fruitless = 0
    with open_target(engine, manifest, opts) as target:
        while done < opts.answers:
            end = min(done + opts.per_shard, opts.answers)
            while len(records) < end:
                if len(records) < len(fixed):
                    new = fixed[len(records):end]
                else:
                    new = _magpie_batch(target, tokenizer, prefix, filt, opts, len(records), stats)
                    fruitless = 0 if new else fruitless + 1
                    if fruitless >= MAX_FRUITLESS:
                        raise ExportError(f"{MAX_FRUITLESS} batches of self-written user messages in a row were all "
                                          f"dropped ({filt.dropped}); raise --magpie-tokens, or ask for fewer "
                                          "--answers than the templated and copy prompts give")
                _append(prompts_file, new)
                records += new
            batch = records[done:end]
            ids = [tokenizer.encode_chat(r["messages"]) for r in batch]
            ok = [target.usable(p, opts.max_new_tokens) for p in ids]
            t0 = time.perf_counter()
            answers: list[list[int] | None] = [None] * len(ids)
            todo = [j for j in range(len(ids)) if ok[j]]
            for s in range(0, len(todo), opts.batch):
                part = todo[s:s + opts.batch]
                for j, a in zip(part, target.greedy([ids[j] for j in part], opts.max_new_tokens)):
                    answers[j] = a
            dt = time.perf_counter() - t0
            tokens = sum(len(a) for a in answers if a)
            stats["answer_tokens"] += tokens
            stats["answer_s"] += dt
            _write_shard(_shard(opts.work, len(shards)), ids, answers, [r["kind"] for r in batch])
            shards.append(_shard(opts.work, len(shards)))
            done = end
            rate = stats["answer_tokens"] / max(stats["answer_s"], 1e-9)
            left = (opts.answers - done) * tokens / max(len(batch), 1) / max(rate, 1e-9)
            skipped = len(ids) - len(todo)
            progress(f"[data] {done}/{opts.answers} answered: shard {len(shards)}, {tokens} answer tokens at "
                     f"{tokens / dt:.0f} tok/s" + (f", {skipped} prompts too long or holding the pad id skipped"
                                                   if skipped else "") + f" (ETA {left / 60:.1f} min)")
    if filt.dropped:
        progress(f"[data] self-written messages: {stats['magpie_kept']} kept of {stats['magpie_drawn']} drawn; "
                 "dropped: " + ", ".join(f"{k} {v}" for k, v in sorted(filt.dropped.items())))
    stats["magpie_dropped"] = filt.dropped
    return _finish(opts, manifest, stats, progress)


def _magpie_batch(target: BatchedTarget | TorchTarget, tokenizer, prefix: list[int], filt: MessageFilter, opts: DataOptions,
                  index: int, stats: dict) -> list[dict]:
    """One batch of self-written user messages, filtered; seeded by the prompt index it starts at,
    so a resumed run draws what an uninterrupted one would have."""
    t0 = time.perf_counter()
    seed = opts.seed * 1_000_003 + index
    opener, start = None, []
    if opts.openers:
        from .drafter.prompts import MESSAGE_OPENERS

        opener = MESSAGE_OPENERS[int(np.random.default_rng(seed).integers(len(MESSAGE_OPENERS)))]
        start = tokenizer.encode(opener)
    drawn = target.sample(prefix + start, opts.batch, opts.magpie_tokens, opts.temperature, opts.top_p, seed)
    out = []
    for new in drawn:
        ended = bool(new) and new[-1] in target.eos_ids
        text = tokenizer.decode(start + (new[:-1] if ended else new)).strip()
        if filt.keep(text, ended):
            out.append({"kind": "magpie", "messages": [{"role": "user", "content": text}], "seed": seed}
                       | ({"opener": opener} if opener else {}))
    stats["magpie_drawn"] += len(drawn)
    stats["magpie_kept"] += len(out)
    stats["magpie_s"] += time.perf_counter() - t0
    return out


def _asked(shard: Path) -> int:
    """How many prompts a shard answered (prompts too long for the context are not in it)."""
    with np.load(shard) as f:
        return int(f["asked"])


def _kept(shard: Path) -> int:
    """How many answers a shard holds (what ``pack`` packs from it)."""
    with np.load(shard) as f:
        return int(f["offsets"].shape[0]) - 1


def _write_shard(path: Path, prompts: list[list[int]], answers: list[list[int] | None], kinds: list[str]) -> None:
    rows = [(p, a, KINDS.index(k)) for p, a, k in zip(prompts, answers, kinds) if a is not None]
    seqs = [p + a for p, a, _ in rows]
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, tokens=np.concatenate([np.asarray(s, dtype=np.int32) for s in seqs]),
             offsets=np.cumsum([0] + [len(s) for s in seqs]).astype(np.int64),
             prompt_lens=np.asarray([len(p) for p, _, _ in rows], dtype=np.int32),
             kinds=np.asarray([k for _, _, k in rows], dtype=np.int8),
             asked=np.asarray(len(prompts)))
    os.replace(tmp, path)


def _finish(opts: DataOptions, manifest: Manifest, stats: dict, progress: Progress) -> dict:
    if opts.output is not None:
        stats["output"] = str(pack(opts.work, manifest, opts, progress))
    return stats


def pack(work: Path, manifest: Manifest, opts: DataOptions, progress: Progress = print) -> Path:
    """Every answered shard of ``work`` as one answers file (``answers.py``'s format); with
    ``opts.pack_first``, only the first that many answers, in order: a folder that has grown
    since an answers file was made from it gives that file's answers again, at the same indices,
    which merged campaign files and their held-out draws depend on."""
    from .answers import write_answers
    from .atomic import export_command

    shards = written(work)
    if not shards:
        raise ExportError(f"{work} holds no answer shards; run `python -m export data --work {work}` first")
    parts = [np.load(p) for p in shards]
    seqs = []
    for part in parts:
        off = part["offsets"]
        seqs += [part["tokens"][off[i]:off[i + 1]] for i in range(off.shape[0] - 1)]
    n = len(seqs) if opts.pack_first is None else opts.pack_first
    if n > len(seqs):
        raise ExportError(f"--pack-first {n}: {work} holds {len(seqs)} answers (a prompt too long for the context "
                          "is answered without one); pass at most that, or answer more first (a larger --answers)")
    identity = json.loads((work / "engine.json").read_text())
    meta = {"kinds": list(KINDS), "model": manifest.model.name,
            "source_sha256": manifest.model.source_sha256, "tokenizer_sha256": identity["tokenizer_sha256"],
            "graph_sha256": identity["graph_sha256"], "max_new_tokens": identity["max_new_tokens"],
            "command": export_command(), "made_by": MADE_BY[identity.get("backend", "genai")]}
    return write_answers(Path(opts.output), seqs[:n], np.concatenate([p["prompt_lens"] for p in parts])[:n],
                         np.concatenate([p["kinds"] for p in parts])[:n], manifest.model.vocab_size, meta, progress,
                         label="[data] ")
