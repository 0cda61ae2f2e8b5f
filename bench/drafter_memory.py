"""What does the engine's DSpark drafter add to the resident memory of its target?

    python bench/drafter_memory.py --engine engines/smollm2-135m [--precisions fp32,int8]

Each measurement runs in a fresh process: the FP32 target alone after a 64-token answer, then
the target with the drafter at each precision after the same answer decoded with it. Prints
JSON: RSS in MiB (after ``malloc_trim`` on glibc, so freed heap does not count), the drafter's
addition, and that addition as a share of the target's own RSS over the interpreter's baseline
(the issue's bar: at most 15 %).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import ctypes, json, sys
import psutil
def rss():
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return psutil.Process().memory_info().rss / 2**20
import numpy, onnxruntime, tokenizers  # the libraries' own share, before any model
base = rss()
import dspark_edge
engine, drafter = sys.argv[1], sys.argv[2]
pipe = dspark_edge.load(engine, "fp32", drafter=None if drafter == "none" else f"dspark:{drafter}")
kw = {} if drafter == "none" else {"draft_tokens": max(pipe.drafter.blocks) - 1}
pipe.generate("Why is the sky blue?", max_new_tokens=64, ignore_eos=True, **kw)
print(json.dumps({"base": base, "rss": rss()}))
"""


def measure(engine: str, drafter: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, engine, drafter], capture_output=True, text=True, timeout=900)
    if out.returncode:
        raise SystemExit(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--precisions", default="fp32,int8", help="drafter precisions to measure")
    args = ap.parse_args()
    plain = measure(args.engine, "none")
    target = plain["rss"] - plain["base"]
    report = {"engine": args.engine, "target_rss_mib": round(plain["rss"], 1),
              "target_over_baseline_mib": round(target, 1), "drafter": {}}
    for p in args.precisions.split(","):
        m = measure(args.engine, p)
        added = m["rss"] - plain["rss"]
        report["drafter"][p] = {"rss_mib": round(m["rss"], 1), "added_mib": round(added, 1),
                                "added_share_of_target": round(added / target, 3)}
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
