"""Text ↔ token ids (the `tokenizers` library) and chat-template rendering (jinja2).

Special ids come from the manifest, not from the tokenizer file: the exporter has already
fixed the traps of GGUF-converted tokenizers (a BOS prepended by the post-processor, the
wrong EOS). This module knows nothing about models.

The engine folder is untrusted: its tokenizer and template are read size- and hash-checked
(``manifest.read_engine_file``), the template is compiled at load and rendered in a sandbox
bounded in time and output size, and chat message content is tokenized as text: special
tokens come only from the template itself, so a message cannot forge a turn.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from .errors import EngineError, PromptError
from .grammar import GrammarTokens
from .manifest import Manifest, TokenizerInfo, read_engine_file

CHAT_ROLES = ("system", "user", "assistant", "tool")
MAX_TOKENIZER_BYTES = 256 << 20  # tokenizer.json of a 256k vocabulary is ~20 MB
MAX_TEMPLATE_BYTES = 1 << 20  # real chat templates are a few KB
TEMPLATE_SECONDS = 2.0  # CPU seconds; a render that takes longer is stopped (real ones take well under a millisecond)
MAX_RENDERED_CHARS = 8 << 20  # a rendered prompt (or any string the template builds) longer than this is refused


class Tokenizer:
    def __init__(self, tokenizer_file: str | Path | None, info: TokenizerInfo, chat_template: str | None,
                 *, tokenizer_json: str | None = None) -> None:
        from tokenizers import Tokenizer as _HFTokenizer

        where = tokenizer_file or "tokenizer.json"
        try:
            if tokenizer_json is None:
                tokenizer_json = Path(tokenizer_file).read_text(encoding="utf-8")
            self._tok = _HFTokenizer.from_str(tokenizer_json)
            # The same vocabulary with special-token strings read as plain text: for chat content.
            self._tok_text = _HFTokenizer.from_str(tokenizer_json)
            self._tok_text.encode_special_tokens = True
        except Exception as exc:
            raise EngineError(f"could not read tokenizer {where}: {type(exc).__name__}: {str(exc)[:200]}; "
                              "re-export the engine folder") from None
        self.info = info
        self.chat_template = chat_template
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        added = self._tok.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        # Longest first, so that a special string containing another is found whole.
        self._special_texts = tuple(sorted({t.content for t in added.values() if t.special and t.content},
                                           key=len, reverse=True))
        self._template = None if chat_template is None else _compile_template(chat_template, where)
        self._json = tokenizer_json
        self._grammar_lock = threading.Lock()
        self._grammar: tuple | None = None  # (key, GrammarTokens): the vocabulary as grammars read it

    @classmethod
    def from_engine(cls, engine_dir: str | Path, manifest: Manifest, check_hashes: bool = True) -> "Tokenizer":
        """The engine folder's tokenizer and chat template, each read once, size- (and sha256-)
        checked against the manifest, from inside the folder only."""
        engine_dir = Path(engine_dir)
        info = manifest.tokenizer
        template = None
        if info.chat_template_file:
            template = _utf8(read_engine_file(manifest, engine_dir, info.chat_template_file, MAX_TEMPLATE_BYTES,
                                              check_hashes), engine_dir / info.chat_template_file)
        data = _utf8(read_engine_file(manifest, engine_dir, info.file, MAX_TOKENIZER_BYTES, check_hashes),
                     engine_dir / info.file)
        return cls(engine_dir / info.file, info, template, tokenizer_json=data)

    def grammar_tokens(self, vocab: int, eos_ids) -> GrammarTokens:
        """This vocabulary for structured output (``grammar.GrammarTokens``), over logits of width
        ``vocab`` and ending at ``eos_ids``: made once and shared by every pipeline of this tokenizer."""
        key = (vocab, frozenset(eos_ids))
        with self._grammar_lock:
            if self._grammar is None or self._grammar[0] != key:
                self._grammar = (key, GrammarTokens(self._json, vocab, eos_ids))
            return self._grammar[1]

    def use_template(self, source: str, where: str) -> None:
        """Render chat with ``source`` instead of the engine folder's template (compiled now; a
        syntax error names ``where``)."""
        self.chat_template, self._template = source, _compile_template(source, where)

    # -- text ---------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special-token strings in it are recognised. BOS is added
        only when the model wants it (``add_bos`` in the manifest)."""
        if isinstance(text, (bytes, bytearray)):
            raise PromptError("prompt is bytes: decode it to str first, e.g. data.decode('utf-8', errors='replace')")
        if not isinstance(text, str):
            raise PromptError(f"prompt must be a string, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise PromptError(f"prompt is not valid Unicode at character {exc.start} (a lone surrogate, as left by "
                              "decoding bytes with errors='surrogateescape'); decode with errors='replace'") from exc
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if self.info.add_bos and self.info.bos_id is not None and (not ids or ids[0] != self.info.bos_id):
            ids = [self.info.bos_id] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    # -- chat ---------------------------------------------------------------------------
    def render_chat(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt text for chat ``messages`` ([{"role": ..., "content": ...}, ...]), rendered
        in a sandbox bounded by ``TEMPLATE_SECONDS`` and ``MAX_RENDERED_CHARS``."""
        if self._template is None:
            raise PromptError("this engine has no chat template: pass a plain text prompt instead of messages "
                              "(the CLI's --raw)")
        validate_messages(messages)
        return _render(self._template, messages=[dict(m) for m in messages],
                       add_generation_prompt=add_generation_prompt, bos_token="", eos_token="")

    def encode_chat(self, messages: Sequence[Mapping[str, str]], special_in_content: bool = False) -> list[int]:
        """Token ids of chat ``messages``. Message content is tokenized as text: a special-token
        string in it (``<|im_end|>``) becomes the tokens of those characters, never the control
        token, so content cannot end a turn or open one. ``special_in_content=True`` reads such
        strings as control tokens (for callers who build turns themselves and trust the content)."""
        text = self.render_chat(messages)
        if special_in_content or not self._special_texts:
            return self.encode(text)
        spans = _content_spans(text, [m["content"] for m in messages], self._special_texts)
        if not spans:
            return self.encode(text)
        ids, pos = [], 0
        for start, end in spans:
            ids += self._tok.encode(text[pos:start], add_special_tokens=False).ids if start > pos else []
            ids += self._tok_text.encode(text[start:end], add_special_tokens=False).ids
            pos = end
        ids += self._tok.encode(text[pos:], add_special_tokens=False).ids if pos < len(text) else []
        if self.info.add_bos and self.info.bos_id is not None and (not ids or ids[0] != self.info.bos_id):
            ids = [self.info.bos_id] + ids
        return ids


def _utf8(data: bytes, path: Path) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise EngineError(f"{path} is not UTF-8 text (byte {exc.start}); re-export the engine folder") from None


def _content_spans(text: str, contents: Sequence[str], specials: Sequence[str]) -> list[tuple[int, int]]:
    """The spans of ``text`` that hold a special-token string inside a message's content.

    Each content is looked for in order after the previous one (templates copy content
    verbatim; a template that trims it is matched on the trimmed text). Content that holds a
    special string but cannot be found in the rendering is refused: its special strings could
    not be told from the template's own."""
    spans, pos = [], 0
    for i, content in enumerate(contents):
        if not any(s in content for s in specials):
            continue
        for candidate in (content, content.strip()):
            at = text.find(candidate, pos) if candidate else -1
            if at >= 0:
                break
        else:
            raise PromptError(f"message {i} contains special-token text and the chat template changes content, so "
                              "it cannot be kept as plain text; remove the special-token text, or pass "
                              "special_in_content=True to read it as control tokens")
        inner, j = [], 0
        while j < len(candidate):
            hit = next((s for s in specials if candidate.startswith(s, j)), None)
            if hit is None:
                j += 1
                continue
            inner.append((at + j, at + j + len(hit)))
            j += len(hit)
        spans += _merge(inner)
        pos = at + len(candidate)
    return spans


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, end in spans:
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


class _Budget:
    """The time and size a template render may use; checked at every call, operator, range
    step, namespace write and output piece the template makes. The time is the rendering
    thread's CPU time: a hostile template burns CPU, while a busy machine, a suspended process
    (SIGSTOP, a laptop asleep) or other threads must not stop an honest render."""

    def __init__(self) -> None:
        self.deadline = time.thread_time() + TEMPLATE_SECONDS

    def check(self, value: object = None) -> None:
        if time.thread_time() > self.deadline:
            raise PromptError(f"the chat template ran longer than {TEMPLATE_SECONDS:g} s and was stopped; "
                              "the engine folder's template is broken or hostile: re-export the engine folder")
        if isinstance(value, (str, list, tuple, dict)) and len(value) > MAX_RENDERED_CHARS:
            raise PromptError(f"the chat template built a value of more than {MAX_RENDERED_CHARS} items and was "
                              "stopped; re-export the engine folder")


def _compile_template(source: str, where) -> object:
    """The template compiled in a sandbox whose calls, operators, ranges and namespaces are
    checked against the render's budget; a syntax error is the engine folder's fault."""
    import threading

    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import Namespace

    local = threading.local()

    def budget() -> _Budget:
        return local.budget

    class BoundedNamespace(Namespace):
        def __setitem__(self, name, value):
            budget().check(value)
            super().__setitem__(name, value)

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+"})

        def call(self, context, obj, *args, **kwargs):
            budget().check()
            for a in (*args, *kwargs.values()):
                budget().check(a)
            out = super().call(context, obj, *args, **kwargs)
            budget().check(out)
            return out

        def call_binop(self, context, operator, left, right):
            budget().check()
            if operator == "**" and isinstance(right, int) and abs(right) > 4096:
                raise PromptError("the chat template raised a number to a huge power and was stopped; "
                                  "re-export the engine folder")
            if operator == "*":
                seq, times = (left, right) if isinstance(right, int) else (right, left)
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int) \
                        and len(seq) * times > MAX_RENDERED_CHARS:
                    raise PromptError(f"the chat template built a value of more than {MAX_RENDERED_CHARS} "
                                      "items and was stopped; re-export the engine folder")
            out = super().call_binop(context, operator, left, right)
            budget().check(out)
            return out

    def bounded_range(*args):
        for i in range(*args):
            budget().check()
            yield i

    def raise_exception(message: str) -> None:
        raise PromptError(f"chat template rejected the messages: {message}")

    env = Bounded(trim_blocks=True, lstrip_blocks=True)
    env.globals.update(raise_exception=raise_exception, range=bounded_range, namespace=BoundedNamespace)
    try:
        template = env.from_string(source)
    except TemplateError as exc:
        raise EngineError(f"the chat template of {where} does not compile ({type(exc).__name__}: {exc}); "
                          "re-export the engine folder") from None
    template.dspark_local = local
    return template


def _render(template, **variables) -> str:
    """Render with a fresh budget; every failure of the template is a PromptError."""
    from jinja2 import TemplateError

    local = template.dspark_local
    local.budget = budget = _Budget()
    pieces, size = [], 0
    try:
        for piece in template.generate(**variables):
            size += len(piece)
            budget.check()
            if size > MAX_RENDERED_CHARS:
                raise PromptError(f"the chat template produced more than {MAX_RENDERED_CHARS} characters and "
                                  "was stopped; re-export the engine folder")
            pieces.append(piece)
    except PromptError:
        raise
    except (TemplateError, RecursionError, TypeError, ValueError, AttributeError, KeyError, IndexError,
            ZeroDivisionError, OverflowError, MemoryError) as exc:
        raise PromptError(f"the chat template failed on these messages ({type(exc).__name__}: "
                          f"{str(exc)[:200]}); check the messages, or re-export the engine folder") from None
    return "".join(pieces)


def validate_messages(messages: object) -> None:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise PromptError("chat messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or set(m) - {"role", "content"} or "role" not in m or "content" not in m:
            raise PromptError(f"message {i} must be a dict with exactly 'role' and 'content', got {m!r}")
        if m["role"] not in CHAT_ROLES:
            raise PromptError(f"message {i} has role {m['role']!r}; allowed roles are {list(CHAT_ROLES)}")
        if not isinstance(m["content"], str):
            raise PromptError(f"message {i} content must be a string, got {type(m['content']).__name__}")


class IncrementalDecoder:
    """Turns a growing list of token ids into text pieces, holding back incomplete UTF-8.

    Decodes a short window of recent ids and emits what the newest ids added once it no
    longer ends in a replacement character, so byte-level tokens that split a character are
    emitted together.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # ids before this are already emitted

    def push(self, ids: Sequence[int]) -> str:
        self._ids.extend(ids)
        before = self._tok.decode(self._ids[self._prefix:self._read])
        after = self._tok.decode(self._ids[self._prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return after[len(before):]
        return ""

    def flush(self) -> str:
        """What is still held back (possibly ending in a replacement character)."""
        before = self._tok.decode(self._ids[self._prefix:self._read])
        after = self._tok.decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return after[len(before):]
