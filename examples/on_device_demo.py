"""On-device demo: stream an answer from an engine folder with a live status panel.

    python examples/on_device_demo.py                      # embedded default, one prompt
    python examples/on_device_demo.py --chat               # interactive chat
    python examples/on_device_demo.py --race               # plain vs speculative, side by side
    python examples/on_device_demo.py --plot timeline.png --trace rounds.jsonl
    python examples/on_device_demo.py --prompt "..." --temperature 0.7 --seed 1

The answer streams with the tokens that came from accepted drafts underlined in green. The
panel, updated every round, shows the variant in use (verify width, precision), the drafts'
calibrated confidences, the accepted length, speed, free memory and RSS, temperature and
throttling, CPU (and GPU) load, and what the confidence scheduler chose and why, with its
latest switches (hot, parked, probing, gate). It decodes in the mode `--precision auto` and
`--drafter auto` pick: of the target precisions whose output is the model's own (the most precise,
and an int4 graph made from a GGUF's own 4-bit blocks), plainly or with the drafter the rule
names for each (`ngram+self` for a target above INT8 on the CPU: n-gram lookup with the engine's
INT8 graph drafting beside it; else the engine's DSpark drafter; else n-gram lookup), the
fastest mode raced on this device. The race runs once, first, when the engine has two such
precisions and this device's profile has none (`python -m dspark_edge profile --modes-only`
runs it again); the panel's "mode" line says why the mode was chosen. --race compares plain
and speculative decoding of the most precise target (or --precision); --drafter none decodes
plainly. When stdout is not a terminal (or `rich`
is missing) it prints plain lines.

--race decodes the same prompt plainly and speculatively in turns (whichever has used less
time goes next, so both get the same share of this machine) and reports the speedup of their
measured rates. --plot writes a timeline of width, acceptance, tok/s and telemetry per round;
--trace writes one JSON line per round (see dspark_edge.metrics).
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import time
from pathlib import Path

import dspark_edge
from dspark_edge.cli.chat import fit_history
from dspark_edge.cli.errors import exit_code
from dspark_edge.metrics import TraceWriter
from dspark_edge.paths import output_file
from dspark_edge.drafters import spec as drafter_spec
from dspark_edge.drafters.spec import own_model
from dspark_edge.modes import needs_race
from dspark_edge.tokenizer import IncrementalDecoder

DEFAULT_ENGINE = Path(__file__).resolve().parent.parent / "engines" / "smollm2-135m"
DEFAULT_PROMPT = "Explain in a few sentences why the sky is blue."
DRAFT_STYLE = "underline green"


class Run:
    """One generation as the demo sees it: the stream, its own time, the rounds, the styled text."""

    def __init__(self, pipe, prompt, cfg, label: str) -> None:
        self.pipe, self.label = pipe, label
        self.rounds: list = []  # RoundInfo of this generation, from the observer
        self.events: list[str] = []  # scheduler switches, newest last
        pipe.add_observer(self)
        self.stream = pipe.stream(prompt, cfg)
        self.detok = IncrementalDecoder(pipe.tokenizer)
        self.pieces: list[tuple[str, bool]] = []  # (text, came from an accepted draft)
        self.rendered = 0
        self.spent = 0.0  # seconds this run itself computed (a race interleaves two)
        self.first_token_s: float | None = None
        self.done = False
        self.error: str | None = None

    # observer: called by the pipeline after each round
    def on_round(self, info) -> None:
        prev = self.rounds[-1] if self.rounds else None
        self.rounds.append(info)
        d, pd = info.decision, (prev.decision if prev else None)
        if d is not None and pd is not None and (d.mode != pd.mode or d.width != pd.width):
            mode = f"{pd.mode}→{d.mode}" if d.mode != pd.mode else d.mode
            width = f"width {pd.width}→{d.width}" if d.width != pd.width else f"width {d.width}"
            self.events.append(f"round {info.index}: {mode}, {width} ({d.reason})")
            del self.events[:-3]

    def advance(self) -> bool:
        """Decode up to the next text piece; False once the generation has ended."""
        if self.done:
            return False
        t = time.perf_counter()
        try:
            next(self.stream)
        except StopIteration:
            self.done = True
        except dspark_edge.GenerationError as exc:
            self.done, self.error = True, str(exc)
        self.spent += time.perf_counter() - t
        if self.first_token_s is None and self.stream.token_ids:
            self.first_token_s = self.spent
        ids, marks = self.stream.token_ids, self.stream.from_draft
        for i in range(self.rendered, len(ids)):
            piece = self.detok.push([ids[i]])
            if piece:
                self.pieces.append((piece, marks[i]))
        self.rendered = len(ids)
        if self.done:
            self.pipe.remove_observer(self)
            tail = self.detok.flush()
            if tail:
                self.pieces.append((tail, False))
        return not self.done

    @property
    def text(self) -> str:
        return "".join(p for p, _ in self.pieces)

    @property
    def rate(self) -> float:
        """Decode speed in this run's own time: tokens after the first over the time after it."""
        n, t = len(self.stream.token_ids), self.spent - (self.first_token_s or 0.0)
        return (n - 1) / t if n > 1 and t > 0 else 0.0


