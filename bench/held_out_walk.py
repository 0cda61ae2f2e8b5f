"""What batching the held-out walk buys: the same answers walked one chunk a drafter call and
several answers' chunks a call, in turns, in one process.

    python bench/held_out_walk.py --work runs/campaign-19 --weights drafters/smollm2-135m-campaign \
        --held-out 48 --rows 1,8,16 --repeats 2

The walk (``train.held_out_rounds``) is what the learning curve's validation (24 uniform anchors
an answer) and the calibration stage of ``train-drafter`` (every answer position) run over the
held-out answers. Each row setting walks the same ``--held-out`` answers (evenly spaced over
the work folder's held-out set) both ways, in turns, ``--repeats`` times; every walk's rounds
are checked against the first one's (accepted drafts equal, confidence logits within 1e-4) and a
mismatch is an error. Prints JSON: the median seconds of each walk and its ratio to one chunk a
call.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, required=True, help="a finished train-drafter --data work folder")
    ap.add_argument("--weights", type=Path, required=True, help="the drafter folder that walks")
    ap.add_argument("--held-out", type=int, default=48, help="held-out answers walked (default: %(default)s)")
    ap.add_argument("--rows", default="1,8", help="chunks a drafter call, comma-separated (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=2, help="turns over every setting (default: %(default)s)")
    ap.add_argument("--source", default="default", help="the target's source (embeddings, LM head)")
    args = ap.parse_args()
    os.environ.setdefault("TQDM_DISABLE", "1")

    import numpy as np
    import torch

    from dspark_edge.errors import ConfigError
    from dspark_export.drafter.build import load_drafter
    from dspark_export.drafter.train import held_out_rounds
    from dspark_export.sources import load_source, resolve_source
    from drafter_heldout import campaign_sets, evenly

    try:
        rows = [int(x) for x in args.rows.split(",") if x]
    except ValueError:
        raise ConfigError(f"--rows {args.rows!r}: give whole numbers joined by commas, e.g. 1,8") from None
    if not rows or min(rows) < 1 or args.held_out < 1 or args.repeats < 1:
        raise ConfigError("--rows, --held-out and --repeats must be at least 1")
    data, sets = campaign_sets(args.work)
    held = sets["all"]
    ids = evenly(held, args.held_out)
    target, _ = load_source(resolve_source(args.source))
    model, _ = load_drafter(args.weights, target)
    torch.set_grad_enabled(False)
    walks = {"every position": None, "24 anchors": 24}
    secs: dict = {(w, r): [] for w in walks for r in rows}
    first: dict = {}
    for _ in range(args.repeats):
        for r in rows:
            for name, anchors in walks.items():
                t0 = time.perf_counter()
                out = held_out_rounds(model, data, ids, model.cfg.slots, anchors=anchors, rows=r)
                secs[(name, r)].append(time.perf_counter() - t0)
                ref = first.setdefault(name, out)
                if not (np.array_equal(out[0], ref[0]) and np.array_equal(out[2], ref[2])
                        and np.allclose(out[1], ref[1], atol=1e-4)):
                    raise RuntimeError(f"the walk over {name} at rows={r} differs from the first walk")
    result = {"work": str(args.work), "weights": str(args.weights), "held_out_answers": int(ids.size),
              "blocks": {name: int(first[name][0].size) for name in walks}, "walks": {}}
    for name in walks:
        base = float(np.median(secs[(name, rows[0])]))
        result["walks"][name] = {str(r): {"median_s": round(float(np.median(secs[(name, r)])), 2),
                                          "vs_first": round(base / float(np.median(secs[(name, r)])), 2)}
                                 for r in rows}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    from dspark_edge.cli import run_reporting_errors

    sys.exit(run_reporting_errors(main))
