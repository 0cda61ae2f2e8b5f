"""What does a DSpark round cost against a plain target step, and what does each way of sizing
the drafter's block decode at?

    python bench/dspark_rounds.py --engine engines/smollm2-135m [--engine OTHER] [--precisions fp32,int8]
        [--limit 8] [--max-new-tokens 96] [--draft-tokens 2]

For each engine folder with a DSpark drafter, and each drafter precision: the scheduler with the
drafter choosing its block per round (``auto``, the default), the scheduler with the drafter
always running its widest block (``auto-widest``, the behaviour before the block choice), and a
fixed draft count (``k=N``); plain decoding of the same engine is the baseline. Every mode runs
on every prompt in turn (greedy), all in one process on one onnxruntime thread pool, as the
command line runs a target and a drafter. Prints JSON per engine and mode: the mean ratio of
decode speed to plain decoding over the prompts, the drafter's time per round, that time as a
share of a plain step, the blocks run, and how many answers equal plain decoding's (all must).
Two engine folders with the same target and drafter weights installed by different versions of
`python -m export drafter` compare the drafter graphs themselves.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", type=Path, action="append", required=True, help="engine folder (repeatable)")
    ap.add_argument("--precisions", default="fp32,int8", help="drafter precisions (default: fp32,int8)")
    ap.add_argument("--limit", type=int, default=8, help="first N benchmark prompts (default: 8)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--draft-tokens", type=int, default=2, help="the fixed mode's drafts per round (default: 2)")
    args = ap.parse_args()

    import dspark_edge
    from dspark_edge.bench import load_prompts
    from dspark_edge.drafters.dspark import DSparkDrafter
    from dspark_edge.manifest import read_manifest

    options = dspark_edge.BackendOptions(shared_threads=True)
    prompts = load_prompts()[: args.limit]
    modes = {}  # (engine, mode) -> (pipeline, draft_tokens)
    for engine in args.engine:
        modes[(engine, "plain")] = (dspark_edge.load(engine, "fp32", options=options), None)
        for p in args.precisions.split(","):
            auto = dspark_edge.load(engine, "fp32", drafter=f"dspark:{p}", options=options)
            fixed_block = DSparkDrafter(engine, read_manifest(engine), p, options, block_choice=False)
            widest = dspark_edge.load(engine, "fp32", drafter=fixed_block, options=options)
            modes[(engine, f"dspark:{p} auto")] = (auto, None)
            modes[(engine, f"dspark:{p} auto-widest")] = (widest, None)
            modes[(engine, f"dspark:{p} k={args.draft_tokens}")] = (auto, args.draft_tokens)
    for pipe, _ in modes.values():  # first runs of each shape out of the way
        pipe.generate("Hello", max_new_tokens=8)
    rows: dict = {key: [] for key in modes}
    for i, rec in enumerate(prompts):
        msgs = rec.get("messages") or rec["prompt"]
        for key, (pipe, k) in modes.items():
            blocks: Counter = Counter()
            drafter = pipe.drafter
            if drafter is not None:
                original = drafter.base

                def counted(new_hidden, anchor, position, slots, _orig=original):
                    blocks[slots + 1] += 1
                    return _orig(new_hidden, anchor, position, slots)

                drafter.base = counted
            t0 = time.perf_counter()
            r = pipe.generate(msgs, max_new_tokens=args.max_new_tokens, ignore_eos=True, draft_tokens=k)
            wall = time.perf_counter() - t0
            if drafter is not None:
                drafter.base = original
            s = r.stats
            rows[key].append({"tok_s": s.new_tokens / wall, "ids": r.token_ids,
                              "draft_ms": 1000 * s.draft_s / max(sum(blocks.values()), 1),
                              "step_ms": 1000 * s.verify_s / max(s.rounds, 1), "blocks": blocks})
        print(f"[{i + 1}/{len(prompts)}] {rec['id']}", file=sys.stderr, flush=True)
    report: dict = {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "engines": {}}
    for (engine, mode), r in rows.items():
        base = rows[(engine, "plain")]
        plain_step = statistics.median(x["step_ms"] for x in base)
        blocks = sum((x["blocks"] for x in r), Counter())
        out = {"vs_plain": round(statistics.mean(a["tok_s"] / b["tok_s"] for a, b in zip(r, base)), 3),
               "median_tok_s": round(statistics.median(x["tok_s"] for x in r), 1),
               "same_as_plain": f"{sum(a['ids'] == b['ids'] for a, b in zip(r, base))}/{len(r)}"}
        if mode == "plain":
            out["step_ms"] = round(plain_step, 2)
        else:
            draft_ms = statistics.median(x["draft_ms"] for x in r)
            out.update({"drafter_ms_per_round": round(draft_ms, 2), "of_a_plain_step": round(draft_ms / plain_step, 3),
                        "blocks": {str(b): n for b, n in sorted(blocks.items())}})
        report["engines"].setdefault(str(engine), {})[mode] = out
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
