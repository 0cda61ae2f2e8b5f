"""Soak: many short generations alternating drafters and draft lengths, watching resources.

    python bench/soak.py --engine engines/smollm2-135m --precision fp32 --runs 1000

Cycles plain / n-gram auto / n-gram at each listed draft length, greedy and sampled with
fixed seeds. Reports RSS after warm-up and at the end (growth %), open file descriptors,
and whether every repeat of the same (prompt, mode, seed) gave the same tokens. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import psutil

import dspark_edge
from dspark_edge.drafters import NgramDrafter

PROMPTS = ["Tell me a joke.", "What is 2 + 2?", "Name three colours.", "Say hello in French.",
           "Write one line of Python.", "What is the capital of Italy?"]


def soak(engine: str, precision: str | None, runs: int, max_new_tokens: int = 24, warmup: int = 50,
         progress=None) -> dict:
    pipe = dspark_edge.load(engine, precision, verify_hashes=False)
    ngram = NgramDrafter()
    modes = [("plain", None, {})] + [("ngram auto", ngram, {})] + \
            [(f"ngram k={w - 1}", ngram, {"draft_tokens": w - 1}) for w in pipe.target.widths if w > 1]
    proc = psutil.Process()
    seen: dict[tuple, tuple] = {}
    mismatches = 0
    rss_warm = fds_warm = None
    t0 = time.perf_counter()
    for i in range(runs):
        prompt = PROMPTS[i % len(PROMPTS)]
        name, drafter, extra = modes[(i // len(PROMPTS)) % len(modes)]
        sampled = (i // (len(PROMPTS) * len(modes))) % 2 == 1
        cfg = dict(max_new_tokens=max_new_tokens, ignore_eos=True, **extra)
        if sampled:
            cfg.update(temperature=0.8, top_p=0.95, seed=i % 7)
        pipe.drafter = drafter
        tokens = pipe.generate([{"role": "user", "content": prompt}], **cfg).token_ids
        # greedy tokens are the same in every mode (FP32); sampled ones per (mode, seed)
        key = (prompt, "greedy") if not sampled else (prompt, name, cfg["seed"])
        if key in seen and seen[key] != tokens:
            mismatches += 1
        seen.setdefault(key, tokens)
        if i + 1 == warmup:
            rss_warm, fds_warm = proc.memory_info().rss, proc.num_fds()
        if progress and (i + 1) % 100 == 0:
            progress(i + 1, runs, proc.memory_info().rss / 2**20)
    rss_end, fds_end = proc.memory_info().rss, proc.num_fds()
    return {"runs": runs, "seconds": round(time.perf_counter() - t0, 1), "modes": [m[0] for m in modes],
            "rss_after_warmup_mib": round(rss_warm / 2**20, 1), "rss_end_mib": round(rss_end / 2**20, 1),
            "rss_growth_pct": round(100 * (rss_end - rss_warm) / rss_warm, 2),
            "fds_after_warmup": fds_warm, "fds_end": fds_end, "repeat_mismatches": mismatches,
            "distinct_keys": len(seen)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    args = ap.parse_args()
    report = soak(args.engine, args.precision, args.runs, args.max_new_tokens,
                  progress=lambda d, n, rss: print(f"[soak] {d}/{n} RSS {rss:.0f} MiB", file=sys.stderr, flush=True))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
