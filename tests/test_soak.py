"""Soak, scaled to CI: repeated generations across drafters and widths leak nothing."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from soak import soak  # noqa: E402


def test_soak_tiny(tiny_engine, tiny_draft_poor):
    """1,000 short generations on one pipeline: plain, n-gram and a draft model, each with the
    scheduler and at every fixed draft length, greedy and sampled."""
    r = soak(str(tiny_engine), "fp32", runs=1000, max_new_tokens=16, warmup=100, draft_model=str(tiny_draft_poor))
    assert len(r["modes"]) == 1 + 2 * (1 + 3)
    assert r["repeat_mismatches"] == 0 and r["distinct_keys"] > len(r["modes"])
    assert r["fds_end"] <= r["fds_after_warmup"] and r["threads_end"] <= r["threads_after_warmup"]
    assert r["rss_growth_pct"] < 5.0, r
