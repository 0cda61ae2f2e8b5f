"""Which weight should a probe of the scheduler's closed gate carry? The same drafter with the
scheduler at two ``probe_weight`` values, and at a fixed draft count, against plain decoding.

    python bench/experiments/probe_weight_ab.py --engine ENGINE [--drafters int8,fp32,ngram+self]
        [--weights 0.25,0.05] [--limit 8] [--max-new-tokens 96]

``int8`` / ``fp32`` stand for the engine's DSpark drafter at that precision; other names are
drafter specs. Every mode runs on every prompt in turn (greedy, EOS ignored), one process, one
onnxruntime thread pool. Prints per mode the mean speed ratio to plain decoding, the drafts
made, and how many answers equal plain decoding's (all must).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", type=Path, required=True)
    ap.add_argument("--drafters", default="int8,fp32")
    ap.add_argument("--weights", default="0.25,0.05", help="probe_weight values (default: 0.25,0.05)")
    ap.add_argument("--draft-tokens", type=int, default=2, help="the fixed mode's drafts per round (default: 2)")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args()

    import dspark_edge
    from dspark_edge.bench import load_prompts

    options = dspark_edge.BackendOptions(shared_threads=True)
    modes = {"plain": (dspark_edge.load(args.engine, "fp32", options=options), None)}
    for name in args.drafters.split(","):
        spec = f"dspark:{name}" if name in ("fp32", "int8") else name
        for w in args.weights.split(","):
            modes[f"{name} scheduler, probe_weight {w}"] = (dspark_edge.load(
                args.engine, "fp32", drafter=spec, options=options,
                scheduler=dspark_edge.SchedulerConfig(probe_weight=float(w))), None)
        modes[f"{name} {args.draft_tokens} drafts"] = (
            dspark_edge.load(args.engine, "fp32", drafter=spec, options=options), args.draft_tokens)
    for pipe, _ in modes.values():
        pipe.generate("Hello", max_new_tokens=8)
    rows: dict = {m: [] for m in modes}
    prompts = load_prompts()[: args.limit]
    for i, rec in enumerate(prompts):
        for m, (pipe, k) in modes.items():
            t0 = time.perf_counter()
            r = pipe.generate(rec.get("messages") or rec["prompt"], max_new_tokens=args.max_new_tokens,
                              draft_tokens=k, ignore_eos=True)
            rows[m].append((r.stats.new_tokens / (time.perf_counter() - t0), r.stats.draft_n, r.token_ids))
        print(f"[{i + 1}/{len(prompts)}] {rec['id']}", file=sys.stderr, flush=True)
    base = rows["plain"]
    for m, r in rows.items():
        ratio = statistics.mean(a[0] / b[0] for a, b in zip(r, base))
        same = sum(a[2] == b[2] for a, b in zip(r, base))
        print(f"{m:40} {ratio:.3f}× plain, {sum(x[1] for x in r)} drafts, {same}/{len(r)} equal to plain")
    return 0


if __name__ == "__main__":
    sys.exit(main())
