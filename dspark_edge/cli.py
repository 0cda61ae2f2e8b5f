"""``python -m dspark_edge``: generate, bench and inspect from the command line.

Exit codes: 0 success, 1 generation failed mid-way (partial output printed), 2 bad input
(engine folder, options, prompt).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from . import __version__
from .backends import BackendOptions
from .config import GenerationConfig
from .errors import DSparkError, GenerationError


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", required=True, help="engine folder written by `python -m export target`")
    p.add_argument("--precision", default=None, help="target precision to load (default: the most precise exported)")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads (default: onnxruntime's choice)")
    p.add_argument("--max-context", type=int, default=2048, help="KV cache size in tokens (default: %(default)s)")
    p.add_argument("--no-verify-hashes", action="store_true", help="check file sizes only, not sha256 (faster start)")
    p.add_argument("--providers", default="CPUExecutionProvider",
                   help="comma-separated onnxruntime execution providers in priority order (default: %(default)s); "
                        "an unavailable one is an error unless --fallback-to-cpu")
    p.add_argument("--fallback-to-cpu", action="store_true",
                   help="use the CPU provider (logged) when a requested provider is unavailable")
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


def _load(args, drafter=None):
    from .pipeline import load

    options = BackendOptions(providers=tuple(p.strip() for p in args.providers.split(",") if p.strip()),
                             intra_op_threads=args.threads, max_context=args.max_context,
                             fallback_to_cpu=args.fallback_to_cpu)
    return load(args.engine, args.precision, drafter=drafter, options=options,
                verify_hashes=not args.no_verify_hashes, scheduler=_scheduler_config(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dspark_edge",
                                     description="On-device speculative decoding runtime (DSpark).")
    parser.add_argument("--version", action="version", version=f"dspark_edge {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log details to stderr")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt, streaming it to stdout")
    _engine_args(g)
    g.add_argument("prompt", help="the prompt (sent through the chat template unless --raw)")
    g.add_argument("--raw", action="store_true", help="use the prompt as plain text, no chat template")
    g.add_argument("--drafter", default=None,
                   help="speculative decoding with 'dspark', 'dspark:int8', 'ngram' or a draft-model engine folder "
                        "(default: plain decoding)")
    g.add_argument("--system", default=None, help="system message (chat mode)")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--json", action="store_true", help="print one JSON object (text, ids, stats) instead of text")

    b = sub.add_parser("bench", help="benchmark generation over a prompt set and the verify cost curve (JSON)")
    _engine_args(b)
    b.add_argument("--prompts", default=None, help="JSON-lines prompt file (default: the project's bench/prompts.jsonl)")
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    b.add_argument("--depth", type=int, default=128, help="cached positions for the verify cost curve")
    b.add_argument("--repeats", type=int, default=15, help="timed repeats per width for the verify curve")
    b.add_argument("--drafter", default=None,
                   help="compare plain decoding with this drafter ('dspark', 'dspark:int8', 'ngram' or a "
                        "draft-model engine folder), interleaved per prompt: verify width chosen per round by "
                        "the scheduler ('auto') and fixed at every listed draft length")
    b.add_argument("--draft-tokens", default=None,
                   help="comma-separated draft lengths to compare (default: every listed width - 1)")

    pr = sub.add_parser("profile", help="measure this device's cost of every variant of an engine",
                        description="Time the target at every verify width and the drafter at every block size "
                                    "(warm-up, median of repeats, at several context depths) and write "
                                    "profiles/<device-key>.json, which the scheduler loads automatically.")
    pr.add_argument("--engine", required=True)
    pr.add_argument("--contexts", default="64,512", help="context depths (default: %(default)s)")
    pr.add_argument("--repeats", type=int, default=9, help="timed repeats per variant (default: %(default)s)")
    pr.add_argument("--output-dir", default=None, help="where to write (default: DSPARK_PROFILES or profiles/)")
    pr.add_argument("--json", action="store_true", help="print the profile as JSON")

    i = sub.add_parser("inspect", help="print an engine folder's manifest summary (or --json)")
    i.add_argument("--engine", required=True)
    i.add_argument("--verify-hashes", action="store_true", help="also check every file's sha256")
    i.add_argument("--json", action="store_true")
    return parser


def cmd_generate(args) -> int:
    pipe = _load(args, drafter=args.drafter)
    if args.raw:
        prompt = args.prompt
    else:
        prompt = ([{"role": "system", "content": args.system}] if args.system else []) + \
                 [{"role": "user", "content": args.prompt}]
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                           top_p=args.top_p, seed=args.seed, stop=tuple(args.stop))
    stream = pipe.stream(prompt, cfg)
    try:
        for piece in stream:
            if not args.json:
                print(piece, end="", flush=True)
    except GenerationError as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    r = stream.result
    if args.json:
        print(json.dumps({"text": r.text, "token_ids": list(r.token_ids), "stop_reason": r.stop_reason,
                          "stats": r.stats.as_dict()}))
    else:
        s = r.stats
        print(f"\n[{s.new_tokens} tokens, {s.tokens_per_s:.1f} tok/s, prefill {s.prefill_s * 1000:.0f} ms, "
              f"stop: {r.stop_reason}]", file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    from .bench import bench_generation, load_prompts, verify_cost_curve

    prompts = load_prompts(args.prompts)[:args.limit]
    pipe = _load(args, drafter=args.drafter)

    def progress(done, total, row):
        print(f"[bench] {done}/{total} {row['id']}: {row['tokens_per_s']} tok/s", file=sys.stderr, flush=True)

    m = pipe.manifest
    report = {"engine": str(args.engine), "model": m.model.name, "precision": pipe.target.precision,
              "providers": list(pipe.target.session.providers)}
    if args.drafter:
        from .bench import bench_compare

        drafter = pipe.drafter  # loaded with the target (a draft model also turns off thread spinning)
        ks = [int(k) for k in args.draft_tokens.split(",")] if args.draft_tokens else \
            [w - 1 for w in pipe.target.widths if w > 1]
        variants = [("plain", None, {}), ("plain, own session", "plain_pipe", {}),
                    (f"{drafter.name} auto", drafter, {})] + \
                   [(f"{drafter.name} k={k}", drafter, {"draft_tokens": k}) for k in ks]

        def progress_cmp(done, total, rates):
            print(f"[bench] {done}/{total} " + ", ".join(f"{n}: {v:.1f}" for n, v in rates.items()),
                  file=sys.stderr, flush=True)

        # "plain" shares the speculative pipeline's session options (thread spinning off when two
        # sessions take turns); "plain, own session" is a pipeline opened without a drafter.
        report["comparison"] = bench_compare(pipe, prompts, variants, args.max_new_tokens, progress=progress_cmp,
                                             plain_pipe=_load(args))
    else:
        report["generation"] = bench_generation(pipe, prompts, args.max_new_tokens, progress=progress)
    report["verify_cost"] = verify_cost_curve(pipe.target, depth=args.depth, repeats=args.repeats)
    print(json.dumps(report, indent=2))
    return 0


def cmd_inspect(args) -> int:
    from .manifest import read_manifest, verify_files
    from .strict_json import to_json_dict

    m = read_manifest(args.engine)
    verify_files(m, args.engine, check_hashes=args.verify_hashes)
    if args.json:
        print(json.dumps(to_json_dict(m), indent=2))
        return 0
    print(f"engine     {args.engine} (schema v{m.schema_version}, created {m.created_utc})")
    print(f"model      {m.model.name} [{m.model.architecture}] {m.model.num_layers} layers, hidden "
          f"{m.model.hidden_size}, heads {m.model.num_heads}/{m.model.num_kv_heads}, vocab {m.model.vocab_size}")
    print(f"source     {m.model.source} (sha256 {m.model.source_sha256[:12]}…)")
    print(f"tokenizer  eos {list(m.tokenizer.eos_ids)}, bos {m.tokenizer.bos_id} (add_bos={m.tokenizer.add_bos}), "
          f"chat template: {'yes' if m.tokenizer.chat_template_file else 'no'}")
    print(f"hidden     layers {list(m.hidden_state_layers)} -> {m.io.hidden_states}")
    for role in ("target", "drafter", "draft_model"):
        for p in m.precisions(role):
            files = {v.file for v in m.variants_for(role, p)}
            print(f"{role:<10} {p:<5} widths {list(m.widths(role, p))}  {', '.join(sorted(files))}")
    for r in m.validation:
        print(f"validation {r.precision:<5} max|Δlogit| {r.max_abs_logit_diff:.2e}  greedy "
              f"{r.greedy_tokens_matched}/{r.greedy_tokens_compared}  top-1 {r.teacher_forced_top1:.0%}  "
              f"{'passed' if r.passed else 'FAILED'}")
    if m.drafter is not None:
        d = m.drafter
        print(f"drafter    dspark: {d.num_layers} layers, {d.slots} slots, draft vocab {d.draft_vocab}, Markov rank "
              f"{d.markov_rank}, calibrated T {' '.join(f'{t:.2f}' for t in d.temperatures)}")
    from .profile import load_profile
    from .telemetry import SystemReader

    prof, status = load_profile(args.engine)
    print(f"profile    {status}" + (f" ({prof.device_key}, {prof.created_utc})" if prof else
                                    " (run `python -m dspark_edge profile --engine ...`)"))
    print(f"telemetry  {', '.join(SystemReader().sources())}")
    total = sum(f.size for f in m.files)
    print(f"files      {len(m.files)}, {total / 2**20:.1f} MiB, "
          f"{'sha256 verified' if args.verify_hashes else 'sizes verified'}")
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
    prof = measure_profile(args.engine, contexts=contexts, reps=args.repeats,
                           progress=lambda m: print(f"[profile] {m}", file=sys.stderr, flush=True))
    path = save_profile(prof, Path(args.output_dir) if args.output_dir else None)
    if args.json:
        print(json.dumps(to_json_dict(prof), indent=1))
    print(f"[profile] wrote {path} (device {prof.device_key}; max temp {prof.max_temp_c}, "
          f"other load {prof.cpu_other_percent:.0f}%, throttled {prof.throttled})", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return {"generate": cmd_generate, "bench": cmd_bench, "inspect": cmd_inspect,
                "profile": cmd_profile}[args.command](args)
    except DSparkError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
