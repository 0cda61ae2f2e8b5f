"""Structured output: a grammar that every answer token must follow (JSON schema, regex, Lark, GBNF).

``Grammar`` says what the answer must be; ``GenerationConfig.grammar`` asks for it. Each
generation walks the grammar with llguidance's matcher (``Constraint``): at every position
the target's logits of the tokens the grammar does not allow there become -inf, before
greedy choice, sampling or verification. A round's drafts are walked through the grammar
first: the drafts up to the first one it refuses are kept (a refused draft could never be
accepted: its masked probability is 0), and each row of the target pass is masked with the
grammar's state after the drafts before it. So a speculative answer is the answer plain
decoding gives under the same grammar: greedy output equal, sampling from the same masked
distribution. The grammar's end is the model's end-of-turn token: when the grammar is
complete, it is the only token allowed.

llguidance (the library onnxruntime-genai and vLLM use for this) is imported only when a
grammar is used: ``pip install 'dspark-edge[structured]'``.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Literal

import numpy as np

from .errors import ConfigError, DSparkError

INSTALL = "pip install 'dspark-edge[structured]' (llguidance)"
MAX_GRAMMAR_CHARS = 1 << 20  # a schema or grammar text longer than this is refused
JSON_WHITESPACE = r"[ \t]?(\n[ \t]{0,20})?"  # between JSON tokens, with Grammar.whitespace (as llama.cpp bounds it)


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise ConfigError(f"structured output needs llguidance, which is not installed: {INSTALL}") from None
    return llguidance


@dataclass(frozen=True)
class Grammar:
    """What an answer must match. Build it with ``Grammar.json``, ``Grammar.regex``,
    ``Grammar.lark`` or ``Grammar.gbnf``; each checks its text at once (a ``ConfigError``
    names the problem).

    ``kind`` "json": ``text`` is a JSON schema (``{"type": "object"}`` for any JSON object);
    "regex": a regular expression the whole answer matches; "lark": a grammar in llguidance's
    Lark dialect (``start: ...``); "gbnf": a grammar in llama.cpp's GBNF (``root ::= ...``).
    ``whitespace`` (json only): True (default) allows what pretty-printing needs between JSON
    tokens and no more (``JSON_WHITESPACE``: a space, then at most one newline and 20 spaces or
    tabs), so a model cannot fill the answer with blank lines until the token limit, as JSON's
    own unbounded whitespace lets small models do; False allows none (compact JSON)."""

    kind: Literal["json", "regex", "lark", "gbnf"]
    text: str
    whitespace: bool = True

    def __post_init__(self) -> None:
        if self.kind not in ("json", "regex", "lark", "gbnf"):
            raise ConfigError(f"grammar kind must be json, regex, lark or gbnf, got {self.kind!r}")
        if not isinstance(self.text, str) or not self.text.strip():
            raise ConfigError(f"a {self.kind} grammar needs its text, got {self.text!r}")
        if len(self.text) > MAX_GRAMMAR_CHARS:
            raise ConfigError(f"the {self.kind} grammar is {len(self.text)} characters; at most {MAX_GRAMMAR_CHARS}")
        if not isinstance(self.whitespace, bool):
            raise ConfigError(f"grammar whitespace must be true or false, got {self.whitespace!r}")
        object.__setattr__(self, "_llg", self._compile())  # (not a field: kept out of eq and repr)
        error = _llguidance().LLMatcher.validate_grammar(self._llg)
        if error:
            raise ConfigError(f"invalid {self.kind} grammar: {error.strip()[:600]}")

    @classmethod
    def json(cls, schema: dict | str | None = None, whitespace: bool = True) -> "Grammar":
        """Any JSON object (``schema`` None), or JSON that ``schema`` (a dict or its JSON text) accepts."""
        if schema is None:
            schema = {"type": "object"}
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"the JSON schema is not JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise ConfigError(f"a JSON schema must be a JSON object, got {type(schema).__name__}")
        return cls("json", json.dumps(schema), whitespace)  # key order kept: it is the properties' order

    @classmethod
    def regex(cls, pattern: str) -> "Grammar":
        """Answers that ``pattern`` matches whole."""
        return cls("regex", pattern)

    @classmethod
    def lark(cls, text: str) -> "Grammar":
        """A grammar in llguidance's Lark dialect."""
        return cls("lark", text)

    @classmethod
    def gbnf(cls, text: str) -> "Grammar":
        """A grammar in llama.cpp's GBNF."""
        return cls("gbnf", text)

    def compiled(self) -> str:
        """The grammar as llguidance takes it (made once, when the grammar was checked)."""
        return self._llg

    def _compile(self) -> str:
        llg = _llguidance()
        M = llg.LLMatcher
        try:
            if self.kind == "json":
                options = ({"whitespace_pattern": JSON_WHITESPACE} if self.whitespace
                           else {"whitespace_flexible": False})
                return M.grammar_from_json_schema(self.text, overrides=options)
            if self.kind == "regex":
                return M.grammar_from_regex(self.text)
            if self.kind == "gbnf":
                return M.grammar_from_lark(llg.gbnf_to_lark.gbnf_to_lark(self.text))
            return M.grammar_from_lark(self.text)
        except Exception as exc:  # llguidance raises ValueError and friends on malformed input
            raise ConfigError(f"invalid {self.kind} grammar: {type(exc).__name__}: {str(exc)[:600]}") from None


