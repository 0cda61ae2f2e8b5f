"""``python -m dspark_edge``: generate, chat, bench, profile, inspect and plot from the command line.

Exit codes: 0 success, 1 generation failed mid-way (partial output printed) or a drafter
failed during a benchmark, 2 bad input (engine folder, options, prompt, an output that cannot
be written), 130 interrupted (Ctrl-C), 143 terminated (SIGTERM).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import replace

from . import __version__
from .backends import BackendOptions
from .config import GenerationConfig
from .drafters import spec as drafter_spec
from .errors import ConfigError, DSparkError, GenerationError, PromptError


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                   help="log details to stderr (also accepted before the command)")
    p.add_argument("--engine", required=True, help="engine folder written by `python -m export target`")
    p.add_argument("--precision", default=None, help="target precision to load (default: the most precise exported)")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads (default: onnxruntime's choice)")
    p.add_argument("--max-context", type=int, default=2048, help="KV cache size in tokens (default: %(default)s)")
    p.add_argument("--no-verify-hashes", action="store_true", help="check file sizes only, not sha256 (faster start)")
    p.add_argument("--providers", default="CPUExecutionProvider",
                   help="comma-separated onnxruntime execution providers in priority order (default: %(default)s); "
                        "an unavailable one is an error unless --fallback-to-cpu")
    p.add_argument("--provider-option", action="append", default=[], metavar="PROVIDER:KEY=VALUE",
                   help="an option of one execution provider, e.g. CUDAExecutionProvider:device_id=1 or "
                        "TensorrtExecutionProvider:trt_fp16_enable=1 (repeatable)")
    p.add_argument("--fallback-to-cpu", action="store_true",
                   help="use the CPU provider (logged) when a requested provider is unavailable")
    p.add_argument("--backend", choices=("onnxruntime", "tensorrt"), default="onnxruntime",
                   help="run the target on ONNX Runtime (with --providers) or on the TensorRT engines built by "
                        "`python -m export trt` (default: %(default)s)")
    p.add_argument("--device-id", type=int, default=0, help="CUDA device for GPU providers and TensorRT (default: 0)")
    p.add_argument("--no-scheduler", action="store_true",
                   help="with a drafter: keep drafts by the survival cut instead of the confidence scheduler")
    p.add_argument("--sched", action="append", default=[], metavar="KEY=VALUE",
                   help="a SchedulerConfig field, e.g. --sched hot_c=75 --sched probe_every=8 (repeatable)")


def _scheduler_config(args):
    import dataclasses

    from .errors import ConfigError
    from .scheduler import SchedulerConfig

    if args.no_scheduler:
        return False
    fields = {f.name: f.type for f in dataclasses.fields(SchedulerConfig)}
    values = {}
    for item in args.sched:
        key, _, raw = item.partition("=")
        if key not in fields or not raw:
            raise ConfigError(f"--sched {item!r}: expected KEY=VALUE with KEY one of {sorted(fields)}")
        try:
            values[key] = int(raw) if fields[key] in (int, "int") else float(raw)
        except ValueError:
            raise ConfigError(f"--sched {item!r}: {raw!r} is not a number") from None
    return SchedulerConfig(**values)


def provider_options(providers: tuple[str, ...], items: list[str]) -> tuple[dict, ...]:
    """``--provider-option PROVIDER:KEY=VALUE`` items as one options dict per provider."""
    from .errors import ConfigError

    opts: dict[str, dict[str, str]] = {p: {} for p in providers}
    for item in items:
        name, _, kv = item.partition(":")
        key, _, value = kv.partition("=")
        if not key or not _ or name not in opts:
            raise ConfigError(f"--provider-option {item!r}: expected PROVIDER:KEY=VALUE with PROVIDER one of "
                              f"--providers {list(providers)}")
        opts[name][key] = value
    return tuple(opts[p] for p in providers) if items else ()


def _backend_options(args) -> BackendOptions:
    providers = tuple(p.strip() for p in args.providers.split(",") if p.strip())
    return BackendOptions(providers=providers, provider_options=provider_options(providers, args.provider_option),
                          intra_op_threads=args.threads, max_context=args.max_context,
                          fallback_to_cpu=args.fallback_to_cpu, device_id=args.device_id)


def _load(args, drafter=None, shared_threads: bool = False):
    from .drafters.spec import own_model
    from .pipeline import load

    options = _backend_options(args)
    if getattr(args, "own_process", False) and (shared_threads or own_model(drafter)):
        # The target and a drafter with a graph of its own take turns on one thread pool. Only
        # when this is the process's command line: the pool is process-wide for good, and
        # onnxruntime then refuses sessions with pools of their own (code that calls ``main``
        # in its own process, a test for one, may open such sessions afterwards).
        options = replace(options, shared_threads=True)
    import time

    t0 = time.perf_counter()
    print(f"[load] {args.engine}: target {args.precision or 'at its most precise'}, drafter {drafter or 'none'}"
          f"{'' if args.no_verify_hashes else ', checking file hashes'}", file=sys.stderr, flush=True)
    pipe = load(args.engine, args.precision, drafter=drafter, backend=args.backend, options=options,
                verify_hashes=not args.no_verify_hashes, scheduler=_scheduler_config(args),
                chat_template=getattr(args, "chat_template", None))
    print(f"[load] ready in {time.perf_counter() - t0:.1f} s: target {pipe.target.precision}, drafter "
          f"{pipe.drafter.name if pipe.drafter is not None else 'none'}", file=sys.stderr, flush=True)
    return pipe


def _generation_args(p: argparse.ArgumentParser, max_new_tokens: int) -> None:
    p.add_argument("--drafter", default="auto",
                   help=f"the drafter ({drafter_spec.describe()}; default: %(default)s, as in the library's "
                        "and the demo's defaults; 'none' decodes plainly)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template to use instead of the engine folder's")
    p.add_argument("--draft-tokens", type=int, default=None,
                   help="verify exactly this many drafts every round (default: the scheduler chooses)")
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help="answer length limit (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (1 = off)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed: the same seed gives the same answer")
    p.add_argument("--sampling", choices=("rejection", "coupled"), default="rejection",
                   help="how drafts are verified when sampling: rejection sampling (default), or coupled: each "
                        "position's token drawn with noise seeded by (seed, position), so the answer is plain "
                        "decoding's for that seed whatever the drafter and widths")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--context-policy", choices=("error", "truncate"), default="error",
                   help="a prompt longer than the context: fail (default) or keep its tail")
    p.add_argument("--trace", default=None, metavar="JSONL",
                   help="write one JSON line per round (widths, drafts, confidences, costs, telemetry, decision) "
                        "and a summary per answer")
    p.add_argument("--prometheus", default=None, metavar="FILE",
                   help="write Prometheus text-format metrics (draft_n, draft_n_accepted, accept_length, "
                        "per-position acceptance, …) to FILE after each answer")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="write a timeline of width, acceptance, tok/s and telemetry over the rounds (matplotlib)")


def _generation_config(args) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, stop=tuple(args.stop), draft_tokens=args.draft_tokens,
                            context_policy=args.context_policy, sampling=args.sampling)


def check_outputs(args) -> None:
    """The --trace / --prometheus / --plot paths, checked before the engine loads."""
    from .paths import output_file

    for option in ("trace", "prometheus", "plot"):
        path = getattr(args, option, None)
        if path:
            output_file(path, f"--{option}")


class _Outputs:
    """The --trace / --prometheus / --plot outputs of generate and chat, as one pipeline observer.
    A write that fails (disk full) is kept in ``error`` and stops those outputs; ``close()``
    raises it, so the command ends with exit 2 after the answer it printed."""

    def __init__(self, pipe, args) -> None:
        from .metrics import PrometheusMetrics, TraceWriter

        check_outputs(args)
        self.args, self.rounds, self.error = args, [], None
        self.trace = TraceWriter(args.trace, label=f"{args.command} {args.engine}") if args.trace else None
        self.prom = PrometheusMetrics() if args.prometheus else None
        if args.trace or args.plot or args.prometheus:
            pipe.start_telemetry()
        pipe.add_observer(self)

    def _guarded(self, fn, *a) -> None:
        from .errors import OutputError

        if self.error is None:
            try:
                fn(*a)
            except OutputError as exc:
                self.error = exc

    def on_round(self, info) -> None:
        if self.trace is not None:
            self._guarded(self.trace.on_round, info)
        if self.prom is not None:
            self.prom.on_round(info)
        if self.args.plot:
            self.rounds.append(info.as_dict())

    def on_generation(self, result) -> None:
        if self.trace is not None:
            self._guarded(self.trace.on_generation, result)
        if self.prom is not None:
            self.prom.on_generation(result)
            self._guarded(self.prom.write, self.args.prometheus)
        if self.args.plot and self.rounds:
            self._guarded(self._plot)
        self.rounds = []

    def _plot(self) -> None:
        from .plots import plot_timeline

        drawn = plot_timeline(self.rounds, self.args.plot)
        print(f"[plot] {self.args.plot}: {', '.join(drawn)}", file=sys.stderr)

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()
        if self.error is not None:
            raise self.error


def build_parser() -> argparse.ArgumentParser:
    from pathlib import Path

    prog = "dspark-edge" if Path(sys.argv[0]).name == "dspark-edge" else "python -m dspark_edge"
    parser = argparse.ArgumentParser(prog=prog,
                                     description="On-device speculative decoding runtime (DSpark).",
                                     epilog="Exit codes: 0 success, 1 a generation failed mid-way (the partial "
                                            "output is printed) or a drafter failed during bench, 2 bad input "
                                            "(engine, option, prompt, an output that cannot be written), "
                                            "130 interrupted, 143 terminated. `python -m dspark_edge COMMAND --help` explains "
                                            "each command's options.")
    parser.add_argument("--version", action="version", version=f"dspark_edge {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log details to stderr")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt, streaming it to stdout")
    _engine_args(g)
    g.add_argument("prompt", nargs="?", default=None,
                   help="the prompt (sent through the chat template unless --raw); '-' reads it from stdin")
    g.add_argument("-f", "--prompt-file", default=None, metavar="FILE", help="read the prompt from FILE (UTF-8)")
    g.add_argument("--raw", action="store_true", help="use the prompt as plain text, no chat template")
    g.add_argument("--system", default=None, help="system message (chat mode)")
    _generation_args(g, 256)
    g.add_argument("--json", action="store_true", help="print one JSON object (text, ids, stats) instead of text")

    c = sub.add_parser("chat", help="interactive chat in the terminal (history kept; empty line or Ctrl-D quits)",
                       description="Chat with the model: each line you type is a user message; the answer streams "
                                   "back. Commands: /reset clears the history, /stats shows the last answer's "
                                   "statistics.")
    _engine_args(c)
    c.add_argument("--system", default=None, help="system message")
    _generation_args(c, 512)
    c.add_argument("--json", action="store_true", help="print one JSON object per answer instead of text")

    b = sub.add_parser("bench", help="benchmark generation over a prompt set and the verify cost curve (JSON)")
    _engine_args(b)
    b.add_argument("--prompts", default=None, help="JSON-lines prompt file (default: the project's benchmark prompts, "
                        "dspark_edge/data/prompts.jsonl)")
    b.add_argument("--max-new-tokens", type=int, default=128, help="tokens decoded per prompt (default: %(default)s)")
    b.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    b.add_argument("--depth", type=int, default=128, help="cached positions for the verify cost curve")
    b.add_argument("--repeats", type=int, default=15, help="timed repeats per width for the verify curve")
    b.add_argument("--drafter", default=None,
                   help=f"compare plain decoding with these drafters, comma-separated ({drafter_spec.grammar()}; "
                        "'auto' as generate picks it), interleaved per prompt: the verify width chosen per round "
                        "by the scheduler and fixed at every listed draft length")
    b.add_argument("--draft-tokens", default=None,
                   help="comma-separated draft lengths to compare (default: every listed width - 1)")
    b.add_argument("--passes", type=int, default=1,
                   help="with --drafter: passes over the prompt set, the variants in a new random order at every "
                        "prompt; each ratio then comes with a 95%% bootstrap interval over the prompts "
                        "(default: %(default)s)")
    b.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default); > 0 benchmarks sampled decoding, every variant of a prompt with the "
                        "same seed")
    b.add_argument("--top-k", type=int, default=0, help="with --temperature: top-k (0 = off)")
    b.add_argument("--top-p", type=float, default=1.0, help="with --temperature: nucleus mass (1 = off)")
    b.add_argument("--sampling", choices=("rejection", "coupled"), default="rejection",
                   help="with --temperature: how drafts are verified. 'coupled' makes every answer depend on its "
                        "seed alone, so the report's exact_prompts checks speculative answers against plain ones; "
                        "with 'rejection' (default, the library's) they differ by design and are not compared")
    b.add_argument("--seed", type=int, default=0, help="first sampling seed (default: %(default)s)")
    b.add_argument("--json", action="store_true",
                   help="accepted for symmetry: bench always prints its report as JSON on stdout (progress on stderr)")

    pr = sub.add_parser("profile", help="measure this device's cost of every variant of an engine",
                        description="Time the target at every verify width and the drafter at every block size "
                                    "(warm-up, median of repeats, at several context depths) and write "
                                    "<device-key>.json to the user's profile folder (or --output-dir / "
                                    "DSPARK_PROFILES), which the scheduler loads automatically.")
    pr.add_argument("--engine", required=True, help="engine folder to profile")
    pr.add_argument("--contexts", default="64,512", help="context depths (default: %(default)s)")
    pr.add_argument("--repeats", type=int, default=9, help="timed repeats per variant (default: %(default)s)")
    pr.add_argument("--output-dir", default=None, help="where to write (default: DSPARK_PROFILES, else the user's profile folder, "
                        "~/.local/share/dspark_edge/profiles)")
    pr.add_argument("--json", action="store_true", help="print the profile as JSON")

    i = sub.add_parser("inspect", help="print an engine folder's manifest, variants, files and hashes, profile "
                                       "status and the telemetry sources of this machine (or --json)")
    i.add_argument("--engine", required=True, help="engine folder to inspect")
    i.add_argument("--verify-hashes", action="store_true", help="also check every file's sha256 against the manifest")
    i.add_argument("--json", action="store_true", help="print the manifest, profile status and telemetry as JSON")

    pl = sub.add_parser("plot", help="draw the timeline PNG of a trace written with --trace",
                        description="Width, acceptance, tok/s and telemetry per round of one answer of a trace.")
    pl.add_argument("trace", help="JSON-lines trace (generate/chat --trace, or the demo's --trace)")
    pl.add_argument("output", help="PNG to write")
    pl.add_argument("--generation", type=int, default=-1,
                    help="which answer of the trace (0-based; default: the last)")
    pl.add_argument("--json", action="store_true", help="print the answer's summary (acceptance, widths, …) as JSON")
    return parser


def _answer(pipe, prompt, cfg, as_json: bool):
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
            print(json.dumps(_result_json(exc.partial)))
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
        print(json.dumps(_result_json(r)), flush=True)
    else:
        print(flush=True)
        s = r.stats
        extra = f", {s.draft_n_accepted}/{s.draft_n} drafts accepted" if s.draft_n else ""
        print(f"[{s.new_tokens} tokens, {s.tokens_per_s:.1f} tok/s, prefill {s.prefill_s * 1000:.0f} ms{extra}, "
              f"stop: {r.stop_reason}]", file=sys.stderr)
    return r


def _result_json(r) -> dict:
    return {"text": r.text, "token_ids": list(r.token_ids), "stop_reason": r.stop_reason, "error": r.error,
            "stats": r.stats.as_dict()}


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
    pipe = _load(args, drafter=args.drafter)
    if args.raw:
        prompt = text
    else:
        prompt = ([{"role": "system", "content": args.system}] if args.system else []) + \
                 [{"role": "user", "content": text}]
    cfg = _generation_config(args)
    outputs = _Outputs(pipe, args)
    try:
        return 0 if _answer(pipe, prompt, cfg, args.json) is not None else 1
    finally:
        pipe.close()
        outputs.close()


def cmd_chat(args) -> int:
    check_outputs(args)
    pipe = _load(args, drafter=args.drafter)
    cfg = _generation_config(args)
    outputs = _Outputs(pipe, args)
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
                history = _fit_history(pipe, system, history, cfg)
            except PromptError as exc:
                print(f"[{exc}]", file=sys.stderr)
                history.pop()
                status = 1
                continue
            r = _answer(pipe, system + history, cfg, args.json)
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


def _fit_history(pipe, system: list[dict], history: list[dict], cfg) -> list[dict]:
    """The most recent turns that fit the context with room for an answer (the oldest
    user/assistant pairs dropped, said on stderr); a last message too long alone is a
    PromptError."""
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


def cmd_bench(args) -> int:
    from .bench import bench_generation, load_prompts, verify_cost_curve

    for option, value, least in (("--limit", args.limit, 1), ("--repeats", args.repeats, 1),
                                 ("--depth", args.depth, 1), ("--max-new-tokens", args.max_new_tokens, 1)):
        if value is not None and value < least:
            raise ConfigError(f"{option} must be at least {least}, got {value}")
    try:
        asked_ks = [int(k) for k in args.draft_tokens.split(",")] if args.draft_tokens else None
    except ValueError:
        raise ConfigError(f"--draft-tokens {args.draft_tokens!r}: expected comma-separated integers, e.g. 3,5") from None
    if asked_ks is not None and (not asked_ks or min(asked_ks) < 1 or len(set(asked_ks)) != len(asked_ks)):
        raise ConfigError(f"--draft-tokens {args.draft_tokens!r}: give distinct draft lengths of at least 1")
    prompts = load_prompts(args.prompts)[:args.limit]
    specs = [s.strip() for s in args.drafter.split(",") if s.strip()] if args.drafter else []
    if args.drafter and not specs:
        raise ConfigError(f"--drafter {args.drafter!r} names no drafter")
    if len(set(specs)) != len(specs):
        raise ConfigError(f"--drafter lists a drafter twice: {args.drafter!r}")
    if args.passes < 1:
        raise ConfigError(f"--passes must be at least 1, got {args.passes}")
    if args.passes > 1 and not specs:
        raise ConfigError("--passes repeats a comparison: give --drafter as well")
    sampling = None
    if args.temperature != 0.0:
        sampling = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
                    "sampling": args.sampling}
        GenerationConfig(seed=args.seed, **sampling)  # bad values fail here, before the engine loads
    elif (args.top_k, args.top_p, args.sampling) != (0, 1.0, "rejection"):
        raise ConfigError("--top-k, --top-p and --sampling shape sampled decoding: give --temperature > 0 as well")
    from .drafters.spec import own_model

    pipe = _load(args, drafter=specs[0] if specs else None, shared_threads=any(map(own_model, specs)))
    widths = pipe.target.widths
    if args.depth + max(widths) > pipe.target.capacity:
        raise ConfigError(f"--depth {args.depth}: with the widest verify width {max(widths)} it exceeds the context "
                          f"of {pipe.target.capacity} tokens; give --depth at most {pipe.target.capacity - max(widths)} "
                          "or a larger --max-context")
    listed = [w - 1 for w in widths if w > 1]
    if asked_ks is not None and set(asked_ks) - set(listed):
        raise ConfigError(f"--draft-tokens {args.draft_tokens}: this engine verifies {listed} drafts per round "
                          f"(its widths {list(widths)} minus the anchor); "
                          f"{sorted(set(asked_ks) - set(listed))} {'is' if len(set(asked_ks) - set(listed)) == 1 else 'are'} "
                          "not among them")
    bar = _Progress("bench", len(prompts) * args.passes)

    def progress(done, total, row):
        bar.update(done, f"{row['id']}: {row['tokens_per_s']} tok/s")

    m = pipe.manifest
    report = {"engine": str(args.engine), "model": m.model.name, "precision": pipe.target.precision,
              "providers": list(pipe.target.session.providers)}
    if args.drafter:
        from .bench import bench_compare

        from .drafters import create
        from .pipeline import auto_drafter, drafter_backend_options

        # "auto" stands for the drafter the loaded target's precision and device call for.
        specs = [auto_drafter(m, pipe.target.precision, args.backend, pipe.target.session.providers)
                 if s == "auto" else s for s in specs]
        if len(set(specs)) != len(specs):
            raise ConfigError(f"--drafter lists a drafter twice once 'auto' is resolved: {', '.join(specs)}")
        ks = asked_ks or listed
        drafters = [(specs[0] if len(specs) > 1 else pipe.drafter.name, pipe.drafter)]  # the first: loaded with the target
        drafters += [(spec, create(spec, m, options=drafter_backend_options(spec, _backend_options(args)),
                                   verify_hashes=not args.no_verify_hashes, engine_dir=args.engine))
                     for spec in specs[1:]]
        variants = [("plain", None, {})]
        for label, drafter in drafters:
            variants += [(f"{label} auto", drafter, {})] + \
                        [(f"{label} k={k}", drafter, {"draft_tokens": k}) for k in ks]

        def progress_cmp(done, total, rates):
            bar.update(done, ", ".join(f"{n}: {v:.1f}" for n, v in rates.items()))

        report["comparison"] = bench_compare(pipe, prompts, variants, args.max_new_tokens, progress=progress_cmp,
                                             passes=args.passes, seed=args.seed, sampling=sampling)
        _print_paired(report["comparison"].get("paired", {}))
    else:
        report["generation"] = bench_generation(pipe, prompts, args.max_new_tokens, progress=progress,
                                                sampling=None if sampling is None else {**sampling, "seed": args.seed})
    bar.close()
    print("[bench] verify cost curve", file=sys.stderr, flush=True)
    report["verify_cost"] = verify_cost_curve(pipe.target, depth=args.depth, repeats=args.repeats)
    print(json.dumps(report, indent=2))
    failed = {name: v["drafter_failures"] for name, v in report.get("comparison", {}).get("variants", {}).items()
              if v.get("drafter_failures")}
    if failed:
        print(f"error: the drafter failed during the benchmark ({'; '.join(f'{n}: {f}' for n, f in failed.items())}); "
              "its numbers do not measure it: see the warnings above", file=sys.stderr)
        return 1
    return 0


def _print_paired(paired: dict) -> None:
    """The comparison's ratios with their intervals, one line each, on stderr."""
    for key, entry in paired.items():
        if key.startswith("vs_"):
            for name, r in entry.items():
                print(f"[bench] {name} / {key[3:]}: {r['ratio']:.3f} (95% {r['ci95'][0]:.3f}-{r['ci95'][1]:.3f})",
                      file=sys.stderr, flush=True)
        else:
            r = entry["overall"]
            cats = ", ".join(f"{c} {v['ratio']:.3f} ({v['ci95'][0]:.3f}-{v['ci95'][1]:.3f}) vs {v['best_fixed']}"
                             for c, v in entry["by_category"].items())
            any_ = entry.get("best_fixed_any")
            other = (f"; vs the best fixed width of any drafter ({any_['best_fixed']}): {any_['ratio']:.3f} "
                     f"(95% {any_['ci95'][0]:.3f}-{any_['ci95'][1]:.3f})") if any_ else ""
            print(f"[bench] {key} ({entry['best_fixed']}): {r['ratio']:.3f} (95% {r['ci95'][0]:.3f}-"
                  f"{r['ci95'][1]:.3f}); by category: {cats}{other}", file=sys.stderr, flush=True)


