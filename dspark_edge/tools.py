"""Tool calls for the server's chat API (OpenAI's ``tools`` / ``tool_choice``), by structured output.

The model is told the tools in a system message, in one generic form whatever its chat template,
and its answer is constrained (``grammar.Grammar``) to one JSON object: ``{"tool_calls": [{"name":
…, "arguments": {…}}]}``, each call's arguments following that tool's parameter schema, or with
``tool_choice`` "auto" ``{"response": "…"}`` instead, a plain answer (compact JSON: no whitespace
between its tokens). ``reply`` turns that JSON into OpenAI's message (``tool_calls`` with ids
and the arguments as JSON text) or into the answer's text; ``AnswerStream`` reads it as it is
decoded, for a stream that sends each part as soon as it is known. Earlier turns' calls and the tools' results (an assistant
message with ``tool_calls``, a ``tool`` message) go back to the model in the same JSON form.

Every request field is checked here; a bad one is a ``ValueError`` whose message names the field
and the fix (the server answers it with a 400).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from .errors import ConfigError
from .grammar import Grammar

MAX_TOOLS = 64


class ToolError(ValueError):
    """A request's tools, tool choice or tool messages are malformed (``param`` names the field)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tools:
    """The tools one request may call, and how: ``grammar`` constrains the answer, ``system``
    tells the model."""

    names: tuple[str, ...]
    grammar: Grammar
    system: str
    may_answer: bool  # tool_choice "auto": a plain answer is allowed instead of calls