class GrammarTokens:
    """The target's vocabulary as llguidance reads it, built once per pipeline on first use
    (about half a second): its token strings, the logits' width and the end-of-turn ids, which
    the grammar allows where it is complete."""

    def __init__(self, tokenizer_json: str, vocab: int, eos_ids) -> None:
        self._args = (tokenizer_json, vocab, sorted(int(t) for t in eos_ids))
        self.eos = frozenset(self._args[2])
        self._lock = threading.Lock()
        self._tok = None

    def get(self):
        with self._lock:
            if self._tok is None:
                text, vocab, eos = self._args
                if not eos:
                    raise ConfigError("this engine names no end-of-turn token, which a grammar needs to end the answer")
                try:
                    self._tok = _llguidance().LLTokenizer(text, n_vocab=vocab, eos_token=eos)
                except ConfigError:
                    raise
                except Exception as exc:
                    raise ConfigError(f"llguidance cannot read this engine's tokenizer for structured output: "
                                      f"{type(exc).__name__}: {str(exc)[:300]}") from None
            return self._tok


class Constraint:
    """One generation's walk through its grammar: the tokens taken so far and the masks of
    the positions ahead. Not thread-safe (one generation, one thread)."""

    def __init__(self, grammar: Grammar, tokens: GrammarTokens, vocab: int) -> None:
        llg = _llguidance()
        tok = tokens.get()
        self._matcher = llg.LLMatcher(tok, grammar.compiled(), log_level=0)
        if self._matcher.is_error():
            raise ConfigError(f"invalid {grammar.kind} grammar: {self._matcher.get_error()[:600]}")
        self.vocab = vocab
        self._eos = tokens.eos
        self._bits = np.zeros((vocab + 31) // 32, dtype=np.int32)  # llguidance's mask: a bit a token
        # Masks after draft prefixes from the current position (``allowed_after``), for the
        # round's ``masks`` to reuse; cleared when the position moves (``take``).
        self._ahead: dict[tuple[int, ...], np.ndarray | None] = {}

    def _mask(self) -> np.ndarray:
        """The tokens allowed at the matcher's current position, as a bool row over the vocabulary."""
        bits = self._bits
        self._matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        if self._matcher.is_error():
            raise self._failed()
        return np.unpackbits(bits.view(np.uint8), bitorder="little")[:self.vocab].astype(bool)

    def _failed(self, what: str = "") -> DSparkError:
        return DSparkError(f"structured output failed{what}: {self._matcher.get_error()[:300]}")

    def allowed_after(self, drafts) -> np.ndarray | None:
        """The tokens the grammar allows after ``drafts`` from the current position (a bool row
        over the vocabulary, not to be written), or None where no token can follow them (one is
        refused or ends the answer). The matcher is left where it was. For a drafter drawing its
        drafts under the grammar (``DraftRequest.allowed``); ``masks`` reuses what it computed."""
        return self._row_after(tuple(int(d) for d in drafts))

    def _row_after(self, key: tuple[int, ...]) -> np.ndarray | None:
        if key not in self._ahead:
            self._ahead[key] = self._mask_after(key)
        return self._ahead[key]

    def _mask_after(self, key: tuple[int, ...]) -> np.ndarray | None:
        if not key:
            return self._mask()
        before = self._row_after(key[:-1])  # (cached: a drafter asks prefix by prefix)
        if before is None or key[-1] in self._eos or not before[key[-1]]:
            return None  # checked first: the matcher is never handed a token the grammar refuses
        taken = 0
        try:
            for d in key:
                self._consume(d)
                taken += 1
            return self._mask()
        finally:
            if taken and not self._matcher.rollback(taken):
                raise self._failed()

    def masks(self, drafts, forced: int = 0) -> tuple[int, list[int], np.ndarray]:
        """(n, more, masks): how many leading ``drafts`` the grammar allows in a row from here;
        when it allows them all, up to ``forced`` tokens the grammar forces after them (``more``:
        llguidance's fast-forward tokens, the text that is the only way on, tokenized); and the
        allowed tokens of pass rows 0..n + len(more) (row i after the i tokens before it). An
        end-of-turn draft is the last one kept (nothing after it is read: its row repeats the one
        before). The matcher is left where it was."""
        def row(prefix: tuple[int, ...]) -> np.ndarray:  # a drafter's row of it when there is one
            known = self._ahead.get(prefix)
            return known if known is not None else self._mask()

        rows = [row(())]
        taken, ended, prefix = 0, False, ()
        for d in drafts:
            d = int(d)
            if not rows[-1][d]:
                break
            if d in self._eos:
                rows.append(rows[-1])
                ended = True
                break
            self._consume(d)
            taken += 1
            prefix += (d,)
            rows.append(row(prefix))
        n, more = len(rows) - 1, []
        if forced > 0 and n == len(drafts) and not ended:
            for t in self._matcher.compute_ff_tokens()[:forced]:
                if not rows[-1][t] or t in self._eos:
                    break
                self._consume(t)
                taken += 1
                more.append(int(t))
                rows.append(self._mask())
        if taken and not self._matcher.rollback(taken):
            raise self._failed()
        return n, more, np.stack(rows)

    def _consume(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise self._failed(f": token {token} does not follow the grammar")

    @staticmethod
    def apply(logits: np.ndarray, masks: np.ndarray) -> np.ndarray:
        """``logits`` rows [n, V] with every token their mask row refuses at -inf (a new array);
        ids past the mask rows' end are refused too (a draft model's logits may be wider than
        the target's vocabulary)."""
        n, width = logits.shape
        keep = masks[:n, :width]
        if keep.shape[1] < width:
            keep = np.pad(keep, ((0, 0), (0, width - keep.shape[1])))
        return np.where(keep, logits, np.float32(-np.inf)).astype(np.float32, copy=False)

    def take(self, tokens) -> None:
        """Advance past ``tokens``, chosen under this grammar's masks (up to an end-of-turn
        token: the answer ends there)."""
        self._ahead.clear()
        for t in tokens:
            if int(t) in self._eos:
                return
            self._consume(int(t))

    @property
    def complete(self) -> bool:
        """Whether the grammar allows the answer to end here."""
        return self._matcher.is_accepting()
