"""What does adding the Markov bias to each slot's top-k base logits only cost in acceptance,
and what does it save per round?

    python bench/markov_top_k.py --engine engines/smollm2-135m [--ks 16,64,256,full] [--limit 12]

The engine's DSpark drafter runs at a fixed block (``--draft-tokens``, default its largest) on
the project's benchmark prompts, greedy, once per k, interleaved per prompt over one target
session (``Pipeline.twin``). Prints JSON per k: acceptance rate, tokens per round, the
drafter's mean time per round, decode tok/s, and whether every answer equals plain decoding's
(it must: top-k changes the drafts, never the output).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", type=Path, required=True)
    ap.add_argument("--ks", default="16,64,256,full", help="comma-separated k values; 'full' = every token")
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--draft-tokens", type=int, default=None)
    args = ap.parse_args()

    import dspark_edge
    from dspark_edge.bench import load_prompts
    from dspark_edge.drafters.dspark import DSparkDrafter
    from dspark_edge.manifest import read_manifest

    manifest = read_manifest(args.engine)
    ks = [None if k == "full" else int(k) for k in args.ks.split(",")]
    # One thread pool for the target and every drafter session (as the command line does), so
    # idle sessions' threads do not spin beside the one at work.
    options = dspark_edge.BackendOptions(shared_threads=True)
    plain = dspark_edge.load(args.engine, "fp32", options=options)
    twins = {}
    for k in ks:
        d = DSparkDrafter(args.engine, manifest, "fp32", options=options, markov_top_k=k)
        twins[k] = (plain.twin(d), d)
    n_draft = args.draft_tokens or max(twins[ks[0]][1].blocks) - 1
    prompts = load_prompts()[: args.limit]
    rows = {k: [] for k in ks}
    for i, rec in enumerate(prompts):
        msgs = rec.get("messages") or rec["prompt"]
        want = plain.generate(msgs, max_new_tokens=args.max_new_tokens, ignore_eos=True).token_ids
        for k in ks:
            pipe, drafter = twins[k]
            spent = 0.0
            original = drafter.propose

            def timed(request, rng, _orig=original):
                nonlocal spent
                t0 = time.perf_counter()
                out = _orig(request, rng)
                spent += time.perf_counter() - t0
                return out

            drafter.propose = timed
            r = pipe.generate(msgs, max_new_tokens=args.max_new_tokens, ignore_eos=True, draft_tokens=n_draft)
            drafter.propose = original
            s = r.stats
            rows[k].append({"tok_s": s.tokens_per_s, "drafted": s.draft_n, "accepted": s.draft_n_accepted,
                            "rounds": s.rounds, "new": s.new_tokens, "draft_ms": 1000 * spent / max(s.rounds, 1),
                            "exact": r.token_ids == want})
        print(f"[{i + 1}/{len(prompts)}] {rec['id']}", file=sys.stderr, flush=True)
    report = {"engine": str(args.engine), "draft_vocab": int(twins[ks[0]][1].vocab_ids.size),
              "draft_tokens": n_draft, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "ks": {}}
    for k in ks:
        r = rows[k]
        drafted, accepted = sum(x["drafted"] for x in r), sum(x["accepted"] for x in r)
        report["ks"]["full" if k is None else str(k)] = {
            "acceptance": round(accepted / drafted, 4) if drafted else None,
            "tokens_per_round": round(sum(x["new"] for x in r) / sum(x["rounds"] for x in r), 3),
            "drafter_ms_per_round": round(statistics.mean(x["draft_ms"] for x in r), 3),
            "median_tok_s": round(statistics.median(x["tok_s"] for x in r), 2),
            "exact": sum(x["exact"] for x in r)}
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
