"""Soak, scaled to CI: repeated generations across drafters and widths leak nothing."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from soak import soak  # noqa: E402


def test_soak_tiny(tiny_engine):
    r = soak(str(tiny_engine), "fp32", runs=300, max_new_tokens=16, warmup=60)
    assert r["repeat_mismatches"] == 0
    assert r["fds_end"] <= r["fds_after_warmup"]
    assert r["rss_growth_pct"] < 5.0, r