def fmt_reading(snap) -> dict[str, str]:
    if snap is None:
        return {"memory": "n/a", "CPU load": "n/a", "temperature": "n/a"}
    temp = snap.max_temp_c
    out = {
        "memory": f"{snap.mem_available_mb:.0f} MiB free of {snap.mem_total_mb:.0f} · RSS {snap.rss_mb:.0f} MiB",
        "CPU load": f"{snap.cpu_percent:.0f} % (other processes {snap.cpu_other_percent:.0f} %)"
                    + (f" · clock {snap.cpu_freq_mhz:.0f}/{snap.cpu_freq_max_mhz:.0f} MHz"
                       if snap.cpu_freq_mhz and snap.cpu_freq_max_mhz else ""),
        "temperature": (f"{temp:.0f} °C" if temp is not None else "no sensor")
                       + (f" · THROTTLING ({snap.throttle_source})" if snap.throttling else " · not throttled"),
    }
    if snap.gpu is not None:
        g = snap.gpu
        out["GPU"] = (f"{g.util_percent:.0f} % · {g.mem_used_mb:.0f}/{g.mem_total_mb:.0f} MiB"
                      + (f" · {g.temp_c:.0f} °C" if g.temp_c is not None else ""))
    return out


def status_fields(run: Run) -> list[tuple[str, str]]:
    pipe, last = run.pipe, (run.rounds[-1] if run.rounds else None)
    t = pipe.target
    drafter = pipe.drafter.name if pipe.drafter is not None else "none (plain decoding)"
    tokens = len(run.stream.token_ids)
    fields = [
        ("model", f"{pipe.manifest.model.name} · drafter {drafter}"),
        ("variant", f"target {t.precision} · verify width {last.width if last else 1} "
                    f"(listed {', '.join(map(str, t.widths))})"),
        ("mode", pipe.mode_reason or "as asked"),
        ("confidence", " ".join(f"{c:.2f}" for c in last.confidence) if last and last.confidence else "—"),
        ("accepted", (f"{last.accepted}/{last.drafted} this round · "
                      f"{last.accepted_total}/{last.draft_n_total} "
                      f"({last.accepted_total / last.draft_n_total:.0%}) overall")
                     if last and last.draft_n_total else (f"{last.accepted}/{last.drafted} this round" if last else "—")),
        ("speed", f"{run.rate:.1f} tok/s · {tokens} tokens"
                  + (f" · first token {run.first_token_s * 1000:.0f} ms" if run.first_token_s is not None else "")),
    ]
    fields += list(fmt_reading(last.telemetry if last and last.telemetry else pipe.telemetry()).items())
    if last is not None and last.decision is not None:
        d = last.decision
        fields.append(("scheduler", f"{d.mode}: {d.reason}"))
    else:
        fields.append(("scheduler", "fixed draft length" if pipe.drafter is not None else "— (no drafter)"))
    for e in run.events:
        fields.append(("switch", e))
    return fields


def final_line(run: Run) -> str:
    r = run.stream.result
    if r is None:
        return f"[{run.label}: {run.error or 'no result'}]"
    s = r.stats
    extra = (f", {s.draft_n_accepted}/{s.draft_n} drafts accepted, mean accepted length {s.mean_accepted_length:.2f}"
             if s.draft_n else "")
    if s.prompt_reused:  # a chat turn started from the conversation's kept K/V
        extra += f", {s.prompt_reused}/{s.prompt_tokens} prompt tokens reused ({s.prefill_s * 1000:.0f} ms prefill)"
    return f"[{run.label}: {s.new_tokens} tokens, {run.rate:.1f} tok/s, stop: {r.stop_reason}{extra}]"


