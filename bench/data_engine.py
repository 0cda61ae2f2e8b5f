"""How fast does the data engine (`python -m export data`) answer prompts, by backend and batch
size, against the runtime answering them one at a time, and are the answers the same?

On the same training prompts, in rounds that alternate every mode: the runtime's plain greedy
decoding (one prompt at a time, as `train-drafter` used to answer; left out with
``--no-one-at-a-time``) and the data engine's batched greedy pass on each ``--backends`` entry
(``genai``: onnxruntime-genai over the engine's FP32 graph, batches of at most 32; ``torch``: the engine's source model
in PyTorch FP32 on the CPU) at each ``--batch`` size. Prints answer tokens per second of each,
the ratio to the first mode in the same round, and how many answers are token-for-token the
first mode's.

    .venv/bin/python bench/data_engine.py --engine engines/smollm2-135m --prompts 64 --batch 1,8,32
    .venv/bin/python bench/data_engine.py --engine engines/smollm2-135m --prompts 128 --batch 32,64,128 \
        --backends genai,torch --no-one-at-a-time --rounds 1
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
from dspark_export.data_engine import GENAI_MAX_BATCH, BatchedTarget, TorchTarget  # noqa: E402
from dspark_export.drafter.prompts import training_prompts  # noqa: E402

ONE = "one at a time"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", type=Path, default=Path("engines/smollm2-135m"))
    ap.add_argument("--prompts", type=int, default=64, help="training prompts per round (default: %(default)s)")
    ap.add_argument("--batch", default="1,8,32", help="batch sizes of the data engine (default: %(default)s)")
    ap.add_argument("--backends", default="genai", help="genai and/or torch, comma-separated (default: %(default)s)")
    ap.add_argument("--no-one-at-a-time", action="store_true", help="leave out the runtime's one-at-a-time answers")
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not set(backends) <= {"genai", "torch"}:
        ap.error(f"--backends: genai and/or torch, not {args.backends!r}")
    manifest = read_manifest(args.engine)
    tok = Tokenizer.from_engine(args.engine, manifest)
    messages = [r["messages"] for r in training_prompts(0)[:args.prompts]]
    ids = [tok.encode_chat(m) for m in messages]
    modes = ([] if args.no_one_at_a_time else [ONE]) + [f"{be} batch {b}" for be in backends for b in batches
                                                        if be != "genai" or b <= GENAI_MAX_BATCH]
    rates: dict[str, list[float]] = {m: [] for m in modes}
    same: dict[str, int] = {}
    options = dspark_edge.BackendOptions(intra_op_threads=args.threads)
    pipe, targets = None, {}
    try:
        if not args.no_one_at_a_time:
            pipe = dspark_edge.load(str(args.engine), precision="fp32", drafter="none", options=options)
        if "genai" in backends:
            targets["genai"] = BatchedTarget(args.engine, manifest, args.threads)
        if "torch" in backends:
            targets["torch"] = TorchTarget(args.engine, manifest, threads=args.threads)
        for rnd in range(args.rounds):
            first = None
            for mode in modes:
                t0 = time.perf_counter()
                if mode == ONE:
                    got = [list(pipe.generate(m, max_new_tokens=args.max_new_tokens).token_ids) for m in messages]
                else:
                    be, _, b = mode.split()
                    got = []
                    for s in range(0, len(ids), int(b)):
                        got += targets[be].greedy(ids[s:s + int(b)], args.max_new_tokens)
                dt = time.perf_counter() - t0
                rates[mode].append(sum(map(len, got)) / dt)
                first = got if first is None else first
                same[mode] = sum(x == y for x, y in zip(got, first))
            print(f"round {rnd + 1}: " + ", ".join(f"{k} {v[-1]:.0f} tok/s" for k, v in rates.items()),
                  file=sys.stderr, flush=True)
    finally:
        if pipe is not None:
            pipe.close()
        for t in targets.values():
            t.close()
    base = rates[modes[0]]
    report = {"engine": str(args.engine), "prompts": len(ids), "max_new_tokens": args.max_new_tokens,
              "rounds": args.rounds, "threads": args.threads, "reference": modes[0],
              "modes": {k: {"tok_s": round(statistics.mean(v), 1),
                            "ratio_to_reference": round(statistics.mean(x / y for x, y in zip(v, base)), 2),
                            "answers_identical": same[k]} for k, v in rates.items()}}
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
