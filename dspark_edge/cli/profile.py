"""``profile``: measure this device's cost of every variant of an engine."""

from __future__ import annotations

import json
import sys



def register(sub) -> None:
    """Add the ``profile`` command to the subparsers ``sub``."""
    pr = sub.add_parser("profile", help="measure this device's cost of every variant of an engine",
                        description="Time the target at every verify width and the drafter at every block size "
                                    "(warm-up, median of repeats, at several context depths), and the pass cost "
                                    "table of a server batching --slots requests, race the decoding modes whose "
                                    "output is the model's own (for --precision auto), and write "
                                    "<device-key>.json to the user's profile folder (or --output-dir / "
                                    "DSPARK_PROFILES), which the scheduler loads automatically.")
    pr.add_argument("--engine", required=True, help="engine folder to profile")
    pr.add_argument("--contexts", default="64,512", help="context depths (default: %(default)s)")
    pr.add_argument("--repeats", type=int, default=9, help="timed repeats per variant (default: %(default)s)")
    pr.add_argument("--slots", default="2,4,8",
                    help="request counts whose slots-graph pass cost table T(n) to measure, for serve --parallel N "
                         "(a second session of the target per count, one at a time; '' for none; default: "
                         "%(default)s)")
    pr.add_argument("--output-dir", default=None, help="where to write (default: DSPARK_PROFILES, else the user's profile folder, "
                        "~/.local/share/dspark_edge/profiles)")
    pr.add_argument("--json", action="store_true", help="print the profile as JSON")
    modes = pr.add_mutually_exclusive_group()
    modes.add_argument("--modes-only", action="store_true",
                       help="only race the decoding modes whose output is the model's own (each such precision, "
                            "plainly and with its drafter), for --precision auto; the profile's other timings "
                            "are kept (about a minute)")
    modes.add_argument("--no-modes", action="store_true", help="time the variants but do not race the modes")


def cmd_profile(args) -> int:
    from pathlib import Path

    from ..profile import measure_profile, save_profile
    from ..strict_json import to_json_dict

    from ..errors import ConfigError

    try:
        contexts = tuple(int(c) for c in args.contexts.split(",") if c.strip())
    except ValueError:
        raise ConfigError(f"--contexts {args.contexts!r}: expected comma-separated integers, e.g. 64,512") from None
    if not contexts or min(contexts) < 1 or args.repeats < 1:
        raise ConfigError("--contexts needs positive depths and --repeats must be at least 1")
    try:
        slots = tuple(int(c) for c in args.slots.split(",") if c.strip())
    except ValueError:
        raise ConfigError(f"--slots {args.slots!r}: expected comma-separated request counts, e.g. 2,4,8") from None
    if any(c < 2 for c in slots):
        raise ConfigError(f"--slots {args.slots!r}: a slots graph batches 2 or more requests")
    if args.output_dir:
        from ..paths import output_dir

        output_dir(args.output_dir, "profile folder")  # before measuring, not after
    say = lambda m: print(f"[profile] {m}", file=sys.stderr, flush=True)  # noqa: E731
    folder = Path(args.output_dir) if args.output_dir else None
    # The modes race on the process-wide pool, as the command line decodes, only when the process is
    # the command's own (the pool is for good; see load_engine).
    from ..backends import BackendOptions

    mode_options = BackendOptions(shared_threads=True) if getattr(args, "own_process", False) else None
    if args.modes_only:
        from ..modes import race_and_save
        from ..profile import read_profile

        path = race_and_save(args.engine, progress=say, folder=folder, options=mode_options)
        prof = read_profile(path)
    else:
        prof = measure_profile(args.engine, contexts=contexts, reps=args.repeats, slots=slots, progress=say,
                               modes=not args.no_modes, mode_options=mode_options)
        path = save_profile(prof, folder)
    if args.json:
        print(json.dumps(to_json_dict(prof), indent=1))
    print(f"[profile] wrote {path} (device {prof.device_key}; max temp {prof.max_temp_c}, "
          f"other load {prof.cpu_other_percent:.0f}%, throttled {prof.throttled})", file=sys.stderr)
    return 0


# The library's errors name its parameters; on the command line the fix is a flag.