# -- live (rich) ---------------------------------------------------------------------------------
def live_view(runs: list[Run], status_run: Run):
    from rich.columns import Columns
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    def answer(run: Run):
        text = Text()
        for piece, drafted in run.pieces:
            text.append(piece, style=DRAFT_STYLE if drafted else None)
        return Panel(text, title=f"{run.label} · {run.rate:.1f} tok/s", border_style="green")

    def render():
        table = Table.grid(padding=(0, 2))
        for k, v in status_fields(status_run):
            table.add_row(Text(k, style="bold cyan"), Text(v))
        answers = answer(runs[0]) if len(runs) == 1 else Columns([answer(r) for r in runs], equal=True, expand=True)
        parts = [answers, Panel(table, title=f"device & decoder ({status_run.label})", border_style="blue")]
        if len(runs) == 2:
            parts.append(Text(race_line(runs), style="bold"))
        parts.append(Text("underlined green: tokens from accepted drafts", style="dim"))
        return Group(*parts)

    return render


def race_line(runs: list[Run]) -> str:
    plain, spec = runs
    speed = f"{spec.rate / plain.rate:.2f}×" if plain.rate > 0 and spec.rate > 0 else "…"
    line = f"speculative {spec.rate:.1f} tok/s vs plain {plain.rate:.1f} tok/s → speedup {speed} (same prompt, turns)"
    if plain.done and spec.done:
        same = plain.stream.token_ids == spec.stream.token_ids
        line += " · identical tokens" if same else " · tokens differ"
    return line


def drive(runs: list[Run], render=None, view=None) -> None:
    """Advance the runs in turns, the one that has used less time first, until all end."""
    last_draw = 0.0
    while True:
        live = [r for r in runs if not r.done]
        if not live:
            break
        min(live, key=lambda r: r.spent).advance()
        if view is not None and time.perf_counter() - last_draw > 0.1:
            view.update(render())
            last_draw = time.perf_counter()
    if view is not None:
        view.update(render())


