"""The public runtime: ``load(engine_dir)`` → ``Pipeline`` → ``generate`` / ``stream``.

Plain autoregressive decoding over the target's width-1 variant. Each generation starts
from an empty KV cache, so a failed or cancelled generation leaves the pipeline usable.
One generation at a time per pipeline: a second concurrent call is refused with a clear
error (create one pipeline per thread instead).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from .backends import BackendOptions
from .config import GenerationConfig, GenerationResult, GenerationStats
from .errors import ConfigError, DSparkError, GenerationError, PromptError
from .manifest import Manifest, read_manifest, verify_files
from .sampling import choose
from .target import TargetModel
from .tokenizer import IncrementalDecoder, Tokenizer

log = logging.getLogger(__name__)

Prompt = str | Sequence[Mapping[str, str]]


def load(engine_dir: str | Path, precision: str | None = None, *, backend: str = "onnxruntime",
         options: BackendOptions | None = None, verify_hashes: bool = True) -> "Pipeline":
    """Open an engine folder. ``precision`` defaults to the most precise one exported.

    ``verify_hashes`` checks the sha256 of the files this precision uses (sizes are always
    checked).
    """
    engine_dir = Path(engine_dir)
    manifest = read_manifest(engine_dir)
    precision = precision or (manifest.precisions("target") or [None])[0]
    used = sorted({v.file for v in manifest.variants_for("target", precision)} | {manifest.tokenizer.file})
    data_files = [f.path for f in manifest.files if any(f.path.startswith(u + ".") for u in used)]
    verify_files(manifest, engine_dir, used + data_files, check_hashes=verify_hashes)
    target = TargetModel(manifest, engine_dir, precision, backend, options)
    tokenizer = Tokenizer.from_engine(engine_dir, manifest)
    return Pipeline(manifest, engine_dir, target, tokenizer)


class Pipeline:
    def __init__(self, manifest: Manifest, engine_dir: Path, target: TargetModel, tokenizer: Tokenizer) -> None:
        self.manifest = manifest
        self.engine_dir = engine_dir
        self.target = target
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(manifest.tokenizer.eos_ids)
        self._cache = target.new_cache()
        self._lock = threading.Lock()
        if 1 not in target.widths:
            raise ConfigError(f"plain decoding needs a width-1 target variant; this engine lists {target.widths}")

    # -- prompts ----------------------------------------------------------------------------
    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """Token ids of a text prompt (used as is) or of chat messages (through the chat template)."""
        if isinstance(prompt, str):
            if not prompt.strip():
                raise PromptError("prompt is empty or whitespace only: give some text or chat messages")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = self.tokenizer.encode_chat(prompt)
        if not ids:
            raise PromptError("prompt encodes to no tokens: give some text or chat messages")
        return ids

    def _fit_context(self, ids: list[int], config: GenerationConfig) -> tuple[list[int], int]:
        capacity = self.target.capacity
        if len(ids) < capacity:
            return ids, 0
        if config.context_policy == "error":
            raise PromptError(f"prompt has {len(ids)} tokens but the context holds {capacity}: shorten it, "
                              "load with a larger max_context, or use context_policy='truncate'")
        reserve = max(1, min(config.max_new_tokens, capacity // 4))
        keep = capacity - reserve
        return ids[-keep:], len(ids) - keep

    # -- generation -------------------------------------------------------------------------
    def generate(self, prompt: Prompt, config: GenerationConfig | None = None, **overrides) -> GenerationResult:
        """Decode a whole answer. ``overrides`` replace fields of ``config``."""
        stream = self.stream(prompt, config, **overrides)
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def stream(self, prompt: Prompt, config: GenerationConfig | None = None, **overrides) -> "TextStream":
        """An iterator of text pieces as they are decided; ``.result`` is set when it ends."""
        config = config or GenerationConfig()
        if overrides:
            try:
                config = replace(config, **overrides)
            except TypeError as exc:
                raise ConfigError(f"unknown generation option: {exc}") from exc
        ids = self.encode_prompt(prompt)
        ids, truncated = self._fit_context(ids, config)
        return TextStream(self, ids, truncated, config)


class TextStream:
    """Iterates text pieces of one generation; ``cancel()`` stops it after the current step."""

    def __init__(self, pipeline: Pipeline, prompt_ids: list[int], truncated: int, config: GenerationConfig) -> None:
        self._pipeline = pipeline
        self._prompt_ids = prompt_ids
        self._truncated = truncated
        self.config = config
        self.result: GenerationResult | None = None
        self.token_ids: list[int] = []
        self._cancel = threading.Event()
        self._iter = self._run()

    def __iter__(self) -> Iterator[str]:
        return self._iter

    def __next__(self) -> str:
        return next(self._iter)

    def cancel(self) -> None:
        self._cancel.set()

    def _run(self) -> Iterator[str]:
        p = self._pipeline
        if not p._lock.acquire(blocking=False):
            raise DSparkError("this pipeline is already generating in another thread or stream: "
                              "finish that one first, or load one pipeline per thread")
        try:
            yield from self._decode(p)
        finally:
            p._lock.release()

    def _decode(self, p: Pipeline) -> Iterator[str]:
        cfg = self.config
        rng = np.random.default_rng(cfg.seed)
        eos = frozenset() if cfg.ignore_eos else p.eos_ids | set(cfg.stop_token_ids)
        detok = IncrementalDecoder(p.tokenizer)
        cache = p._cache
        cache.reset()
        text, emitted = "", 0
        hold = max((len(s) for s in cfg.stop), default=1) - 1  # chars that may start a stop string
        stop_reason, error = "max_new_tokens", None
        widths: dict[str, int] = {}
        t0 = time.perf_counter()
        prefill_s = 0.0
        try:
            if cfg.max_new_tokens > 0:
                out = p.target.prefill(cache, np.asarray(self._prompt_ids, dtype=np.int64))
                tok = choose(out.logits[-1], cfg.temperature, cfg.top_k, cfg.top_p, rng)
                prefill_s = time.perf_counter() - t0
                while True:
                    self.token_ids.append(tok)
                    if tok in eos:
                        stop_reason = "eos"
                        break
                    text += detok.push([tok])
                    cut = _find_stop(text, cfg.stop, max(0, emitted - hold))
                    if cut is not None:
                        text, stop_reason = text[:cut], "stop_string"
                        break
                    if len(text) - hold > emitted:
                        piece, emitted = text[emitted:len(text) - hold], len(text) - hold
                        yield piece
                    if len(self.token_ids) >= cfg.max_new_tokens:
                        break
                    if self._cancel.is_set():
                        stop_reason = "cancelled"
                        break
                    if cache.free < 1:
                        stop_reason = "context_full"
                        break
                    out = p.target.step(cache, np.array([tok], dtype=np.int64))
                    cache.commit(1)
                    widths["1"] = widths.get("1", 0) + 1
                    tok = choose(out.logits[-1], cfg.temperature, cfg.top_k, cfg.top_p, rng)
                if stop_reason not in ("stop_string", "eos"):
                    text += detok.flush()
                    cut = _find_stop(text, cfg.stop, max(0, emitted - hold))
                    if cut is not None:
                        text, stop_reason = text[:cut], "stop_string"
        except DSparkError as exc:
            stop_reason, error = "error", str(exc)
            log.error("generation failed after %d tokens: %s", len(self.token_ids), exc)
        except Exception as exc:  # a backend or numpy failure: report it with the partial output
            stop_reason, error = "error", f"{type(exc).__name__}: {exc}"
            log.exception("generation failed after %d tokens", len(self.token_ids))
        finally:
            cache.reset()
        total = time.perf_counter() - t0
        stats = GenerationStats(prompt_tokens=len(self._prompt_ids), new_tokens=len(self.token_ids),
                                prompt_truncated=self._truncated, prefill_s=prefill_s,
                                decode_s=max(0.0, total - prefill_s), rounds=sum(widths.values()), widths=widths)
        self.result = GenerationResult(text=text, token_ids=tuple(self.token_ids), stop_reason=stop_reason,
                                       stats=stats, error=error)
        if error is not None:
            raise GenerationError(f"generation failed: {error}", partial=self.result)
        if len(text) > emitted:
            yield text[emitted:]


def _find_stop(text: str, stops: tuple[str, ...], start: int) -> int | None:
    """Index where the earliest stop string begins in ``text[start:]``, or None."""
    found = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(found) if found else None
