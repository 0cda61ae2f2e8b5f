"""The target's verify pass and the DSpark drafter's round, alone and taking turns, for each
thread-spinning setting of the two ONNX Runtime sessions (each setting in its own process).

    python bench/experiments/drafter_threads.py --engine engines/smollm2-135m

Prints the median ms of a width-2 verify after 64 cached positions and of a block-8 drafter
round, measured alone and alternating (draft, verify, draft, ...), as JSON lines. The runtime's
choice (``dspark_edge.load`` with a drafter) is: target spinning as configured (on by default),
drafter spinning off.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

SETTINGS = [(True, False), (False, False), (True, True)]  # (target spins, drafter spins)


def measure(engine: str, target_spin: bool, drafter_spin: bool, repeats: int) -> dict:
    import numpy as np

    import dspark_edge
    from dspark_edge.backends import BackendOptions
    from dspark_edge.decoder import DecoderModel
    from dspark_edge.drafters.dspark import DSparkDrafter
    from dspark_edge.errors import ConfigError

    m = dspark_edge.read_manifest(engine)
    if m.drafter is None:
        raise ConfigError(f"{engine} has no DSpark drafter; add one with `python -m export drafter`")
    target = DecoderModel(m, engine, "fp32", "onnxruntime", BackendOptions(allow_spinning=target_spin))
    drafter = DSparkDrafter(engine, m, "fp32", options=BackendOptions(allow_spinning=drafter_spin))
    cache = target.new_cache()
    out = target.session.forward(cache, np.arange(100, 164, dtype=np.int64))
    cache.commit(64)
    drafter.begin(())
    drafter.base(out.hidden.astype(np.float32), 5, 64, 7)

    def timed(fn) -> float:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    def verify():
        target.session.forward(cache, np.array([7, 8], dtype=np.int64))

    def draft():
        drafter.base(None, 5, 64, 7)

    for _ in range(5):
        verify()
        draft()
    alone_v = [timed(verify) for _ in range(repeats)]
    alone_d = [timed(draft) for _ in range(repeats)]
    alt = [(timed(draft), timed(verify)) for _ in range(repeats)]
    med = lambda xs: round(float(np.median(xs)), 2)  # noqa: E731
    return {"target_spinning": target_spin, "drafter_spinning": drafter_spin, "verify_w2_alone_ms": med(alone_v),
            "drafter_round_alone_ms": med(alone_d), "alternating_draft_ms": med([a for a, _ in alt]),
            "alternating_verify_ms": med([b for _, b in alt])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default="engines/smollm2-135m", help="engine folder with a DSpark drafter")
    ap.add_argument("--repeats", type=int, default=30, help="timed calls per measurement (default: %(default)s)")
    ap.add_argument("--one", nargs=2, type=int, metavar=("TARGET_SPINS", "DRAFTER_SPINS"),
                    help="measure one setting in this process (used by the parent run)")
    args = ap.parse_args()
    if args.repeats < 1:
        from dspark_edge.errors import ConfigError

        raise ConfigError(f"--repeats must be at least 1, got {args.repeats}")
    if args.one:
        print(json.dumps(measure(args.engine, bool(args.one[0]), bool(args.one[1]), args.repeats)), flush=True)
        return 0
    for t, d in SETTINGS:  # one process per setting: thread pools are per process
        rc = subprocess.call([sys.executable, __file__, "--engine", args.engine, "--repeats", str(args.repeats),
                              "--one", str(int(t)), str(int(d))])
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    from dspark_edge.cli import run_reporting_errors

    sys.exit(run_reporting_errors(main))
