"""Soak, scaled to CI: repeated generations across drafters and widths leak nothing."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def test_soak_tiny(tiny_engine, tiny_draft_poor):
    """1,000 short generations on one pipeline: plain, n-gram and a draft model, each with the
    scheduler and at every fixed draft length, greedy and sampled. In a process of its own: the
    test process holds other tests' pipelines, whose telemetry threads open files now and then,
    and those must not count as this pipeline's descriptors or threads."""
    code = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(BENCH)!r})
        from soak import soak
        r = soak({str(tiny_engine)!r}, "fp32", runs=1000, max_new_tokens=16, warmup=100,
                 draft_model={str(tiny_draft_poor)!r})
        print(json.dumps(r))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(r["modes"]) == 1 + 2 * (1 + 3)
    assert r["repeat_mismatches"] == 0 and r["distinct_keys"] > len(r["modes"])
    assert r["fds_end"] <= r["fds_after_warmup"] and r["threads_end"] <= r["threads_after_warmup"], r
    assert r["rss_growth_pct"] < 5.0, r
