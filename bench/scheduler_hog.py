"""The scheduler under a noisy neighbour: the same prompts decoded with the scheduler and with
the best fixed width, interleaved, first on a quiet machine, then with a CPU hog (a second
process spinning on every core for a bounded time) started mid-run. Prints JSON: tok/s of
both, their ratio, and the scheduler's width distribution and cost correction per phase, plus
the scheduler's own overhead per step (decision + telemetry read).

    python bench/scheduler_hog.py --engine engines/smollm2-135m --fixed 7
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time

import numpy as np

import dspark_edge
from dspark_edge.bench import load_prompts
from dspark_edge.config import GenerationConfig
from dspark_edge.drafters.spec import own_model


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    x = 0
    while time.monotonic() < end:
        x += 1


def start_hog(seconds: float) -> list[mp.Process]:
    procs = [mp.Process(target=_spin, args=(seconds,), daemon=True) for _ in range(mp.cpu_count())]
    for p in procs:
        p.start()
    return procs


def run_phase(pipe, prompts, fixed: int, max_new: int) -> dict:
    cfg = GenerationConfig(max_new_tokens=max_new, ignore_eos=True)
    rows = {"scheduler": [], f"fixed k={fixed}": []}
    widths: dict[str, int] = {}
    corrections = []
    drafted = [0, 0]  # the scheduler's drafts verified, and its rounds
    for rec in prompts:
        for name in rows:
            over = {} if name == "scheduler" else {"draft_tokens": fixed}
            r = pipe.generate(rec["messages"], cfg, **over)
            rows[name].append((r.stats.new_tokens - 1, r.stats.decode_s))
            if name == "scheduler":
                drafted[0] += r.stats.draft_n
                drafted[1] += sum(r.stats.widths.values())
                for k, v in r.stats.widths.items():
                    widths[k] = widths.get(k, 0) + v
                corrections.append(pipe.scheduler.costs.correction(max(pipe.target.widths)))
    rate = {n: sum(t for t, _ in v) / sum(s for _, s in v) for n, v in rows.items()}
    names = list(rows)
    return {"tokens_per_s": {n: round(v, 2) for n, v in rate.items()},
            "scheduler_vs_fixed": round(rate[names[0]] / rate[names[1]], 3),
            "scheduler_widths": dict(sorted(widths.items(), key=lambda kv: int(kv[0]))),
            "scheduler_drafts_per_round": round(drafted[0] / max(drafted[1], 1), 2),
            "cost_correction_widest": round(float(np.median(corrections)), 2)}


def overhead(pipe, n: int = 5000) -> dict:
    sched = pipe.scheduler
    rng = np.random.default_rng(0)
    confs = [np.clip(rng.random(7) * 0.5 + 0.5, 0, 1) for _ in range(64)]
    t = time.perf_counter()
    for i in range(n):  # a full step: telemetry read, gate, decision and cost update, every time
        snap = pipe.telemetry()
        sched.wants_draft(snap)
        d = sched.decide(confs[i % 64], snap)
        sched.observe(d.width, sched.costs.verify_ms[d.width])
    per = (time.perf_counter() - t) / n * 1e3
    return {"ms_per_step": round(per, 4), "steps": n}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default="engines/smollm2-135m")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--drafter", default="dspark")
    ap.add_argument("--fixed", type=int, default=7, help="the fixed draft length to race (best fixed width - 1)")
    ap.add_argument("--limit", type=int, default=6, help="prompts per phase")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args()
    # As the command line does: a drafter with a graph of its own shares the target's thread pool.
    options = dspark_edge.BackendOptions(shared_threads=own_model(args.drafter))
    pipe = dspark_edge.load(args.engine, args.precision, drafter=args.drafter, options=options)
    prompts = load_prompts()[:args.limit]
    pipe.generate(prompts[0]["messages"], max_new_tokens=16)
    report = {"engine": args.engine, "precision": args.precision, "profile": pipe.profile_status}
    print("[hog] quiet phase", file=sys.stderr, flush=True)
    report["quiet"] = run_phase(pipe, prompts, args.fixed, args.max_new_tokens)
    print("[hog] hog phase (one spinning process per core)", file=sys.stderr, flush=True)
    t = time.perf_counter()
    hog = start_hog(seconds=600)
    try:
        report["hog"] = run_phase(pipe, prompts, args.fixed, args.max_new_tokens)
    finally:
        for p in hog:
            p.terminate()
            p.join()
    report["hog"]["seconds"] = round(time.perf_counter() - t, 1)
    report["overhead"] = overhead(pipe)
    pipe.close()
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
