"""Teacher-forced training text for a DSpark drafter, from what the installed packages carry.

The target's own answers (``data.py``) are the best data but cost a generation each (about
50 tokens/s on a 2-core CPU). A teacher-forced pass over existing text costs one prefill (far
cheaper per token) and still teaches what the drafter must learn: the target's next-token
distribution given the target's own hidden states. Sources, all on any machine that ran the
installer, read in a fixed order:

- ``prose``: the long descriptions (README text with code examples) in the ``METADATA`` of every
  installed distribution of the interpreter's site-packages, this project's own excluded;
- ``code``: the Python standard library's top-level modules (``sysconfig`` ``stdlib``).

Each document is cut into windows of ``window`` tokens. A window becomes one training sequence:
a short chat prompt naming the document, then the window as the assistant's answer, so the
features are those of an answer turn, as at run time. Labels are the target's own top-K at
every position (never the text's next token), so the drafter still learns the target.
Shards (``text-00000.npz`` …) have the layout of the answer shards and are renamed into place
when complete: an interrupted run resumes at the first missing shard.
"""

from __future__ import annotations

import email.parser
import hashlib
import itertools
import sysconfig
from dataclasses import dataclass
from pathlib import Path

SKIP_DISTRIBUTIONS = ("dspark_edge", "dspark-edge")
MIN_CHARS = 2000
WINDOWS_DIGEST = "windows.sha256"


@dataclass(frozen=True)
class Document:
    name: str  # "prose:<distribution>" or "code:<module>"
    text: str


def site_packages() -> list[Path]:
    paths = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    return sorted(Path(p) for p in paths if Path(p).is_dir())


def package_documents(site_dirs: list[Path] | None = None, stdlib: Path | None = None) -> list[Document]:
    """Every usable document, prose and code interleaved (so any prefix of the list mixes
    both), in an order that depends only on the names."""
    prose: list[Document] = []
    for site in site_dirs if site_dirs is not None else site_packages():
        for meta in sorted(site.glob("*.dist-info/METADATA")):
            dist = meta.parent.name.split("-")[0]
            if dist.lower() in SKIP_DISTRIBUTIONS:
                continue
            msg = email.parser.Parser().parsestr(meta.read_text(encoding="utf-8", errors="replace"))
            body = msg.get_payload()
            if isinstance(body, str) and len(body) >= MIN_CHARS:
                prose.append(Document(f"prose:{dist}", body))
    code: list[Document] = []
    lib = stdlib if stdlib is not None else Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(lib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if len(text) >= MIN_CHARS:
            code.append(Document(f"code:{path.stem}", text))
    return [d for pair in itertools.zip_longest(prose, code) for d in pair if d is not None]


def prompt_for(doc: Document) -> list[dict]:
    kind, name = doc.name.split(":", 1)
    if kind == "code":
        return [{"role": "user", "content": f"Show me the source code of Python's {name} module."}]
    return [{"role": "user", "content": f"Show me the documentation of the {name} Python package."}]


def text_sequences(tokenizer, docs: list[Document], window: int, max_tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids) windows, taking documents in order until ``max_tokens`` answer
    tokens; each document gives at most 8 windows so that no single one dominates."""
    out, total = [], 0
    for doc in docs:
        ids = tokenizer.encode(doc.text)
        prompt = tokenizer.encode_chat(prompt_for(doc))
        for start in range(0, min(len(ids), 8 * window) - window // 2, window):
            piece = ids[start:start + window]
            out.append((prompt, piece))
            total += len(piece)
            if total >= max_tokens:
                return out
    return out


def fingerprint(docs: list[Document]) -> str:
    """sha256 prefix over the documents' names and texts: which text a drafter saw."""
    h = hashlib.sha256()
    for d in docs:
        h.update(d.name.encode() + b"\0" + d.text.encode("utf-8", errors="replace") + b"\0")
    return h.hexdigest()[:16]


def text_shard_path(folder: Path, index: int) -> Path:
    return folder / f"text-{index:05d}.npz"


def build_text_shards(decoder, seqs: list[tuple[list[int], list[int]]], folder: Path, per_shard: int = 128,
                      top_k: int = 16, progress=None, donors=None) -> list[Path]:
    """Teacher-forced features for every window (``data.write_shard``), written as shards;
    returns all shard paths in order. The folder records a digest of the windows: shards made
    from other windows (other installed packages, another ``--text-tokens``) are refused, never
    mixed in."""
    from .data import check_digest, fill_shards, write_shard

    h = hashlib.sha256(f"{per_shard} {top_k}".encode())
    for prompt, answer in seqs:
        h.update(repr((prompt, answer)).encode())
    check_digest(folder, WINDOWS_DIGEST, h.hexdigest(),
                 f"the installed packages or --text-tokens changed since; delete {folder} to rebuild them, "
                 "or pass --text-tokens 0")
    paths = [text_shard_path(folder, i) for i in range((len(seqs) + per_shard - 1) // per_shard)]

    def make(i: int) -> str:
        part = seqs[i * per_shard:(i + 1) * per_shard]
        what = f"{sum(len(a) for _, a in part)} tokens"
        if donors is not None and donors.take(part, paths[i]):
            return what + ", taken from an earlier work folder"
        write_shard(paths[i], decoder, part, top_k)
        return what

    fill_shards(paths, make, "text", progress)
    return paths