def run_prompt(pipe, prompt, cfg, live: bool, race: bool) -> Run:
    spec = Run(pipe, prompt, cfg, "speculative" if pipe.drafter is not None else "plain")
    runs = [spec]
    if race:
        runs = [Run(pipe.twin(), prompt, cfg, "plain"), spec]
    if live:
        from rich.live import Live

        render = live_view(runs, spec)
        with Live(render(), refresh_per_second=10, transient=False) as view:
            drive(runs, render, view)
    else:
        if race:
            drive(runs)
            for r in runs:
                print(f"--- {r.label}\n{r.text}")
        else:
            printed, more = 0, True
            while more:
                more = spec.advance()
                print("".join(p for p, _ in spec.pieces[printed:]), end="", flush=True)
                printed = len(spec.pieces)
            print()
        for k, v in status_fields(spec):
            print(f"{k:>12}: {v}")
        if race:
            print(race_line(runs))
    for r in runs:
        print(final_line(r), file=sys.stderr)
    if spec.error is not None:
        raise dspark_edge.GenerationError(spec.error, partial=spec.stream.result)
    return spec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default=str(DEFAULT_ENGINE), help="engine folder (default: %(default)s)")
    ap.add_argument("--precision", default="auto",
                    help="target precision; 'auto' (default, as in `python -m dspark_edge generate`): of the "
                         "precisions whose output is the model's own, the one of the fastest mode raced on this "
                         "device (raced once, first); with --race, the most precise. INT8 decodes faster but is "
                         "not the model's own output, and its width-dependent rounding makes speculative INT8 "
                         "output drift from plain INT8 output")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT, help="the question (default: %(default)r)")
    ap.add_argument("--drafter", default=None,
                    help=f"'auto' (default) or another drafter: {drafter_spec.describe()}")
    ap.add_argument("--chat", action="store_true", help="interactive chat (empty line or Ctrl-D quits)")
    ap.add_argument("--race", action="store_true",
                    help="decode plainly and speculatively side by side and report the speedup")
    ap.add_argument("--plot", default=None, metavar="PNG",
                    help="write a timeline of width, acceptance, tok/s and telemetry per round (matplotlib)")
    ap.add_argument("--trace", default=None, metavar="JSONL", help="write one JSON line per round and a summary")
    ap.add_argument("--max-new-tokens", type=int, default=200, help="answer length limit (default: %(default)s)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible answers)")
    ap.add_argument("--sampling", choices=("rejection", "coupled"), default="rejection",
                    help="draft verification when sampling; 'coupled' makes the answer depend on the seed alone, "
                         "so --race shows identical sampled answers")
    ap.add_argument("--plain", action="store_true", help="plain line output even on a terminal")
    ap.add_argument("--backend", choices=("onnxruntime", "tensorrt"), default="onnxruntime",
                    help="run the target on ONNX Runtime or on TensorRT engines (`python -m export trt`; "
                         "default: %(default)s)")
    ap.add_argument("--providers", default="CPUExecutionProvider",
                    help="comma-separated onnxruntime execution providers, e.g. "
                         "CUDAExecutionProvider,CPUExecutionProvider (default: %(default)s)")
    args = ap.parse_args()
    # The library logs; shown as the command line shows them (warnings and up, named).
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    live = sys.stdout.isatty() and not args.plain
    if live:
        try:
            import rich  # noqa: F401
        except ImportError:
            live = False
    trace = None
    try:
        for option, path in (("--plot", args.plot), ("--trace", args.trace)):
            if path:
                output_file(path, option)  # before the engine loads
        manifest = dspark_edge.read_manifest(args.engine)
        providers = tuple(p for p in args.providers.split(",") if p)
        drafter = args.drafter or "auto"
        # The same defaults as `python -m dspark_edge generate`: precision and drafter "auto". A race
        # compares plain and speculative decoding of one target: the most precise, unless named.
        precision = None if args.race and args.precision == "auto" else args.precision
        if args.race and drafter == "none":
            raise dspark_edge.ConfigError("--race compares plain and speculative decoding: give a drafter, "
                                          "not --drafter none")
        if precision == "auto" and args.backend == "onnxruntime" and needs_race(manifest, args.engine,
                                                                                providers=providers):
            print(f"[demo] racing the exact decoding modes of {args.engine} on this device, once (about a "
                  "minute): each precision whose output is the model's own, plainly and with its drafter",
                  file=sys.stderr, flush=True)
            # In a process of its own: the race's sessions and their memory go with it.
            race = subprocess.run([sys.executable, "-m", "dspark_edge", "profile", "--engine", str(args.engine),
                                   "--modes-only"])
            if race.returncode != 0:
                print("[demo] the race failed (above); decoding in the rule's mode instead", file=sys.stderr, flush=True)
        # A drafter with a graph of its own shares the target's thread pool (BackendOptions.shared_threads).
        options = dspark_edge.BackendOptions(providers=providers,
                                             shared_threads=own_model(drafter))
        pipe = dspark_edge.load(args.engine, precision, drafter=None if drafter == "none" else drafter,
                                backend=args.backend, options=options)
        pipe.start_telemetry()
        if args.trace:
            name = pipe.drafter.name if pipe.drafter is not None else "none"
            trace = TraceWriter(args.trace, label=f"demo {manifest.model.name} drafter {name}")
            pipe.add_observer(trace)
        # In a chat each turn starts from the K/V of the conversation so far (its new message is
        # all it prefills), as `python -m dspark_edge chat` does.
        cfg = dspark_edge.GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                           seed=args.seed, sampling=args.sampling, reuse_prefix=args.chat)
        history: list[dict] = []
        while True:
            if args.chat:
                try:
                    line = input("you> ").strip()
                except EOFError:
                    break
                if not line:
                    break
            else:
                line = args.prompt
                print(f"> {line}")
            history.append({"role": "user", "content": line})
            try:  # the oldest exchanges make room, as in `python -m dspark_edge chat`
                history = fit_history(pipe, [], history, cfg)
            except dspark_edge.PromptError as exc:
                print(f"[{exc}]", file=sys.stderr)
                history.pop()
                if not args.chat:
                    return exit_code(exc)
                continue
            run = run_prompt(pipe, history, cfg, live, args.race)
            history.append({"role": "assistant", "content": run.text})
            if args.plot:
                from dspark_edge.plots import plot_timeline

                series = plot_timeline([r.as_dict() for r in run.rounds], args.plot,
                                       title=f"{manifest.model.name} · {pipe.drafter.name if pipe.drafter else 'plain'}"
                                             f" · {pipe.target.precision}")
                print(f"[plot: {args.plot} ({', '.join(series)})]", file=sys.stderr)
            if not args.chat:
                break
        return 0
    except (dspark_edge.DSparkError, BrokenPipeError, KeyboardInterrupt) as exc:
        return exit_code(exc)  # the command line's exit codes and messages
    finally:
        if trace is not None:
            trace.close()


if __name__ == "__main__":
    sys.exit(main())
