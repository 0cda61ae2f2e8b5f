"""``plot``: the timeline PNG of one answer of a trace."""

from __future__ import annotations

import json
import sys



def register(sub) -> None:
    """Add the ``plot`` command to the subparsers ``sub``."""
    pl = sub.add_parser("plot", help="draw the timeline PNG of a trace written with --trace",
                        description="Width, acceptance, tok/s and telemetry per round of one answer of a trace.")
    pl.add_argument("trace", help="JSON-lines trace (generate/chat --trace, or the demo's --trace)")
    pl.add_argument("output", help="PNG to write")
    pl.add_argument("--generation", type=int, default=-1,
                    help="which answer of the trace (0-based; default: the last)")
    pl.add_argument("--json", action="store_true", help="print the answer's summary (acceptance, widths, …) as JSON")


def cmd_plot(args) -> int:
    from ..errors import ConfigError
    from ..metrics import read_trace, summarize
    from ..plots import plot_timeline

    from ..paths import output_file

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
