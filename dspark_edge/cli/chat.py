"""``chat``: an interactive conversation; the history is kept and trimmed to the context."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from ..errors import PromptError

from .generate import answer
from .options import Outputs, check_outputs, engine_args, generation_args, generation_config, load_engine


def register(sub) -> None:
    """Add the ``chat`` command to the subparsers ``sub``."""
    c = sub.add_parser("chat", help="interactive chat in the terminal (history kept; empty line or Ctrl-D quits)",
                       description="Chat with the model: each line you type is a user message; the answer streams "
                                   "back. Commands: /reset clears the history, /stats shows the last answer's "
                                   "statistics.")
    engine_args(c, auto_precision=True)
    c.add_argument("--system", default=None, help="system message")
    generation_args(c, 512)
    c.add_argument("--json", action="store_true", help="print one JSON object per answer instead of text")
    c.add_argument("--prompt-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="start each turn from the K/V of the conversation so far, prefilling only the new "
                        "message; --no-prompt-cache prefills the whole history every turn (default: on)")


def cmd_chat(args) -> int:
    check_outputs(args)
    # Each turn starts from the K/V of the conversation so far: it prefills its new message only.
    cfg = replace(generation_config(args), reuse_prefix=args.prompt_cache)
    pipe = load_engine(args, drafter=args.drafter)
    outputs = Outputs(pipe, args)
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = []
    last = None
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"[chat with {pipe.manifest.model.name}; empty line or Ctrl-D quits, /reset, /stats]", file=sys.stderr)
    if hasattr(sys.stdin, "reconfigure"):  # a line that is not UTF-8 is refused, not fatal to the chat
        sys.stdin.reconfigure(errors="surrogateescape")
    status = 0
    try:
        while True:
            try:
                line = input("you> " if interactive else "").strip()
            except EOFError:
                break
            if not line:
                break
            try:
                line.encode("utf-8")
            except UnicodeEncodeError:
                print("[that line is not UTF-8 text: ignored; type it again]", file=sys.stderr)
                continue
            if line == "/reset":
                history = []
                print("[history cleared]", file=sys.stderr)
                continue
            if line == "/stats":
                print(json.dumps(last.stats.as_dict() if last else {}, indent=1), file=sys.stderr)
                continue
            history.append({"role": "user", "content": line})
            try:
                history = fit_history(pipe, system, history, cfg)
            except PromptError as exc:
                print(f"[{exc}]", file=sys.stderr)
                history.pop()
                status = 1
                continue
            r = answer(pipe, system + history, cfg, args.json)
            if r is None:  # the failed turn is dropped; the pipeline stays usable
                history.pop()
                status = 1
                continue
            last = r
            history.append({"role": "assistant", "content": r.text})
    finally:
        pipe.close()
        outputs.close()
    return status


def fit_history(pipe, system: list[dict], history: list[dict], cfg) -> list[dict]:
    """The most recent turns that fit the context with room for an answer (the oldest
    user/assistant pairs dropped, said on stderr); a last message too long alone is a
    PromptError. The chat command and the demo's chat both keep their history with it."""
    capacity = pipe.target.capacity
    room = max(1, min(cfg.max_new_tokens, capacity // 4))
    dropped = 0
    while True:
        n = len(pipe.encode_prompt(system + history, cfg.special_in_content))
        if n + room <= capacity:
            break
        if len(history) <= 1:
            raise PromptError(f"that message is {n} tokens; with room for an answer the context holds "
                              f"{capacity - room}: send a shorter one (or load with a larger --max-context)")
        history = history[2:]  # the oldest user turn and the answer to it
        dropped += 1
    if dropped:
        print(f"[dropped the {dropped} oldest exchange{'s' if dropped > 1 else ''} to fit the context of "
              f"{capacity} tokens]", file=sys.stderr)
    return history
