"""On-device demo: stream an answer from an engine folder with a live status panel.

    python examples/on_device_demo.py                      # embedded default, one prompt
    python examples/on_device_demo.py --chat               # interactive chat
    python examples/on_device_demo.py --prompt "..." --temperature 0.7 --seed 1

The panel shows the variant in use, speed, memory, CPU load and temperature as they
change. When stdout is not a terminal (or `rich` is missing) it prints plain lines.
It decodes speculatively with the engine's DSpark drafter when it has one (else the
model-free n-gram drafter); the confidence scheduler picks each round's verify width from the
drafts' calibrated confidences and the device's state, and the panel says what it chose and why.
--drafter none decodes plainly.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import psutil

import dspark_edge

DEFAULT_ENGINE = Path(__file__).resolve().parent.parent / "engines" / "smollm2-135m"
DEFAULT_PROMPT = "Explain in a few sentences why the sky is blue."


def device_readings(proc: psutil.Process) -> dict:
    vm = psutil.virtual_memory()
    temps = {}
    try:
        for name, entries in (psutil.sensors_temperatures() or {}).items():
            for e in entries:
                if e.current is not None and 0 < e.current < 150:
                    temps[f"{name}/{e.label or 'temp'}"] = e.current
    except (AttributeError, OSError):
        pass
    freq = psutil.cpu_freq()
    return {
        "rss_mib": proc.memory_info().rss / 2**20,
        "free_mib": vm.available / 2**20,
        "total_mib": vm.total / 2**20,
        "cpu_pct": psutil.cpu_percent(interval=None),
        "temp_c": max(temps.values()) if temps else None,
        "freq": (freq.current, freq.max) if freq and freq.max else None,
    }


def status_lines(pipe, tokens: int, elapsed: float, first_token_s: float | None, reading: dict,
                 last=None) -> list[tuple[str, str]]:
    t = pipe.target
    rate = (tokens - 1) / (elapsed - first_token_s) if first_token_s is not None and tokens > 1 and elapsed > first_token_s else 0.0
    temp = f"{reading['temp_c']:.0f} °C" if reading["temp_c"] is not None else "no sensor"
    freq = f"{reading['freq'][0]:.0f}/{reading['freq'][1]:.0f} MHz" if reading["freq"] else "n/a"
    return [
        ("model", pipe.manifest.model.name),
        ("drafter", pipe.drafter.name if pipe.drafter is not None else "none (plain decoding)"),
        ("variant", f"target {t.precision}, verify width {last.width if last else 1} of "
                    f"{', '.join(map(str, t.widths))}"),
        ("last round", f"{last.accepted}/{last.drafted} drafts accepted" if last else "…"),
        ("scheduler", (f"{last.decision.mode}: {last.decision.reason}" if last and last.decision
                       else "off (fixed rule)" if pipe.drafter is not None else "—")),
        ("confidence", " ".join(f"{c:.2f}" for c in last.confidence) if last and last.confidence else "—"),
        ("acceptance", f"{last.accepted_total}/{last.draft_n_total} "
                       f"({last.accepted_total / last.draft_n_total:.0%})" if last and last.draft_n_total else "—"),
        ("tokens", str(tokens)),
        ("speed", f"{rate:.1f} tok/s"),
        ("first token", f"{first_token_s * 1000:.0f} ms" if first_token_s is not None else "…"),
        ("RSS", f"{reading['rss_mib']:.0f} MiB"),
        ("free memory", f"{reading['free_mib']:.0f} / {reading['total_mib']:.0f} MiB"),
        ("CPU load", f"{reading['cpu_pct']:.0f} %"),
        ("CPU clock", freq),
        ("temperature", temp),
    ]


def run_once(pipe, prompt, cfg, live: bool) -> dspark_edge.GenerationResult:
    proc = psutil.Process()
    psutil.cpu_percent(interval=None)
    stream = pipe.stream(prompt, cfg)
    t0 = time.perf_counter()
    text, first = "", None
    if not live:
        for piece in stream:
            if first is None:
                first = time.perf_counter() - t0
            print(piece, end="", flush=True)
        print()
        r = stream.result
        reading = device_readings(proc)
        print("  ".join(f"{k}: {v}" for k, v in status_lines(pipe, len(r.token_ids), r.stats.total_s,
                                                                r.stats.prefill_s, reading, stream.last_round)))
        return r
    from rich.console import Group
    from rich.live import Live
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    def render(tokens, elapsed, reading):
        table = Table.grid(padding=(0, 2))
        for k, v in status_lines(pipe, tokens, elapsed, first, reading, stream.last_round):
            table.add_row(Text(k, style="bold cyan"), v)
        return Group(Panel(Text(text), title="answer", border_style="green"),
                     Panel(table, title="device & decoder", border_style="blue"))

    reading = device_readings(proc)
    last = 0.0
    with Live(render(0, 0.0, reading), refresh_per_second=8, transient=False) as view:
        for piece in stream:
            now = time.perf_counter() - t0
            if first is None:
                first = now
            text += piece
            if now - last > 0.25:
                reading, last = device_readings(proc), now
            view.update(render(len(stream.token_ids), now, reading))
        r = stream.result
        view.update(render(len(r.token_ids), r.stats.total_s, device_readings(proc)))
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default=str(DEFAULT_ENGINE), help="engine folder (default: %(default)s)")
    ap.add_argument("--precision", default=None, help="target precision (default: int8 when exported, else fp32)")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("--drafter", default=None,
                    help="'dspark' (default when the engine has one), 'ngram' (default otherwise), 'none' for "
                         "plain decoding, or a draft-model engine folder")
    ap.add_argument("--chat", action="store_true", help="interactive chat (empty line or Ctrl-D quits)")
    ap.add_argument("--max-new-tokens", type=int, default=200)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--plain", action="store_true", help="plain line output even on a terminal")
    args = ap.parse_args()

    live = sys.stdout.isatty() and not args.plain
    if live:
        try:
            import rich  # noqa: F401
        except ImportError:
            live = False
    try:
        manifest = dspark_edge.read_manifest(args.engine)
        precision = args.precision or ("int8" if "int8" in manifest.precisions("target") else None)
        drafter = args.drafter or ("dspark" if manifest.drafter is not None else "ngram")
        pipe = dspark_edge.load(args.engine, precision, drafter=drafter)
        cfg = dspark_edge.GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                           seed=args.seed)
        if not args.chat:
            print(f"> {args.prompt}")
            run_once(pipe, [{"role": "user", "content": args.prompt}], cfg, live)
            return 0
        history: list[dict] = []
        while True:
            try:
                line = input("you> ").strip()
            except EOFError:
                return 0
            if not line:
                return 0
            history.append({"role": "user", "content": line})
            r = run_once(pipe, history, cfg, live)
            history.append({"role": "assistant", "content": r.text})
    except dspark_edge.DSparkError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
