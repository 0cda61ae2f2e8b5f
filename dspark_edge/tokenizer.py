"""Text ↔ token ids (the `tokenizers` library) and chat-template rendering (jinja2).

Special ids come from the manifest, not from the tokenizer file: the exporter has already
fixed the traps of GGUF-converted tokenizers (a BOS prepended by the post-processor, the
wrong EOS). This module knows nothing about models.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from .errors import EngineError, PromptError
from .manifest import Manifest, TokenizerInfo

CHAT_ROLES = ("system", "user", "assistant", "tool")


class Tokenizer:
    def __init__(self, tokenizer_file: str | Path, info: TokenizerInfo, chat_template: str | None) -> None:
        from tokenizers import Tokenizer as _HFTokenizer

        try:
            self._tok = _HFTokenizer.from_file(str(tokenizer_file))
        except Exception as exc:
            raise EngineError(f"could not read tokenizer {tokenizer_file}: {exc}; re-export the engine folder") from exc
        self.info = info
        self.chat_template = chat_template
        self._template = None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.special_ids = frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    @classmethod
    def from_engine(cls, engine_dir: str | Path, manifest: Manifest) -> "Tokenizer":
        engine_dir = Path(engine_dir)
        info = manifest.tokenizer
        template = None
        if info.chat_template_file:
            template = (engine_dir / info.chat_template_file).read_text(encoding="utf-8")
        return cls(engine_dir / info.file, info, template)

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
        """The prompt text for chat ``messages`` ([{"role": ..., "content": ...}, ...])."""
        if self.chat_template is None:
            raise PromptError("this engine has no chat template: pass a plain text prompt instead of messages")
        validate_messages(messages)
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

            def raise_exception(message: str) -> None:
                raise PromptError(f"chat template rejected the messages: {message}")

            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(self.chat_template)
        return self._template.render(messages=[dict(m) for m in messages],
                                     add_generation_prompt=add_generation_prompt,
                                     bos_token="", eos_token="")

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        return self.encode(self.render_chat(messages))


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
