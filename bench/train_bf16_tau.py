"""Does training under bfloat16 autocast cost a DSpark drafter held-out τ?

    python bench/train_bf16_tau.py --work runs/campaign-8 --init-from drafters/smollm2-135m-campaign \
        --steps 200 --held-out 300

From one drafter folder's weights, the same ``--steps`` optimizer steps of ``train`` (the
function ``train-drafter`` runs: the same batches, drawn from (seed, step), the same schedule)
are taken twice, once in FP32 and once under ``torch.autocast("cpu", dtype=torch.bfloat16)``,
on a finished ``train-drafter --data`` work folder's feature shards (its answers and package
text, its held-out split). Both results are then validated in FP32 on the same ``--held-out``
answers (evenly spaced over the run's held-out set), by uniform anchors and by runtime rounds
(``train.runtime_walk``), and the starting weights too, for scale. Prints JSON: seconds a step
and τ of each. The work folder is only read; the two runs' checkpoints go to a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True, help="a finished train-drafter --data work folder")
    ap.add_argument("--init-from", type=Path, required=True, help="the drafter folder both runs start from")
    ap.add_argument("--source", default="default", help="the target's source (embeddings, LM head)")
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps of each run (default: %(default)s)")
    ap.add_argument("--held-out", type=int, default=300, help="held-out answers validated (default: %(default)s)")
    args = ap.parse_args()
    os.environ.setdefault("TQDM_DISABLE", "1")

    import torch

    from dspark_edge.errors import ConfigError
    from dspark_export.drafter.build import load_drafter
    from dspark_export.drafter.data import count_sequences
    from dspark_export.drafter.train import (
        TrainOptions,
        train,
        validate,
        validate_runtime,
    )
    from dspark_export.sources import load_source, resolve_source

    sys.path.insert(0, str(ROOT / "bench"))
    from drafter_heldout import campaign_sets

    if args.steps < 1 or args.held_out < 1:
        raise ConfigError("--steps and --held-out must be at least 1")
    if not (args.init_from / "drafter.json").is_file():
        raise ConfigError(f"--init-from {args.init_from} is not a drafter folder (no drafter.json); train one with "
                          "`python -m export train-drafter`")
    data, sets = campaign_sets(args.work, with_text=True)
    n_answers = count_sequences(sorted((args.work / "answers").glob("shard-*.npz")))
    held = sets["all"]
    train_ids = np.concatenate([np.setdiff1d(np.arange(n_answers), held), np.arange(n_answers, len(data))])
    val = held[np.linspace(0, held.size - 1, min(args.held_out, held.size)).astype(int)]
    target, _ = load_source(resolve_source(args.source))

    def measure(model, tau: float) -> dict:
        return {"tau": round(tau, 4), "runtime_tau": round(validate_runtime(model, data, val, model.cfg.slots)["tau"], 4)}

    start, _ = load_drafter(args.init_from, target)
    out = {"work": str(args.work), "init_from": str(args.init_from), "steps": args.steps,
           "held_out_answers": int(val.size), "start": measure(start, validate(start, data, val, start.cfg.slots)["tau"])}
    print(json.dumps(out), file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("fp32", "bf16"):
            model, _ = load_drafter(args.init_from, target)
            model.train()
            folder = Path(tmp) / mode
            folder.mkdir()
            # train validates once, at its last step, on the same answers: its uniform-anchor τ
            opts = TrainOptions(steps=args.steps, validate_every=args.steps, checkpoint_every=args.steps,
                                bf16=mode == "bf16")
            t0 = time.perf_counter()
            result = train(model, data, train_ids, val, folder, opts, answers=n_answers,
                           progress=lambda m, mode=mode: print(f"[{mode}] {m}", file=sys.stderr, flush=True))
            secs = (time.perf_counter() - t0) / args.steps  # the one validation included
            with torch.no_grad():
                out[mode] = {"s_per_step": round(secs, 3), **measure(model, result["history"][-1]["tau"])}
            print(json.dumps({mode: out[mode]}), file=sys.stderr, flush=True)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    from dspark_edge.cli import run_reporting_errors

    sys.exit(run_reporting_errors(main))