class _Progress:
    """A progress bar on stderr when it is a terminal (rich), else one line per step."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self._bar = label, total, None
        if sys.stderr.isatty():
            try:
                from rich.console import Console
                from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
            except ImportError:
                return
            self._bar = Progress(TextColumn(f"[{label}]"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                 TextColumn("{task.description}"), console=Console(stderr=True), transient=True)
            self._task = self._bar.add_task("", total=total)
            self._bar.start()

    def update(self, done: int, note: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=done, description=note)
        else:
            print(f"[{self.label}] {done}/{self.total} {note}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def _ngram_table_summary(engine, manifest) -> dict | None:
    """The engine folder's corpus n-gram table as inspect reports it (None when it has none)."""
    from .drafters.ngram_table import FILE_NAME, NgramTable
    from .manifest import engine_path

    try:
        path = engine_path(engine, FILE_NAME)
        if not path.is_file():
            return None
        t = NgramTable.load_for(path, manifest)
    except DSparkError as exc:
        return {"file": FILE_NAME, "error": str(exc)}
    from .drafters.ngram import calibration_weights

    cal = t.calibration
    calibration = None if cal is None else {
        "used": calibration_weights(t) is not None, "held_out_answers": cal.get("held_out_answers"), "judged_drafts": cal.get("judged_drafts"),
        "two_fold": cal.get("two_fold"), "constant": cal.get("constant")}
    return {"file": FILE_NAME, "format": t.meta.get("format"), "contexts": t.entries,
            "max_n": max(t.lengths, default=0), "answers": t.meta.get("answers"),
            "answer_tokens": t.meta.get("answer_tokens"), "calibration": calibration}


