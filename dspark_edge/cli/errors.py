"""How the command lines end: a project error is one line and exit 2, Ctrl-C 130, SIGTERM 143,
a reader that went away 141; library parameter names in messages become flags."""

from __future__ import annotations

import sys

from ..errors import DSparkError, GenerationError


_FLAGS = (("context_policy='truncate'", "--context-policy truncate"), ("load with a larger max_context",
          "pass a larger --max-context"), ("max_context", "--max-context"), ("intra_op_threads", "--threads"),
          ("draft_tokens=", "--draft-tokens "), ("verify_hashes=False", "--no-verify-hashes"),
          ("special_in_content=True", "the library's special_in_content=True"))


def as_flags(message: str) -> str:
    """A library error message with its parameter names put as the CLI's flags."""
    for name, flag in _FLAGS:
        message = message.replace(name, flag)
    return message


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is (``on_sigterm``): handled like Ctrl-C, exit 143."""


def on_sigterm() -> None:
    """Turn SIGTERM into ``Terminated`` in the main thread, so a command ends as after Ctrl-C
    (partial output printed, files closed) instead of dying mid-write."""
    import signal

    def handler(signum, frame):
        raise Terminated()

    signal.signal(signal.SIGTERM, handler)


def run_reporting_errors(fn, *args) -> int:
    """``fn(*args)``'s exit code, or the code of the error that ended it (``exit_code``). Shared
    by this CLI, the demo and the scripts in bench/."""
    try:
        return fn(*args)
    except (DSparkError, BrokenPipeError, KeyboardInterrupt) as exc:
        return exit_code(exc)


def exit_code(exc: BaseException) -> int:
    """Say on stderr how a command ended with ``exc`` and return its exit code: a generation
    that failed mid-way 1, another project error 2 (bad input, one line), the reader gone 141
    (quietly, as Unix tools do), SIGTERM (with ``on_sigterm``) 143, Ctrl-C 130. Anything else
    is a bug and is raised again."""
    import os

    if isinstance(exc, BrokenPipeError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    if isinstance(exc, Terminated):
        print("[terminated]", file=sys.stderr)
        return 143
    if isinstance(exc, KeyboardInterrupt):
        print("[interrupted]", file=sys.stderr)
        return 130
    if isinstance(exc, DSparkError):
        print(f"error: {as_flags(str(exc))}", file=sys.stderr)
        return 1 if isinstance(exc, GenerationError) else 2
    raise exc
