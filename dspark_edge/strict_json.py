"""Strict conversion between frozen dataclasses and JSON-compatible dicts.

Every dataclass that crosses a boundary (manifest, generation config, ...) goes through
``from_json_dict``: unknown keys, missing keys and wrong types are rejected with the dotted
path of the bad field. Supported field types: bool, int, float, str, None unions, tuples
(``tuple[X, ...]``), ``dict[str, X]`` and nested dataclasses.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar

from .errors import ManifestError

T = TypeVar("T")


def read_jsonl(path, error: type[Exception], cut_tail_ok: bool = False) -> list[tuple[int, dict]]:
    """(line number, object) for every non-blank line of a JSON-lines file; a line that is not
    a JSON object raises ``error`` naming the file and the line. ``cut_tail_ok``: a last line
    without its newline that does not parse (what a writer killed mid-line leaves) is dropped
    with a warning instead."""
    import json
    import logging
    from pathlib import Path

    if not Path(path).is_file():
        raise error(f"{path} does not exist or is not a file")
    try:
        text = Path(path).read_bytes().decode("utf-8", errors="strict")
    except UnicodeDecodeError as exc:
        raise error(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise error(f"{path}: cannot be read ({exc.strerror or exc})") from None
    lines = text.split("\n")  # JSON lines end at "\n" only; U+2028 or U+0085 may stand in a string as it is
    if lines and lines[-1] == "":
        lines.pop()
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, RecursionError, ValueError) as exc:
            if cut_tail_ok and n == len(lines) and not text.endswith("\n"):
                logging.getLogger(__name__).warning("%s:%d: the last line is cut short (the writer stopped "
                                                    "mid-line); reading the lines before it", path, n)
                break
            msg = exc.msg if isinstance(exc, json.JSONDecodeError) else type(exc).__name__
            raise error(f"{path}:{n}: not valid JSON ({msg}); was the file cut short?") from None
        if not isinstance(rec, dict):
            raise error(f"{path}:{n}: expected a JSON object, got {type(rec).__name__}")
        out.append((n, rec))
    return out


def to_json_dict(obj: Any) -> Any:
    """A dataclass (recursively) as plain dicts, lists and scalars."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_json_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (tuple, list)):
        return [to_json_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): to_json_dict(v) for k, v in obj.items()}
    return obj


def from_json_dict(cls: type[T], data: Any, where: str = "", error: type[Exception] = ManifestError) -> T:
    """Build ``cls`` from ``data``, rejecting unknown/missing keys and bad types.

    ``where`` prefixes field paths in error messages (e.g. ``manifest.json: variants[2].width``).
    Dataclass ``__post_init__`` checks run as usual and their errors are re-raised with the path.
    """
    return _convert(cls, data, where or cls.__name__, error)


def _convert(tp: Any, value: Any, path: str, error: type[Exception]) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        problems = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, path, error)
            except error as exc:
                problems.append(str(exc))
        raise error(problems[0] if len(problems) == 1 else f"{path}: value {value!r} matches none of {tp}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise error(f"{path}: expected an object, got {type(value).__name__}")
        hints = typing.get_type_hints(tp)
        fields = {f.name: f for f in dataclasses.fields(tp) if f.init}
        unknown = sorted(set(value) - set(fields))
        if unknown:
            raise error(f"{path}: unknown key(s) {unknown}; allowed keys are {sorted(fields)}")
        kwargs = {}
        for name, f in fields.items():
            if name not in value:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise error(f"{path}: missing required key {name!r}")
                continue
            kwargs[name] = _convert(hints[name], value[name], f"{path}.{name}", error)
        try:
            return tp(**kwargs)
        except (ValueError, TypeError) as exc:
            raise error(f"{path}: {exc}") from exc
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, list):
            raise error(f"{path}: expected a list, got {type(value).__name__}")
        item = args[0]
        return tuple(_convert(item, v, f"{path}[{i}]", error) for i, v in enumerate(value))
    if origin is dict:
        key_t, val_t = typing.get_args(tp)
        if not isinstance(value, dict):
            raise error(f"{path}: expected an object, got {type(value).__name__}")
        return {k: _convert(val_t, v, f"{path}.{k}", error) for k, v in value.items()}
    if typing.get_origin(tp) is typing.Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise error(f"{path}: {value!r} is not one of {list(allowed)}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise error(f"{path}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise error(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise error(f"{path}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise error(f"{path}: expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported field type {tp!r} at {path}")  # a programming error
