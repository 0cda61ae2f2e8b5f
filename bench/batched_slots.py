"""Continuous batching in one process: per-request speed of m requests decoding at once.

    python bench/batched_slots.py --engine engines/smollm2-135m [--slots 4] [--clients 4]
        [--drafters none,ngram,ngram+self] [--per-client 3] [--max-new-tokens 64]

For each drafter in turn: the engine loaded with it, ``Pipeline.batch_slots(--slots)``, then
``--clients`` threads, each decoding ``--per-client`` benchmark prompts back to back (greedy,
EOS ignored). Prints per drafter the total tok/s (all tokens over the wall time), the median
per-request tok/s, the runner's pass counts and its width-1 rows-pass table. No HTTP, no
client threads beside the slots': the batching itself, where ``serve_load.py`` measures the
server. Speeds compare within one run only.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", type=Path, required=True)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--drafters", default="none,ngram,ngram+self")
    ap.add_argument("--per-client", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    if not 1 <= args.clients <= args.slots:
        raise SystemExit("--clients must be between 1 and --slots")

    import dspark_edge
    from dspark_edge.bench import load_prompts

    prompts = [r.get("messages") or r["prompt"] for r in load_prompts(None)]
    for name in args.drafters.split(","):
        with dspark_edge.load(args.engine, args.precision, drafter=None if name == "none" else name) as pipe:
            slots = pipe.batch_slots(args.slots)
            runner = slots[0]._slot[0]
            for s in slots[:args.clients]:
                s.generate(prompts[0], max_new_tokens=8)  # each slot's first shapes, uncounted
            for key in runner.passes:
                runner.passes[key] = 0
            speeds: list[float] = []
            tokens = [0]
            lock = threading.Lock()

            def client(i: int) -> None:
                for j in range(args.per_client):
                    t = time.perf_counter()
                    r = slots[i].generate(prompts[(i * args.per_client + j) % len(prompts)],
                                          max_new_tokens=args.max_new_tokens, ignore_eos=True)
                    with lock:
                        speeds.append(len(r.token_ids) / (time.perf_counter() - t))
                        tokens[0] += len(r.token_ids)

            t0 = time.perf_counter()
            threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            rows = {m: round(ms, 1) for m, ms in runner.costs.rows.items()}
            print(f"{name:14s} clients {args.clients}: total {tokens[0] / wall:6.1f} tok/s, per request (median) "
                  f"{statistics.median(speeds):5.1f}; passes {runner.passes}; rows pass ms {rows}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
