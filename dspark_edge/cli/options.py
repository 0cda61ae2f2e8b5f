"""The options the commands share (engine, backend, scheduler, generation, outputs), loading
with them, and progress on stderr."""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import replace

from ..backends import BackendOptions
from ..config import GenerationConfig
from ..errors import ConfigError
from ..grammar import MAX_GRAMMAR_CHARS, Grammar
from ..drafters import spec as drafter_spec


def engine_args(p: argparse.ArgumentParser, auto_precision: bool = False) -> None:
    """``auto_precision``: the command decodes, and ``--precision`` defaults to "auto"."""
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                   help="log details to stderr (also accepted before the command)")
    p.add_argument("--engine", required=True, help="engine folder written by `python -m export target`")
    if auto_precision:
        p.add_argument("--precision", default="auto",
                       help="target precision to load; 'auto' (default): of the precisions whose output is the "
                            "model's own (the most precise, and an int4 graph made from a GGUF's own blocks), the "
                            "one of the fastest mode raced on this device (`profile --modes-only`), else the "
                            "most precise")
    else:
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


def scheduler_config(args):
    import dataclasses

    from ..scheduler import SchedulerConfig

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
    from ..errors import ConfigError

    opts: dict[str, dict[str, str]] = {p: {} for p in providers}
    for item in items:
        name, _, kv = item.partition(":")
        key, _, value = kv.partition("=")
        if not key or not _ or name not in opts:
            raise ConfigError(f"--provider-option {item!r}: expected PROVIDER:KEY=VALUE with PROVIDER one of "
                              f"--providers {list(providers)}")
        opts[name][key] = value
    return tuple(opts[p] for p in providers) if items else ()


def backend_options(args) -> BackendOptions:
    providers = tuple(p.strip() for p in args.providers.split(",") if p.strip())
    return BackendOptions(providers=providers, provider_options=provider_options(providers, args.provider_option),
                          intra_op_threads=args.threads, max_context=args.max_context,
                          fallback_to_cpu=args.fallback_to_cpu, device_id=args.device_id)


def load_engine(args, drafter=None, shared_threads: bool = False):
    from ..drafters.spec import own_model
    from ..pipeline import load

    options = backend_options(args)
    if getattr(args, "own_process", False) and (shared_threads or own_model(drafter)):
        # The target and a drafter with a graph of its own take turns on one thread pool. Only
        # when this is the process's command line: the pool is process-wide for good, and
        # onnxruntime then refuses sessions with pools of their own (code that calls ``main``
        # in its own process, a test for one, may open such sessions afterwards).
        options = replace(options, shared_threads=True)
    import time

    t0 = time.perf_counter()
    wanted = {None: "at its most precise", "auto": "auto (the fastest exact mode raced here)"}.get(args.precision,
                                                                                               args.precision)
    print(f"[load] {args.engine}: target {wanted}, drafter {drafter or 'none'}"
          f"{'' if args.no_verify_hashes else ', checking file hashes'}", file=sys.stderr, flush=True)
    pipe = load(args.engine, args.precision, drafter=drafter, backend=args.backend, options=options,
                verify_hashes=not args.no_verify_hashes, scheduler=scheduler_config(args),
                chat_template=getattr(args, "chat_template", None), requests=getattr(args, "parallel", 1))
    print(f"[load] ready in {time.perf_counter() - t0:.1f} s: target {pipe.target.precision}, drafter "
          f"{pipe.drafter.name if pipe.drafter is not None else 'none'}"
          + (f" ({pipe.mode_reason})" if pipe.mode_reason else ""), file=sys.stderr, flush=True)
    return pipe


