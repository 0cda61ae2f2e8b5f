"""Soak: many short generations alternating drafters and draft lengths, watching resources.

    python bench/soak.py --engine engines/smollm2-135m --precision fp32 --runs 1000
    python bench/soak.py --engine E --draft-model engines/smollm2-draft2L   # one more drafter

Cycles plain decoding and every drafter available (n-gram; the engine's DSpark drafter when
it has one; a draft-model folder when given), each with the scheduler choosing widths and at
every fixed draft length, greedy, rejection-sampled and coupled-sampled with fixed seeds, all on
ONE pipeline. Reports
RSS after warm-up and at the end (growth %), open file descriptors and threads, and whether
every repeat gave the same tokens: greedy and coupled-sampled answers must be the same in every
mode (per seed), rejection-sampled ones per (mode, seed) at fixed draft lengths. Rejection-sampled
answers with scheduler-chosen widths are counted apart: the widths follow measured timing and the
random stream follows the widths. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import psutil

import dspark_edge
from dspark_edge.drafters import create as create_drafter

PROMPTS = ["Tell me a joke.", "What is 2 + 2?", "Name three colours.", "Say hello in French.",
           "Write one line of Python.", "What is the capital of Italy?"]


def soak(engine: str, precision: str | None, runs: int, max_new_tokens: int = 24, warmup: int = 50,
         draft_model: str | None = None, progress=None) -> dict:
    pipe = dspark_edge.load(engine, precision, drafter="ngram", verify_hashes=False)
    drafters = [pipe.drafter]
    if pipe.manifest.drafter is not None:
        drafters.append(create_drafter("dspark", pipe.manifest, engine_dir=pipe.engine_dir, verify_hashes=False))
    if draft_model is not None:
        drafters.append(create_drafter(draft_model, pipe.manifest, verify_hashes=False))
    modes = [("plain", drafters[0], {"speculative": False})]
    for d in drafters:
        modes += [(f"{d.name} auto", d, {})]
        modes += [(f"{d.name} k={w - 1}", d, {"draft_tokens": w - 1}) for w in pipe.target.widths if w > 1]
    proc = psutil.Process()
    seen: dict[tuple, tuple] = {}
    mismatches, mismatched, timing_dependent = 0, [], 0
    rss_warm = fds_warm = threads_warm = None
    t0 = time.perf_counter()
    for i in range(runs):
        prompt = PROMPTS[i % len(PROMPTS)]
        name, drafter, extra = modes[(i // len(PROMPTS)) % len(modes)]
        kind = ("greedy", "rejection", "coupled")[(i // (len(PROMPTS) * len(modes))) % 3]
        cfg = dict(max_new_tokens=max_new_tokens, ignore_eos=True, **extra)
        if kind != "greedy":
            cfg.update(temperature=0.8, top_p=0.95, seed=i % 7, sampling=kind)
        pipe.drafter = drafter
        tokens = pipe.generate([{"role": "user", "content": prompt}], **cfg).token_ids
        # Greedy and coupled-sampled answers are the same in every mode (FP32); rejection-sampled
        # ones per (mode, seed).
        key = {"greedy": (prompt, "greedy"), "coupled": (prompt, "coupled", cfg.get("seed")),
               "rejection": (prompt, name, cfg.get("seed"))}[kind]
        if key in seen and seen[key] != tokens:
            if kind == "rejection" and "auto" in name:
                # Sampled, scheduler-chosen widths: the widths follow measured timing and the random
                # stream follows the widths, so a seed reproduces its answer only at fixed widths.
                timing_dependent += 1
            else:
                mismatches += 1
                mismatched.append(list(map(str, key)))
        seen.setdefault(key, tokens)
        if i + 1 == warmup:
            rss_warm, fds_warm, threads_warm = proc.memory_info().rss, proc.num_fds(), proc.num_threads()
        if progress and (i + 1) % 100 == 0:
            progress(i + 1, runs, proc.memory_info().rss / 2**20)
    rss_end, fds_end, threads_end = proc.memory_info().rss, proc.num_fds(), proc.num_threads()
    pipe.close()
    return {"runs": runs, "seconds": round(time.perf_counter() - t0, 1), "modes": [m[0] for m in modes],
            "rss_after_warmup_mib": round(rss_warm / 2**20, 1), "rss_end_mib": round(rss_end / 2**20, 1),
            "rss_growth_pct": round(100 * (rss_end - rss_warm) / rss_warm, 2),
            "fds_after_warmup": fds_warm, "fds_end": fds_end, "threads_after_warmup": threads_warm,
            "threads_end": threads_end, "repeat_mismatches": mismatches, "mismatched": mismatched[:20],
            "sampled_auto_repeats_differing": timing_dependent, "distinct_keys": len(seen)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--draft-model", default=None, help="a draft-model engine folder to include as a drafter")
    args = ap.parse_args()
    report = soak(args.engine, args.precision, args.runs, args.max_new_tokens, draft_model=args.draft_model,
                  progress=lambda d, n, rss: print(f"[soak] {d}/{n} RSS {rss:.0f} MiB", file=sys.stderr, flush=True))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
