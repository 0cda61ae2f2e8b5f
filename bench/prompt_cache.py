"""A conversation's next turn with and without the K/V of the turns before it
(``GenerationConfig.reuse_prefix``, what ``chat``, the demo's ``--chat`` and ``serve`` do).

    python bench/prompt_cache.py --engine engines/smollm2-135m --precision fp32 --turns 8

One conversation whose user messages are the project's benchmark prompts in order; every turn
is answered by two pipelines of the same engine in turns (which goes first alternates): one that
reuses the prefix its previous generation kept, one that prefills the whole conversation. Both
get the same messages (the reusing pipeline's answers become the history), so their prompts are
identical. Reports per turn: prompt tokens, tokens reused, the prefill (time to the first token)
of each, and whether the two answers are equal; then the median ratio of the prefills from the
second turn on. JSON on stdout, a table on stderr.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import dspark_edge  # noqa: E402
from dspark_edge.bench import load_prompts  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--drafter", default="none", help="a drafter spec, or none (default)")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    prompts = load_prompts()
    if not 1 <= args.turns <= len(prompts):
        raise SystemExit(f"--turns must be in 1..{len(prompts)}")
    drafter = None if args.drafter == "none" else args.drafter
    cfg = dspark_edge.GenerationConfig(max_new_tokens=args.max_new_tokens)
    reusing = dspark_edge.load(args.engine, args.precision, drafter=drafter)
    fresh = dspark_edge.load(args.engine, args.precision, drafter=drafter)
    rows, history = [], []
    try:
        for t in range(args.turns):
            rec = prompts[t]
            message = rec["messages"][-1]["content"] if rec.get("messages") else rec["prompt"]
            history.append({"role": "user", "content": message})
            runs = {}
            order = ("reuse", "fresh") if t % 2 == 0 else ("fresh", "reuse")
            for name in order:
                pipe, reuse = (reusing, True) if name == "reuse" else (fresh, False)
                runs[name] = pipe.generate(history, cfg, reuse_prefix=reuse)
            r, f = runs["reuse"], runs["fresh"]
            rows.append({"turn": t + 1, "prompt_tokens": r.stats.prompt_tokens, "reused": r.stats.prompt_reused,
                         "prefill_ms_reuse": round(r.stats.prefill_s * 1e3, 1),
                         "prefill_ms_fresh": round(f.stats.prefill_s * 1e3, 1),
                         "answers_equal": r.token_ids == f.token_ids})
            history.append({"role": "assistant", "content": r.text})
            row = rows[-1]
            print(f"[turn {row['turn']}] prompt {row['prompt_tokens']} tokens, {row['reused']} reused: prefill "
                  f"{row['prefill_ms_reuse']} ms against {row['prefill_ms_fresh']} ms; answers equal "
                  f"{row['answers_equal']}", file=sys.stderr, flush=True)
    finally:
        reusing.close()
        fresh.close()
    later = [r["prefill_ms_fresh"] / r["prefill_ms_reuse"] for r in rows[1:] if r["prefill_ms_reuse"] > 0]
    summary = {"engine": args.engine, "precision": args.precision, "drafter": args.drafter,
               "max_new_tokens": args.max_new_tokens, "turns": rows,
               "median_prefill_fresh_over_reuse_from_turn_2": round(statistics.median(later), 2) if later else None,
               "answers_equal": sum(r["answers_equal"] for r in rows)}
    print(json.dumps(summary, indent=1))
    if later:
        print(f"[summary] from turn 2 on, a fresh prefill took {summary['median_prefill_fresh_over_reuse_from_turn_2']}x "
              f"the reusing one (median); answers equal in {summary['answers_equal']}/{len(rows)} turns",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