def generation_args(p: argparse.ArgumentParser, max_new_tokens: int) -> None:
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
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="lower the logit of every token the answer holds already by this (-2 to 2; 0 = off)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="lower a token's logit by this once per time the answer holds it (-2 to 2; 0 = off)")
    p.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                   help="add BIAS (-100 to 100) to token ID's logit (repeatable)")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--json-object", action="store_true",
                       help="structured output: the answer is a JSON object (needs llguidance: "
                            "pip install 'dspark-edge[structured]')")
    shape.add_argument("--json-schema", default=None, metavar="FILE",
                       help="structured output: the answer is JSON that the schema in FILE accepts")
    shape.add_argument("--regex", default=None, metavar="PATTERN",
                       help="structured output: the answer matches PATTERN whole")
    shape.add_argument("--grammar", default=None, metavar="FILE",
                       help="structured output: the answer follows the grammar in FILE, llama.cpp's GBNF "
                            "(root ::= ...) or llguidance's Lark (start: ...)")
    p.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="with --json: each new token's log-probability under the model and the K likeliest "
                        "tokens there (0-20)")
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


def grammar_of(args) -> Grammar | None:
    """The structured-output option given, as a ``Grammar`` (its file read, size-bounded)."""
    if getattr(args, "json_object", False):
        return Grammar.json()
    if getattr(args, "regex", None) is not None:
        return Grammar.regex(args.regex)
    for name in ("json_schema", "grammar"):
        path = getattr(args, name, None)
        if path is None:
            continue
        flag = "--" + name.replace("_", "-")
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_GRAMMAR_CHARS + 1)
            text = data.decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{flag} {path}: cannot read it as UTF-8 text ({exc})") from None
        if len(data) > MAX_GRAMMAR_CHARS:
            raise ConfigError(f"{flag} {path}: larger than {MAX_GRAMMAR_CHARS} bytes")
        if name == "json_schema":
            return Grammar.json(text)
        # GBNF names its start rule root ::=; Lark (llguidance's dialect) start:
        return Grammar.gbnf(text) if re.search(r"^\s*root\s*::=", text, re.M) else Grammar.lark(text)
    return None


def generation_config(args) -> GenerationConfig:
    if args.logprobs is not None and not getattr(args, "json", False):
        raise ConfigError("--logprobs needs --json: the log-probabilities come in the JSON record")
    bias = {}
    for item in args.logit_bias:
        key, sep, value = item.partition("=")
        try:
            if not sep:
                raise ValueError
            token, amount = int(key), float(value)
        except ValueError:
            raise ConfigError(f"--logit-bias {item!r}: expected ID=BIAS, e.g. --logit-bias 2=-100") from None
        if token in bias:
            raise ConfigError(f"--logit-bias names token {token} twice")
        bias[token] = amount
    return GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, stop=tuple(args.stop), draft_tokens=args.draft_tokens,
                            context_policy=args.context_policy, sampling=args.sampling, logprobs=args.logprobs,
                            presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                            logit_bias=bias, grammar=grammar_of(args))


def check_outputs(args) -> None:
    """The --trace / --prometheus / --plot paths, checked before the engine loads."""
    from ..paths import output_file

    for option in ("trace", "prometheus", "plot"):
        path = getattr(args, option, None)
        if path:
            output_file(path, f"--{option}")


class Outputs:
    """The --trace / --prometheus / --plot outputs of generate and chat (their paths checked by
    ``check_outputs`` before loading), as one pipeline observer.
    A write that fails (disk full) is kept in ``error`` and stops those outputs; ``close()``
    raises it, so the command ends with exit 2 after the answer it printed."""

    def __init__(self, pipe, args) -> None:
        from ..metrics import PrometheusMetrics, TraceWriter

        self.args, self.rounds, self.error = args, [], None
        self.title = (f"{pipe.manifest.model.name} · target {pipe.target.precision} · drafter "
                      f"{pipe.drafter.name if pipe.drafter is not None else 'none'}")
        self.trace = TraceWriter(args.trace, label=f"{args.command} {args.engine}") if args.trace else None
        self.prom = PrometheusMetrics() if args.prometheus else None
        if args.trace or args.plot or args.prometheus:
            pipe.start_telemetry()
        pipe.add_observer(self)

    def _guarded(self, fn, *a) -> None:
        from ..errors import OutputError

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
        from ..plots import plot_timeline

        drawn = plot_timeline(self.rounds, self.args.plot, title=self.title)
        print(f"[plot] {self.args.plot}: {', '.join(drawn)}", file=sys.stderr)

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()
        if self.error is not None:
            raise self.error


class Progress:
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
