"""How much faster does the data engine (`python -m export data`) answer prompts than the
runtime answering them one at a time, and are the answers the same?

On the same training prompts, in rounds that alternate the two: the runtime's plain greedy
decoding (one prompt at a time, as `train-drafter` used to answer) and the data engine's
batched greedy pass at each ``--batch`` size. Prints answer tokens per second of each, the
ratio to one-at-a-time in the same round, and how many answers are token-for-token the same.

    .venv/bin/python bench/data_engine.py --engine engines/smollm2-135m --prompts 64 --batch 1,8,32
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import dspark_edge  # noqa: E402
from dspark_edge.manifest import read_manifest  # noqa: E402
from dspark_edge.tokenizer import Tokenizer  # noqa: E402
from dspark_export.data_engine import BatchedTarget  # noqa: E402
from dspark_export.drafter.prompts import training_prompts  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", type=Path, default=Path("engines/smollm2-135m"))
    ap.add_argument("--prompts", type=int, default=64, help="training prompts per round (default: %(default)s)")
    ap.add_argument("--batch", default="1,8,32", help="batch sizes of the data engine (default: %(default)s)")
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    manifest = read_manifest(args.engine)
    tok = Tokenizer.from_engine(args.engine, manifest)
    messages = [r["messages"] for r in training_prompts(0)[:args.prompts]]
    ids = [tok.encode_chat(m) for m in messages]
    rates: dict[str, list[float]] = {"one at a time": []} | {f"batch {b}": [] for b in batches}
    same: dict[str, int] = {}
    options = dspark_edge.BackendOptions(intra_op_threads=args.threads)
    with dspark_edge.load(str(args.engine), precision="fp32", drafter="none", options=options) as pipe, \
            BatchedTarget(args.engine, manifest, args.threads) as target:
        for rnd in range(args.rounds):
            t0 = time.perf_counter()
            ref = [list(pipe.generate(m, max_new_tokens=args.max_new_tokens).token_ids) for m in messages]
            dt = time.perf_counter() - t0
            rates["one at a time"].append(sum(map(len, ref)) / dt)
            for b in batches:
                t0 = time.perf_counter()
                got = []
                for s in range(0, len(ids), b):
                    got += target.greedy(ids[s:s + b], args.max_new_tokens)
                dt = time.perf_counter() - t0
                rates[f"batch {b}"].append(sum(map(len, got)) / dt)
                same[f"batch {b}"] = sum(x == y for x, y in zip(got, ref))
            print(f"round {rnd + 1}: " + ", ".join(f"{k} {v[-1]:.0f} tok/s" for k, v in rates.items()),
                  file=sys.stderr, flush=True)
    base = rates["one at a time"]
    report = {"engine": str(args.engine), "prompts": len(ids), "max_new_tokens": args.max_new_tokens,
              "rounds": args.rounds, "threads": args.threads,
              "modes": {k: {"tok_s": round(statistics.mean(v), 1),
                            "ratio_to_one_at_a_time": round(statistics.mean(x / y for x, y in zip(v, base)), 2),
                            "answers_identical": same.get(k, len(ids))} for k, v in rates.items()}}
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