def cmd_inspect(args) -> int:
    from .manifest import read_manifest, verify_files
    from .strict_json import to_json_dict

    from .profile import load_profile
    from .telemetry import SystemReader

    m = read_manifest(args.engine)
    verify_files(m, args.engine, check_hashes=args.verify_hashes)
    prof, status = load_profile(args.engine)
    sources = SystemReader().sources()
    table = _ngram_table_summary(args.engine, m)
    from .pipeline import auto_drafter

    auto = {p: auto_drafter(m, p) for p in m.precisions("target", "onnxruntime")}  # onnxruntime on the CPU
    if args.json:
        print(json.dumps({**to_json_dict(m), "profile": {"status": status,
                                                         "device_key": prof.device_key if prof else None,
                                                         "created_utc": prof.created_utc if prof else None},
                          "ngram_table": table,
                          "auto_drafter": auto,
                          "telemetry_sources": sources,
                          "hashes_verified": bool(args.verify_hashes)}, indent=2))
        return 0
    print(f"engine     {args.engine} (schema v{m.schema_version}, created {m.created_utc})")
    print(f"model      {m.model.name} [{m.model.architecture}] {m.model.num_layers} layers, hidden "
          f"{m.model.hidden_size}, heads {m.model.num_heads}/{m.model.num_kv_heads}, vocab {m.model.vocab_size}")
    print(f"source     {m.model.source} (sha256 {m.model.source_sha256[:12]}…)")
    print(f"tokenizer  eos {list(m.tokenizer.eos_ids)}, bos {m.tokenizer.bos_id} (add_bos={m.tokenizer.add_bos}), "
          f"chat template: {'yes' if m.tokenizer.chat_template_file else 'no'}")
    print(f"hidden     layers {list(m.hidden_state_layers)} -> {m.io.hidden_states}")
    print(f"graph      {'portable (standard operators' if m.io.kv_layout == 'append' else 'fused (ONNX Runtime'}"
          f", KV layout {m.io.kv_layout})")
    for role in ("target", "drafter", "draft_model"):
        for p in m.precisions(role):
            for backend in sorted({v.backend for v in m.variants_for(role, p)}):
                vs = m.variants_for(role, p, backend)
                files = {v.file for v in vs}
                gpu = "  [GPU]" if any(v.device == "gpu" for v in vs) else ""
                print(f"{role:<10} {p:<5} {backend:<11} widths {list(m.widths(role, p, backend))}  "
                      f"{', '.join(sorted(files))}{gpu}")
    for e in m.tensorrt:
        print(f"tensorrt   {e.precision:<5} {e.file}: profiles {[w or 'prefill' for w in e.profiles]}, context "
              f"<= {e.max_context}, TensorRT {e.tensorrt_version}, built for {e.gpu} (compute {e.compute_capability})")
    for r in m.validation:
        print(f"validation {r.precision:<5} max|Δlogit| {r.max_abs_logit_diff:.2e}  greedy "
              f"{r.greedy_tokens_matched}/{r.greedy_tokens_compared}  top-1 {r.teacher_forced_top1:.0%}  "
              f"{'passed' if r.passed else 'FAILED'}")
    if m.drafter is not None:
        d = m.drafter
        print(f"drafter    dspark: {d.num_layers} layers, {d.slots} slots, draft vocab {d.draft_vocab}, Markov rank "
              f"{d.markov_rank}, calibrated T {' '.join(f'{t:.2f}' for t in d.temperatures)}"
              + (f", b {' '.join(f'{b:+.2f}' for b in d.biases)}" if d.biases else ""))
    if table is not None:
        print(f"ngram      corpus table {table['file']}: " + (
            f"{table['contexts']} contexts (up to {table['max_n']} tokens) from {table['answers']} answers"
            if "error" not in table else f"unusable: {table['error']}"))
        cal = table.get("calibration")
        if cal is None and "error" not in table:
            print("           confidences estimated online (the table has no calibration)")
        elif cal is not None:
            fit = cal.get("two_fold") or {}
            print(f"           calibrated confidences{'' if cal['used'] else ' (fitted for other features: unused)'}: "
                  f"{cal['judged_drafts']} held-out drafts, log-loss {fit.get('log_loss')} "
                  f"(constant {(cal.get('constant') or {}).get('log_loss')}), ECE {fit.get('ece')}, "
                  f"AUROC {fit.get('auroc')}")
    if auto:
        print("auto       --drafter auto picks " + ", ".join(f"{d} for the {p} target" for p, d in auto.items())
              + " (onnxruntime on the CPU)")
    if prof is None:
        from .profile import device_identity

        print(f"profile    {status} for this device ({device_identity()[0]}): the scheduler measures the verify "
              f"curve for a second at load; `python -m dspark_edge profile --engine {args.engine}` keeps one")
    else:
        print(f"profile    {status} ({prof.device_key}, {prof.created_utc})")
    print(f"telemetry  {', '.join(sources)}")
    total = sum(f.size for f in m.files)
    print(f"files      {len(m.files)}, {total / 2**20:.1f} MiB, "
          f"{'sha256 verified' if args.verify_hashes else 'sizes verified'}")
    for f in sorted(m.files, key=lambda f: f.path):
        print(f"           {f.sha256[:16]}  {f.size / 2**20:9.2f} MiB  {f.path}")
    return 0


