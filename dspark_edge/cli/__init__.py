"""``python -m dspark_edge`` (installed: ``dspark-edge``): one module per command, the options
they share in ``options``, and how a command ends in ``errors``.

Exit codes: 0 success, 1 generation failed mid-way (partial output printed) or a drafter
failed during a benchmark, 2 bad input (engine folder, options, prompt, an output that cannot
be written), 130 interrupted (Ctrl-C), 141 the reader went away, 143 terminated (SIGTERM).
"""

from __future__ import annotations

import argparse
import logging
import sys

from .. import __version__
from . import bench, chat, generate, inspect, plot, profile, serve
from .errors import Terminated, as_flags, on_sigterm, run_reporting_errors
from .generate import answer, result_json
from .options import provider_options

__all__ = ["Terminated", "answer", "as_flags", "build_parser", "main", "on_sigterm", "provider_options",
           "result_json", "run_reporting_errors"]

COMMANDS = {"generate": generate, "chat": chat, "serve": serve, "bench": bench, "profile": profile, "inspect": inspect,
            "plot": plot}


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
    for module in COMMANDS.values():
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.own_process = argv is None  # run as `python -m dspark_edge ...`: the process is the command's
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.own_process:
        on_sigterm()
    command = getattr(COMMANDS[args.command], f"cmd_{args.command}")
    return run_reporting_errors(command, args)
