"""Tool calls for the server's chat API (OpenAI's ``tools`` / ``tool_choice``), by structured output.

The model is told the tools in a system message, in one generic form whatever its chat template,
and its answer is constrained (``grammar.Grammar``) to one JSON object: ``{"tool_calls": [{"name":
…, "arguments": {…}}]}``, each call's arguments following that tool's parameter schema, or with
``tool_choice`` "auto" ``{"response": "…"}`` instead, a plain answer (compact JSON: no whitespace
between its tokens). ``reply`` turns that JSON
into OpenAI's message (``tool_calls`` with ids and the arguments as a JSON string, finish reason
"tool_calls") or into the answer's text. Earlier turns' calls and the tools' results (an assistant
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


def reply(text: str, complete: bool) -> tuple[str | None, list[dict] | None]:
    """(content, tool_calls) of an answer under a tools grammar: the calls in OpenAI's form
    (fresh ids, arguments as JSON text), or the plain answer's text. An answer cut short
    (``complete`` False: no valid JSON yet) is returned as its raw text."""
    if complete:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = None
        if isinstance(value, dict) and isinstance(value.get("tool_calls"), list):
            return None, [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                           "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
                          for c in value["tool_calls"]]
        if isinstance(value, dict) and isinstance(value.get("response"), str):
            return value["response"], None
    return text, None
