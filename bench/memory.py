"""Resident memory of one target precision: one verify width in use vs every listed width.

    python bench/memory.py --engine engines/smollm2-135m --precision fp32

All widths run through one ONNX Runtime session (one copy of the weights), so using every
width should cost little more than using one. Prints JSON with RSS in MiB after loading,
after width-1 steps, and after every listed width has run.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import psutil

import dspark_edge


def rss_mib() -> float:
    return psutil.Process().memory_info().rss / 2**20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--precision", default=None)
    ap.add_argument("--depth", type=int, default=256)
    args = ap.parse_args()
    before = rss_mib()
    pipe = dspark_edge.load(args.engine, args.precision, verify_hashes=False)
    loaded = rss_mib()
    t = pipe.target
    rng = np.random.default_rng(0)
    vocab = pipe.manifest.model.vocab_size

    def run(widths, rounds=20):
        cache = t.new_cache()
        t.prefill(cache, rng.integers(0, vocab, size=args.depth, dtype=np.int64))
        for _ in range(rounds):
            for w in widths:
                t.step(cache, rng.integers(0, vocab, size=w, dtype=np.int64))
                cache.commit(1)

    run([1])
    one = rss_mib()
    run(list(t.widths))
    every = rss_mib()
    print(json.dumps({"engine": args.engine, "precision": t.precision, "widths": list(t.widths),
                      "rss_mib": {"python_and_libraries": round(before, 1), "after_load": round(loaded, 1),
                                  "width_1_in_use": round(one, 1), "every_width_in_use": round(every, 1)},
                      "every_over_one": round(every / one, 3)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
