"""``generate``: one answer, streamed to stdout (or one JSON record)."""

from __future__ import annotations

import json
import sys

from ..errors import ConfigError, GenerationError

from .errors import Terminated
from .options import Outputs, check_outputs, engine_args, generation_args, generation_config, load_engine


def register(sub) -> None:
    """Add the ``generate`` command to the subparsers ``sub``."""
    g = sub.add_parser("generate", help="generate text for one prompt, streaming it to stdout")
    engine_args(g, auto_precision=True)
    g.add_argument("prompt", nargs="?", default=None,
                   help="the prompt (sent through the chat template unless --raw); '-' reads it from stdin")
    g.add_argument("-f", "--prompt-file", default=None, metavar="FILE", help="read the prompt from FILE (UTF-8)")
    g.add_argument("--raw", action="store_true", help="use the prompt as plain text, no chat template")
    g.add_argument("--system", default=None, help="system message (chat mode)")
    generation_args(g, 256)
    g.add_argument("--json", action="store_true", help="print one JSON object (text, ids, stats) instead of text")


def answer(pipe, prompt, cfg, as_json: bool):
    """Stream one answer to stdout (or print it as JSON); returns the result, or None when it
    failed mid-way (the error and the partial output are printed)."""
    stream = pipe.stream(prompt, cfg)
    shown = ""
    try:
        for piece in stream:
            if not as_json:
                print(piece, end="", flush=True)
                shown += piece
    except GenerationError as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        if as_json and exc.partial is not None:
            print(json.dumps(result_json(exc.partial, pipe.tokenizer)))
        return None
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (Terminated): what was decided is not lost
        stream.close()  # ends the generation now; the pipeline stays usable
        text = pipe.tokenizer.decode(stream.token_ids)
        reason = "terminated" if isinstance(exc, Terminated) else "interrupted"
        if as_json:
            print(json.dumps({"text": text, "token_ids": list(stream.token_ids), "stop_reason": reason,
                              "error": None, "stats": None}), flush=True)
        else:
            print(text[len(shown):] if text.startswith(shown) else "", flush=True)
        raise
    r = stream.result
    if as_json:
        print(json.dumps(result_json(r, pipe.tokenizer)), flush=True)
    else:
        print(flush=True)
        s = r.stats
        extra = f", {s.draft_n_accepted}/{s.draft_n} drafts accepted" if s.draft_n else ""
        print(f"[{s.new_tokens} tokens, {s.tokens_per_s:.1f} tok/s, prefill {s.prefill_s * 1000:.0f} ms{extra}, "
              f"stop: {r.stop_reason}]", file=sys.stderr)
    return r


def result_json(r, tokenizer=None) -> dict:
    """The JSON record of a result; with log-probabilities, one entry per token (its text by
    ``tokenizer`` when given)."""
    out = {"text": r.text, "token_ids": list(r.token_ids), "stop_reason": r.stop_reason, "error": r.error,
           "stats": r.stats.as_dict()}
    if r.logprobs is not None:
        def text(tid: int) -> dict:
            return {} if tokenizer is None else {"token": tokenizer.decode([tid], skip_special_tokens=False)}

        out["logprobs"] = [{"token_id": e.token_id, **text(e.token_id), "logprob": e.logprob,
                            "top": [{"token_id": t, **text(t), "logprob": lp} for t, lp in e.top]}
                           for e in r.logprobs]
    return out


def _prompt_text(args) -> str:
    """The prompt of ``generate``: the argument, stdin for '-', or ``--prompt-file``."""
    if (args.prompt is None) == (args.prompt_file is None):
        raise ConfigError("give the prompt as an argument ('-' reads stdin) or with --prompt-file FILE, not both")
    try:
        if args.prompt_file is not None:
            with open(args.prompt_file, "rb") as f:
                return f.read().decode("utf-8")
        if args.prompt == "-":
            return sys.stdin.buffer.read().decode("utf-8")
    except OSError as exc:
        raise ConfigError(f"--prompt-file {args.prompt_file}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"the prompt is not UTF-8 text (byte {exc.start})") from None
    return args.prompt


def cmd_generate(args) -> int:
    check_outputs(args)
    text = _prompt_text(args)
    cfg = generation_config(args)  # a bad option is reported before the engine loads
    pipe = load_engine(args, drafter=args.drafter)
    if args.raw:
        prompt = text
    else:
        prompt = ([{"role": "system", "content": args.system}] if args.system else []) + \
                 [{"role": "user", "content": text}]
    outputs = Outputs(pipe, args)
    try:
        return 0 if answer(pipe, prompt, cfg, args.json) is not None else 1
    finally:
        pipe.close()
        outputs.close()
