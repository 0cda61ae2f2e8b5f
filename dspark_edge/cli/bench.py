"""``bench``: plain decoding against drafters over the prompt set, interleaved (JSON report)."""

from __future__ import annotations

import json
import sys

from ..config import GenerationConfig
from ..drafters import spec as drafter_spec
from ..errors import ConfigError

from .options import Progress, backend_options, engine_args, load_engine


def register(sub) -> None:
    """Add the ``bench`` command to the subparsers ``sub``."""
    b = sub.add_parser("bench", help="benchmark generation over a prompt set and the verify cost curve (JSON)")
    engine_args(b)
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


def cmd_bench(args) -> int:
    from ..bench import bench_generation, load_prompts, verify_cost_curve

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
    from ..drafters.spec import own_model

    if "auto" in specs:
        # "auto" stands for the rule's drafter at the benchmarked precision (a comparison needs a
        # drafter; load()'s "auto" may pick plain decoding where a race found it fastest).
        from ..manifest import read_manifest
        from ..pipeline import auto_drafter

        m = read_manifest(args.engine)
        precision = args.precision or (m.precisions("target", args.backend) or [None])[0]
        specs = [auto_drafter(m, precision, args.backend, backend_options(args).providers) if s == "auto" else s
                 for s in specs]
        if len(set(specs)) != len(specs):
            raise ConfigError(f"--drafter lists a drafter twice once 'auto' is resolved: {', '.join(specs)}")
    pipe = load_engine(args, drafter=specs[0] if specs else None, shared_threads=any(map(own_model, specs)))
    widths = pipe.target.widths
    if args.depth + max(widths) > pipe.target.capacity:
        raise ConfigError(f"--depth {args.depth}: with the widest verify width {max(widths)} it exceeds the context "
                          f"of {pipe.target.capacity} tokens; give --depth at most {pipe.target.capacity - max(widths)} "
                          "or a larger --max-context")
    listed = [w - 1 for w in widths if w > 1]
    missing = sorted(set(asked_ks or ()) - set(listed))
    if missing:
        raise ConfigError(f"--draft-tokens {args.draft_tokens}: this engine verifies {listed} drafts per round "
                          f"(its widths {list(widths)} minus the anchor); {missing} "
                          f"{'is' if len(missing) == 1 else 'are'} not among them")
    bar = Progress("bench", len(prompts) * args.passes)

    def progress(done, total, row):
        bar.update(done, f"{row['id']}: {row['tokens_per_s']} tok/s")

    m = pipe.manifest
    report = {"engine": str(args.engine), "model": m.model.name, "precision": pipe.target.precision,
              "providers": list(pipe.target.session.providers)}
    if args.drafter:
        from ..bench import bench_compare

        from ..drafters import create
        from ..pipeline import drafter_backend_options

        ks = asked_ks or listed
        drafters = [(specs[0] if len(specs) > 1 else pipe.drafter.name, pipe.drafter)]  # the first: loaded with the target
        drafters += [(spec, create(spec, m, options=drafter_backend_options(spec, backend_options(args)),
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
