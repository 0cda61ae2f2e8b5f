"""Two n-gram drafter settings against plain decoding and the fixed draft lengths, interleaved.

    python bench/scheduler_ab.py --engine engines/smollm2-135m --precision fp32

Variants per prompt, back to back in one process: plain, the n-gram drafter at each fixed draft
length, the scheduler with the drafter as shipped (match-length and momentum statistics), and
the scheduler with momentum off (statistics by match length only). Prints JSON (tok/s, speedup
vs plain, per category) and the comparison the scheduler issue asks for: the scheduler vs the
best fixed length per category and overall.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", type=Path, required=True)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--fixed", default="1,2,3,5,7", help="fixed draft lengths (default: %(default)s)")
    args = ap.parse_args()

    import dspark_edge
    from dspark_edge.bench import bench_compare, load_prompts
    from dspark_edge.drafters.ngram import NgramDrafter

    pipe = dspark_edge.load(args.engine, args.precision, drafter="ngram")
    shipped, flat = NgramDrafter(), NgramDrafter(momentum=False)
    fixed = [int(k) for k in args.fixed.split(",")]
    variants = [("plain", None, {})] + [(f"k={k}", shipped, {"draft_tokens": k}) for k in fixed] + \
               [("scheduler", shipped, {}), ("scheduler, no momentum", flat, {})]
    prompts = load_prompts()[:args.limit]
    report = bench_compare(pipe, prompts, variants, args.max_new_tokens,
                           progress=lambda i, n, r: print(f"[ab] {i}/{n}", file=sys.stderr, flush=True))
    out = {name: {k: row[k] for k in ("tokens_per_s", "speedup", "exact_prompts", "widths",
                                      "tokens_per_s_by_category")}
           for name, row in report["variants"].items()}
    fixed_names = [f"k={k}" for k in fixed]
    best = max(fixed_names, key=lambda n: out[n]["tokens_per_s"])
    cats = out["plain"]["tokens_per_s_by_category"]
    verdict = {}
    for sched in ("scheduler", "scheduler, no momentum"):
        per_cat = {c: round(out[sched]["tokens_per_s_by_category"][c]
                            / max(out[n]["tokens_per_s_by_category"][c] for n in fixed_names), 3) for c in cats}
        verdict[sched] = {"vs_best_fixed_overall": round(out[sched]["tokens_per_s"] / out[best]["tokens_per_s"], 3),
                          "best_fixed": best, "vs_best_fixed_per_category": per_cat}
    print(json.dumps({"variants": out, "verdict": verdict}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
