"""What does the engine's DSpark drafter add to the resident memory of its target?

    python bench/drafter_memory.py --engine engines/smollm2-135m [--precisions fp32,int8]

Each measurement runs in a fresh process: the FP32 target alone after a 64-token answer, then
the target with the drafter at each precision after the same answer decoded with it. RSS is
read after ``malloc_trim`` (glibc), so freed heap does not count.

An engine whose target gathers from a memory-mapped embedding table (``embedding_tables`` in
its manifest) holds only the rows it has read; a drafter whose LM head is that table
(``drafter.head`` "target_table") reads all of it every round, paging the whole table in. Those
pages are the target's own table, counted once: the drafter's addition is its RSS growth less
the table pages it paged in, and the target's footprint it is compared with counts the whole
table (what the target holds resident once anything reads every row, and what an engine
without a table file holds from the start). Mapped files' pages count in RSS once mapped, and
on kernels that cache files in large folios (ext4 on Linux 6.x) a one-row read maps up to
2 MiB around it, so mapped tables read at random soon count whole; unlike anonymous memory the
kernel can drop those clean pages under pressure and read them again when needed, so the
anonymous part of the addition is reported too. Prints JSON: RSS in MiB, the table's resident
pages, the drafter's addition (all of it, and its anonymous part) and their shares of the
target's footprint (the issue's bar: at most 15 %).
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
def anon():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("RssAnon:")) / 1024
def table_pages():
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and not line.startswith(("Rss", "Size")):
                inside = line.rstrip().endswith("embed_tokens.npy")
            elif inside and line.startswith("Rss:"):
                total += int(head[1])
    return total / 1024
import numpy, onnxruntime, tokenizers  # the libraries' own share, before any model
base = rss()
import dspark_edge
engine, drafter = sys.argv[1], sys.argv[2]
pipe = dspark_edge.load(engine, "fp32", drafter=None if drafter == "none" else f"dspark:{drafter}")
kw = {} if drafter == "none" else {"draft_tokens": max(pipe.drafter.blocks) - 1}
pipe.generate("Why is the sky blue?", max_new_tokens=64, ignore_eos=True, **kw)
m = pipe.manifest
table = next((t for t in m.embedding_tables if t.graph == pipe.target.file), None)
table_mib = 0.0 if table is None else m.model.vocab_size * m.model.hidden_size * 4 / 2**20
print(json.dumps({"base": base, "rss": rss(), "anon": anon(), "table_rss": table_pages(), "table_mib": table_mib,
                  "drafter_head": None if m.drafter is None else m.drafter.head}))
"""


def measure(engine: str, drafter: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, engine, drafter], capture_output=True, text=True, timeout=900,
                         check=False)
    if out.returncode:
        raise SystemExit(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--precisions", default="fp32,int8", help="drafter precisions to measure")
    args = ap.parse_args()
    plain = measure(args.engine, "none")
    unread = plain["table_mib"] - plain["table_rss"]  # table pages the target alone never touched
    target = plain["rss"] - plain["base"] + unread
    report = {"engine": args.engine, "target_rss_mib": round(plain["rss"], 1),
              "target_table_resident_mib": round(plain["table_rss"], 1),
              "target_footprint_mib": round(target, 1), "drafter": {}}
    for p in args.precisions.split(","):
        m = measure(args.engine, p)
        added = m["rss"] - plain["rss"] - (m["table_rss"] - plain["table_rss"])
        added_anon = m["anon"] - plain["anon"]
        report["drafter"][p] = {"rss_mib": round(m["rss"], 1), "table_resident_mib": round(m["table_rss"], 1),
                                "head": m["drafter_head"], "added_mib": round(added, 1),
                                "added_share_of_target": round(added / target, 3),
                                "added_anonymous_mib": round(added_anon, 1),
                                "added_anonymous_share_of_target": round(added_anon / target, 3)}
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