def cmd_plot(args) -> int:
    from .errors import ConfigError
    from .metrics import read_trace, summarize
    from .plots import plot_timeline

    from .paths import output_file

    output_file(args.output, "plot")
    records = read_trace(args.trace)
    gens = sorted({r["generation"] for r in records if r["type"] == "round"})
    if not gens:
        raise ConfigError(f"{args.trace} holds no decoding rounds")
    try:
        gen = gens[args.generation]
    except IndexError:
        raise ConfigError(f"--generation {args.generation}: {args.trace} holds answers 0..{len(gens) - 1}") from None
    rounds = [r for r in records if r["type"] == "round" and r["generation"] == gen]
    drawn = plot_timeline(rounds, args.output, title=f"{args.trace} · answer {gen}")
    if args.json:
        print(json.dumps({"generation": gen, "series": drawn, **summarize(rounds)}, indent=1))
    print(f"[plot] {args.output}: answer {gen}, {len(rounds)} rounds, {', '.join(drawn)}", file=sys.stderr)
    return 0


def cmd_profile(args) -> int:
    from pathlib import Path

    from .profile import measure_profile, save_profile
    from .strict_json import to_json_dict

    from .errors import ConfigError

    try:
        contexts = tuple(int(c) for c in args.contexts.split(",") if c.strip())
    except ValueError:
        raise ConfigError(f"--contexts {args.contexts!r}: expected comma-separated integers, e.g. 64,512") from None
    if not contexts or min(contexts) < 1 or args.repeats < 1:
        raise ConfigError("--contexts needs positive depths and --repeats must be at least 1")
    if args.output_dir:
        from .paths import output_dir

        output_dir(args.output_dir, "profile folder")  # before measuring, not after
    prof = measure_profile(args.engine, contexts=contexts, reps=args.repeats,
                           progress=lambda m: print(f"[profile] {m}", file=sys.stderr, flush=True))
    path = save_profile(prof, Path(args.output_dir) if args.output_dir else None)
    if args.json:
        print(json.dumps(to_json_dict(prof), indent=1))
    print(f"[profile] wrote {path} (device {prof.device_key}; max temp {prof.max_temp_c}, "
          f"other load {prof.cpu_other_percent:.0f}%, throttled {prof.throttled})", file=sys.stderr)
    return 0


# The library's errors name its parameters; on the command line the fix is a flag.
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
    """``fn(*args)``'s exit code; a project error is one line on stderr and exit 2 (bad input),
    Ctrl-C exit 130, SIGTERM (with ``on_sigterm``) 143. Shared by this CLI and the scripts in
    bench/."""
    try:
        return fn(*args)
    except DSparkError as exc:
        print(f"error: {as_flags(str(exc))}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as Unix tools do
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Terminated:
        print("[terminated]", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("[interrupted]", file=sys.stderr)
        return 130


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.own_process = argv is None  # run as `python -m dspark_edge ...`: the process is the command's
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.own_process:
        on_sigterm()
    command = {"generate": cmd_generate, "chat": cmd_chat, "bench": cmd_bench, "inspect": cmd_inspect,
               "profile": cmd_profile, "plot": cmd_plot}[args.command]
    return run_reporting_errors(command, args)
