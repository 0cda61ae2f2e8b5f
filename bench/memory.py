"""Resident memory of one target precision: one verify width in use vs every listed width.

    python bench/memory.py --engine engines/smollm2-135m --precision fp32

All widths run through one ONNX Runtime session (one copy of the weights), so using every
width should cost little more than using one. Prints JSON with RSS in MiB after loading,
after width-1 steps, and after every listed width has run; on glibc also after
``malloc_trim(0)``, which returns freed heap the allocator kept (so the trimmed numbers show
what is live, the untrimmed ones what the OS sees).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys

import numpy as np
import psutil

import dspark_edge


def rss_mib() -> float:
    return psutil.Process().memory_info().rss / 2**20


def trimmed_rss_mib() -> float | None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return None
    return round(rss_mib(), 1)


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
    one_trimmed = trimmed_rss_mib()
    run(list(t.widths))
    every = rss_mib()
    every_trimmed = trimmed_rss_mib()
    report = {"engine": args.engine, "precision": t.precision, "widths": list(t.widths),
              "rss_mib": {"python_and_libraries": round(before, 1), "after_load": round(loaded, 1),
                          "width_1_in_use": round(one, 1), "every_width_in_use": round(every, 1)},
              "every_over_one": round(every / one, 3)}
    if one_trimmed and every_trimmed:
        report["rss_after_malloc_trim_mib"] = {"width_1_in_use": one_trimmed, "every_width_in_use": every_trimmed}
        report["every_over_one_after_malloc_trim"] = round(every_trimmed / one_trimmed, 3)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