def parse_tools(body: dict) -> Tools | None:
    """The ``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat request; None when
    no tool may be called (no tools, or ``tool_choice`` "none")."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ToolError("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise ToolError("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ToolError(f"'tools' must be a list of at most {MAX_TOOLS} {{\"type\": \"function\", \"function\": "
                        "{\"name\": ..., \"parameters\": {...}}}} objects", "tools")
    specs: dict[str, dict] = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name or len(name) > 64 \
                or not all(c.isalnum() or c in "_-" for c in name):
            raise ToolError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": NAME, "
                            "...}}} with NAME of letters, digits, '_' and '-' (at most 64)", "tools")
        if name in specs:
            raise ToolError(f"tools name the function {name!r} twice", "tools")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema (an object)", "tools")
        strict = fn.get("strict", False)
        if not isinstance(strict, bool):
            raise ToolError(f"tools[{i}].function.strict must be true or false", "tools")
        if strict and params.get("type") == "object" and "additionalProperties" not in params:
            params = {**params, "additionalProperties": False}  # OpenAI's strict: no key the schema does not name
        description = fn.get("description", "")
        if not isinstance(description, str):
            raise ToolError(f"tools[{i}].function.description must be a string", "tools")
        specs[name] = {"name": name} | ({"description": description} if description else {}) \
            | {"parameters": params}
    if choice is None or choice == "auto":
        called, may_answer = list(specs), True
    elif choice == "none":
        return None
    elif choice == "required":
        called, may_answer = list(specs), False
    elif isinstance(choice, dict) and choice.get("type") == "function" \
            and isinstance(choice.get("function"), dict) and choice["function"].get("name") in specs:
        called, may_answer = [choice["function"]["name"]], False
    else:
        raise ToolError("'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                        "\"function\": {\"name\": NAME}} naming one of the tools", "tool_choice")
    calls = {"type": "array", "minItems": 1,
             "items": {"anyOf": [{"type": "object", "properties": {"name": {"const": n},
                                                                   "arguments": specs[n]["parameters"]},
                                  "required": ["name", "arguments"], "additionalProperties": False}
                                 for n in called]}}
    if not parallel:
        calls["maxItems"] = 1
    schema: dict = {"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"],
                    "additionalProperties": False}
    if may_answer:
        schema = {"anyOf": [schema, {"type": "object", "properties": {"response": {"type": "string"}},
                                     "required": ["response"], "additionalProperties": False}]}
    try:
        grammar = Grammar.json(schema, whitespace=False)  # compact: no tokens spent on layout
    except ConfigError as exc:
        raise ToolError(f"the tools' parameter schemas do not compile: {exc}", "tools") from None
    listed = json.dumps([specs[n] for n in called], ensure_ascii=False, separators=(",", ":"))
    system = (f"You can call these tools:\n{listed}\n"
              'To call tools, reply with compact JSON only: {"tool_calls":[{"name":TOOL,"arguments":{...}}]}'
              + ('. To answer without a tool, reply {"response":YOUR ANSWER}.' if may_answer else "."))
    return Tools(tuple(called), grammar, system, may_answer)


def with_tools(messages: list[dict], tools: Tools | None) -> list[dict]:
    """``messages`` with the tools told in the system message (the first one's content extended,
    or a system message put first)."""
    if tools is None:
        return messages
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + tools.system}, *messages[1:]]
    return [{"role": "system", "content": tools.system}, *messages]


def history_message(i: int, m: dict) -> dict | None:
    """An assistant message with ``tool_calls`` or a ``tool`` message as the model sees it (the
    JSON it would have written, the tool's result), or None for another message."""
    if m.get("role") == "tool":
        content = m.get("content")
        if not isinstance(content, str) or not isinstance(m.get("tool_call_id", ""), str):
            raise ToolError(f"messages[{i}] (role tool) needs 'content', a string, and 'tool_call_id'", "messages")
        return {"role": "tool", "content": json.dumps({"tool_call_id": m.get("tool_call_id", ""),
                                                       "result": content}, ensure_ascii=False)}
    calls = m.get("tool_calls")
    if m.get("role") != "assistant" or calls is None:
        return None
    if not isinstance(calls, list) or not calls:
        raise ToolError(f"messages[{i}].tool_calls must be a non-empty list", "messages")
    out = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise ToolError(f"messages[{i}].tool_calls entries must be {{\"type\": \"function\", \"function\": "
                            "{\"name\": ..., \"arguments\": \"<JSON text>\"}}}", "messages")
        try:
            arguments = json.loads(fn["arguments"])
        except json.JSONDecodeError:
            raise ToolError(f"messages[{i}].tool_calls: the arguments of {fn['name']!r} are not JSON text",
                            "messages") from None
        out.append({"name": fn["name"], "arguments": arguments})
    return {"role": "assistant", "content": json.dumps({"tool_calls": out}, ensure_ascii=False)}


def reply(text: str) -> tuple[str | None, list[dict] | None]:
    """(content, tool_calls) of an answer under a tools grammar: the calls in OpenAI's form
    (fresh ids, each call's arguments the JSON text the model wrote), or the plain answer's text.
    An answer cut short gives what it holds so far, as a stream would have given it
    (``AnswerStream``): the calls named so far with their arguments as far as written, or the
    plain answer's text so far; one cut before either is returned as its raw text."""
    stream = AnswerStream()
    stream.feed(text)
    if stream.called:
        return None, [{"id": call_id(), "type": "function",
                       "function": {"name": c["name"], "arguments": c["arguments"]}}
                      for c in stream.calls if c["name"] is not None]
    return (stream.content if stream.unread is None else stream.unread), None


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


_SPACE = " \t\n\r"


class AnswerStream:
    """Reads an answer under a tools grammar as it is decoded, and says as early as it is known
    what a streaming client is sent: the plain answer's text (the ``response`` string decoded),
    or each tool call's name and then its arguments' JSON text piece by piece, as OpenAI streams
    them. ``feed(text)`` takes the next decoded text and returns the new events: ("content",
    text), ("call", index, name) and ("arguments", index, text); a call's name comes before any
    of its arguments (arguments written before the name are held until it). Any JSON is read
    (the grammar makes it compact and of the tools' shape; nothing here depends on that);
    ``kind`` is the answer's first key once read, ``calls`` the calls so far ({"name": None until
    read, "arguments": the text so far}), ``content`` the plain answer's text so far."""

    def __init__(self) -> None:
        self.raw = ""
        self.kind: str | None = None
        self.content = ""
        self.calls: list[dict] = []
        self._at = 0  # the next character of ``raw`` to read
        self._stack: list[list] = []  # open containers: ["{", key] or ["[", items before]
        self._mode = "value"  # value | key | colon | after | string | literal
        self._key = False  # the string being read is an object's key
        self._escaped = False
        self._string_from = 0  # where the string being read starts (after its quote)
        self._args: tuple[int, int, int] | None = None  # (call, depth, start) while its arguments are read
        self._sent: list[int] = []  # per call: how much of its arguments was sent

    @property
    def called(self) -> bool:
        """Whether a call's name has been read (the answer is tool calls)."""
        return any(c["name"] is not None for c in self.calls)

    @property
    def unread(self) -> str | None:
        """The raw text of an answer that has said neither a plain answer nor a named call (one
        cut short before either): what a client is given of it at the end; None otherwise."""
        return None if self.kind == "response" or self.called else self.raw

    def feed(self, text: str) -> list[tuple]:
        self.raw += text
        events: list[tuple] = []
        raw = self.raw
        while self._at < len(raw):
            self._read(raw[self._at], events)
        if self._in_response():
            self._decode(raw[self._string_from:len(raw)], events)
        self._flush(events)
        return events

    def _flush(self, events: list) -> None:
        """Send the arguments read and not sent yet of every call whose name is known."""
        if self._args is not None:
            call, _, start = self._args
            self.calls[call]["arguments"] = self.raw[start:self._at]
        for i, call in enumerate(self.calls):
            if call["name"] is not None and len(call["arguments"]) > self._sent[i]:
                events.append(("arguments", i, call["arguments"][self._sent[i]:]))
                self._sent[i] = len(call["arguments"])

    def _path(self) -> tuple:
        return tuple(top[1] for top in self._stack)

    def _in_response(self) -> bool:
        return self._mode == "string" and not self._key and self._path() == ("response",)

    def _read(self, c: str, events: list) -> None:
        """Read ``raw[_at]`` (``c``) and move on (a literal's end is read again as what follows it)."""
        i, mode = self._at, self._mode
        self._at += 1
        if mode == "string":
            if self._escaped:
                self._escaped = False
            elif c == "\\":
                self._escaped = True
            elif c == '"':
                self._string_end(self.raw[self._string_from:i], events)
            return
        if c in _SPACE:
            if mode == "literal":
                self._value_end(i)
            return
        if mode == "literal":
            if c in ",}]":
                self._value_end(i)
                self._at = i  # read the delimiter again, after the value
            return
        if mode == "key":
            if c == '"':
                self._mode, self._key, self._string_from = "string", True, i + 1
            elif c == "}":
                self._close(i)
        elif mode == "colon":
            if c == ":":
                self._mode = "value"
        elif mode == "value":
            if c == "]" and self._stack and self._stack[-1][0] == "[":
                self._close(i)
                return
            self._value_start(i)
            if c == "{":
                self._open("{", None)
            elif c == "[":
                self._open("[", 0)
            elif c == '"':
                self._mode, self._key, self._string_from = "string", False, i + 1
            else:
                self._mode = "literal"
        elif mode == "after":
            if c == "," and self._stack:
                top = self._stack[-1]
                if top[0] == "[":
                    top[1] += 1
                    self._mode = "value"
                else:
                    self._mode = "key"
            elif c in "}]":
                self._close(i)

    def _open(self, kind: str, first) -> None:
        self._stack.append([kind, first])
        self._mode = "key" if kind == "{" else "value"
        if kind == "{" and len(self._stack) == 3 and self._path()[:1] == ("tool_calls",):
            self.calls.append({"name": None, "arguments": ""})
            self._sent.append(0)

    def _close(self, i: int) -> None:
        self._stack.pop()
        self._value_end(i + 1)

    def _value_start(self, i: int) -> None:
        path = self._path()
        if len(path) == 3 and path[0] == "tool_calls" and path[2] == "arguments" and self.calls:
            self._args = (len(self.calls) - 1, len(self._stack), i)

    def _value_end(self, end: int) -> None:
        """A value ended just before ``end``: back in its container (or the answer is done)."""
        self._mode = "after"
        if self._args is not None and len(self._stack) == self._args[1]:
            call, _, start = self._args
            self.calls[call]["arguments"] = self.raw[start:end]
            self._args = None

    def _string_end(self, body: str, events: list) -> None:
        value = _json_string(body)
        if self._key:
            if self._stack:
                self._stack[-1][1] = value
            if len(self._stack) == 1 and self.kind is None:
                self.kind = value
            self._mode = "colon"
            return
        path = self._path()
        if path == ("response",):
            self._decode(body, events, whole=True)
        elif len(path) == 3 and path[0] == "tool_calls" and path[2] == "name" and self.calls:
            self._flush(events)  # the earlier calls' arguments first: a client reads the calls in order
            call = len(self.calls) - 1
            self.calls[call]["name"] = value
            events.append(("call", call, value))
        self._value_end(self._at)

    def _decode(self, body: str, events: list, whole: bool = False) -> None:
        """Send the plain answer's text decoded so far: the longest prefix of ``body`` (the string
        as written so far) that decodes, less a last high surrogate whose pair may follow."""
        text = None
        for cut in range(len(body), max(-1, len(body) - 12), -1):
            try:
                text = json.loads('"' + body[:cut] + '"')
                break
            except json.JSONDecodeError:
                continue
        if text is None:
            return
        if not whole and text and "\ud800" <= text[-1] <= "\udbff":
            text = text[:-1]
        if len(text) > len(self.content):
            events.append(("content", text[len(self.content):]))
            self.content = text


def _json_string(body: str) -> str:
    try:
        return json.loads('"' + body + '"')
    except json.JSONDecodeError:
        return body
