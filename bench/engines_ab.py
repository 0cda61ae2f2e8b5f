"""The same drafters on two engine folders, interleaved in one process: what does what differs
between the folders (an n-gram table, an installed drafter) change in speed?

    python bench/engines_ab.py --engine engines/before --engine engines/after \
        [--drafters ngram,ngram+self] [--passes 2] [--max-new-tokens 96] [--limit 12]

Plain decoding on the first folder is the baseline. Every prompt runs every mode (plain, and
each drafter on each folder, with the scheduler), in a fresh random order at every prompt,
greedy with EOS ignored, on one onnxruntime thread pool. Prints, per mode, its decode rate over
plain decoding's with the 95 % interval over the prompts (``dspark_edge.bench.ratio_interval``,
as `python -m dspark_edge bench` reports it) and how many answers equal plain decoding's (all
must); per drafter, the second folder against the first (overall with its interval, the runs
where it is ahead, and by category). Ratios, not tok/s:
the machine changes between sessions.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", type=Path, action="append", required=True,
                    help="an engine folder; give exactly two (the first is the baseline's)")
    ap.add_argument("--drafters", default="ngram,ngram+self", help="drafter specs (default: %(default)s)")
    ap.add_argument("--precision", default="fp32", help="target precision (default: %(default)s)")
    ap.add_argument("--passes", type=int, default=2, help="passes over the prompts (default: %(default)s)")
    ap.add_argument("--limit", type=int, default=None, help="the first N benchmark prompts (default: all)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args()

    import dspark_edge
    from dspark_edge.bench import load_prompts, ratio_interval
    from dspark_edge.errors import ConfigError

    if len(args.engine) != 2:
        raise ConfigError(f"give --engine exactly twice (the two folders compared), got {len(args.engine)}")
    if args.passes < 1 or args.max_new_tokens < 1 or (args.limit is not None and args.limit < 1):
        raise ConfigError("--passes, --max-new-tokens and --limit must be at least 1")
    first, second = args.engine
    drafters = [d for d in args.drafters.split(",") if d]
    options = dspark_edge.BackendOptions(shared_threads=True)
    modes = {"plain": dspark_edge.load(first, args.precision, options=options)}
    for d in drafters:
        for tag, engine in (("A", first), ("B", second)):
            modes[f"{d} {tag}"] = dspark_edge.load(engine, args.precision, drafter=d, options=options)
    for pipe in modes.values():
        pipe.generate("Hello", max_new_tokens=8)
    prompts = load_prompts()[: args.limit]
    rows: dict[str, list] = {m: [] for m in modes}
    for p in range(args.passes):
        for i, rec in enumerate(prompts):
            order = list(modes)
            np.random.default_rng(1000 * p + i).shuffle(order)
            for m in order:
                r = modes[m].generate(rec.get("messages") or rec["prompt"], max_new_tokens=args.max_new_tokens,
                                      ignore_eos=True)
                rows[m].append({"id": rec["id"], "category": rec["category"], "new_tokens": r.stats.new_tokens,
                                "decode_s": r.stats.decode_s, "tokens_per_s": r.stats.tokens_per_s,
                                "token_ids": list(r.token_ids)})
            print(f"[ab] pass {p + 1}/{args.passes}, prompt {i + 1}/{len(prompts)}: {rec['id']}", file=sys.stderr,
                  flush=True)
    base = rows["plain"]
    print(f"A = {first}, B = {second}; {len(base)} answers of {args.max_new_tokens} tokens; plain median "
          f"{np.median([b['tokens_per_s'] for b in base]):.1f} tok/s")
    for m, got in rows.items():
        ci = ratio_interval(got, base)
        same = sum(a["token_ids"] == b["token_ids"] for a, b in zip(got, base))
        print(f"{m:24} {ci['ratio']:.3f}x plain ({ci['ci95'][0]:.3f}-{ci['ci95'][1]:.3f}), "
              f"{same}/{len(got)} answers equal to plain")
    for d in drafters:
        a, b = rows[f"{d} A"], rows[f"{d} B"]
        ci = ratio_interval(b, a)
        ahead = sum(y["tokens_per_s"] > x["tokens_per_s"] for x, y in zip(a, b))
        by = {c: ratio_interval([y for y in b if y["category"] == c], [x for x in a if x["category"] == c])["ratio"]
              for c in sorted({x["category"] for x in a})}
        print(f"{d}: B / A {ci['ratio']:.3f} ({ci['ci95'][0]:.3f}-{ci['ci95'][1]:.3f}), B ahead in {ahead}/{len(a)} "
              "runs; " + ", ".join(f"{c} {v:.3f}" for c, v in by.items()))
    return 0


if __name__ == "__main__":
    from dspark_edge.cli import run_reporting_errors

    sys.exit(run_reporting_errors(main))
