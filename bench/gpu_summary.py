"""The summary scripts/gpu_check.sh writes: its steps (exit status, seconds), the GPU, the GPU
tests' JUnit counts, the benchmark's configurations and the engines the manifest lists.

    python bench/gpu_summary.py --out runs/gpu_check --engine DIR --seconds 412 \
        --step export=0:95 --step trt=0:180 ...
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def summarize(out: Path, engine: Path, seconds: int, steps: dict[str, tuple[int, int]]) -> dict:
    summary: dict = {"engine": str(engine), "seconds": seconds,
                     "steps": {k: {"exit": code, "seconds": secs} for k, (code, secs) in steps.items()},
                     "passed": all(code == 0 for code, _ in steps.values()) and bool(steps)}
    missing = out / "missing.txt"  # prerequisites the check found missing (it stops before any step)
    if missing.exists() and missing.read_text().strip():
        summary["missing"] = missing.read_text().strip().splitlines()
    gpu = out / "gpu.csv"
    summary["gpu"] = gpu.read_text().strip() if gpu.exists() else None
    junit = out / "gpu_tests.xml"
    if junit.exists():
        root = ET.parse(junit).getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        summary["tests"] = counts
        summary["passed"] = summary["passed"] and counts["failures"] == counts["errors"] == 0
    bench = out / "bench.json"
    if bench.exists():
        report = json.loads(bench.read_text())
        summary["bench"] = report.get("configs", {})
        if report.get("errors"):
            summary["bench_errors"] = report["errors"]
    manifest = engine / "manifest.json"
    if manifest.exists():
        summary["engines"] = json.loads(manifest.read_text()).get("tensorrt", [])
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="the GPU check's output folder")
    ap.add_argument("--engine", type=Path, required=True, help="the engine folder it used")
    ap.add_argument("--seconds", type=int, required=True, help="its total wall time")
    ap.add_argument("--step", action="append", default=[], metavar="NAME=EXIT:SECONDS", help="one step (repeatable)")
    args = ap.parse_args(argv)
    if not args.out.is_dir():
        print(f"error: --out {args.out} is not a folder (the GPU check's output folder)", file=sys.stderr)
        return 2
    steps = {}
    for item in args.step:
        name, _, rest = item.partition("=")
        code, _, secs = rest.partition(":")
        steps[name] = (int(code), int(secs))
    summary = summarize(args.out, args.engine, args.seconds, steps)
    text = json.dumps(summary, indent=1)
    (args.out / "summary.json").write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
