"""Is a DSpark drafter worth more when it reads more of the target's residual streams?

    python bench/feature_streams_ab.py --work runs/campaign-9 --init-from drafters/smollm2-135m-campaign \
        --steps 300 --held-out 200

``--work`` is a finished ``train-drafter --data`` work folder made on an engine that exposes
more streams than the ``--init-from`` drafter reads (for example exported with
``--hidden-layers 8,15,22,29`` for a drafter reading 8, 15 and 22). From that drafter's
weights, widened to the engine's streams (``DSparkDraft.widen``: the new streams' context
columns start at zero), the same ``--steps`` optimizer steps of ``train`` (the same batches,
drawn from (seed, step), the same schedule, bf16 autocast as the campaign trains) are taken
twice: once with the new columns held at zero (their gradient masked: exactly the drafter it
started from, trained on its own streams) and once free. Both are validated in FP32 on the same
``--held-out`` answers (evenly spaced over the run's held-out set) by uniform anchors and by
runtime rounds (``train.runtime_walk``), and the starting weights too. Prints JSON. The work
folder is only read; the two runs' checkpoints go to a temporary folder.
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
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps of each run (default: %(default)s)")
    ap.add_argument("--held-out", type=int, default=200, help="held-out answers validated (default: %(default)s)")
    ap.add_argument("--fp32", action="store_true", help="train in FP32 instead of under bf16 autocast")
    ap.add_argument("--arms", default="narrow,wide",
                    help="comma-separated: narrow, wide, and wide@C: the new streams' features multiplied by C "
                         "while training (Adam moves every weight by about the learning rate, so a new stream "
                         "several times louder than the old ones moves the context that much more; trained and "
                         "validated on the scaled features, the result is the drafter with C folded into those "
                         "columns) (default: %(default)s)")
    args = ap.parse_args()
    os.environ.setdefault("TQDM_DISABLE", "1")

    import torch

    from dspark_edge.errors import ConfigError
    from dspark_edge.manifest import read_manifest
    from dspark_export.drafter.build import load_drafter
    from dspark_export.drafter.data import count_sequences
    from dspark_export.drafter.train import TrainOptions, train, validate, validate_runtime
    from dspark_export.sources import load_source, resolve_source

    sys.path.insert(0, str(ROOT / "bench"))
    from drafter_heldout import campaign_sets

    if args.steps < 1 or args.held_out < 1:
        raise ConfigError("--steps and --held-out must be at least 1")
    arms = {}
    for arm in args.arms.split(","):
        name, _, c = arm.partition("@")
        try:
            scale = float(c) if c else 1.0
        except ValueError:
            scale = -1.0
        if name not in ("narrow", "wide") or (c and name != "wide") or scale <= 0:
            raise ConfigError(f"--arms: {arm!r} is not narrow, wide or wide@C with C > 0")
        arms[arm] = scale
    if not (args.init_from / "drafter.json").is_file():
        raise ConfigError(f"--init-from {args.init_from} is not a drafter folder (no drafter.json); train one with "
                          "`python -m export train-drafter`")
    data, sets = campaign_sets(args.work, with_text=True)
    engine = Path(json.loads((args.work / "options.json").read_text())["target_engine"])
    streams = tuple(read_manifest(engine).hidden_state_layers)
    n_answers = count_sequences(sorted((args.work / "answers").glob("shard-*.npz")))
    held = sets["all"]
    train_ids = np.concatenate([np.setdiff1d(np.arange(n_answers), held), np.arange(n_answers, len(data))])
    val = held[np.linspace(0, held.size - 1, min(args.held_out, held.size)).astype(int)]
    target, _ = load_source(resolve_source(args.source))

    def widened():
        model, _ = load_drafter(args.init_from, target)
        narrow = tuple(model.cfg.feature_layers)
        if narrow == streams or not set(narrow) < set(streams):
            raise ConfigError(f"{args.init_from} reads streams {list(narrow)}; {engine} (the --work folder's engine) "
                              f"exposes {list(streams)}: pass a work folder made on an engine exposing more")
        model.widen(streams)
        h = model.cfg.hidden_size
        new = torch.zeros_like(model.fc.weight, dtype=torch.bool)
        for j, s in enumerate(streams):
            new[:, j * h:(j + 1) * h] = s not in narrow
        return model, narrow, new

    def measure(model, tau: float) -> dict:
        return {"tau": round(tau, 4), "runtime_tau": round(validate_runtime(model, data, val, model.cfg.slots)["tau"], 4)}

    start, narrow, _ = widened()
    out = {"work": str(args.work), "init_from": str(args.init_from), "streams": {"narrow": list(narrow),
           "wide": list(streams)}, "steps": args.steps, "bf16": not args.fp32, "held_out_answers": int(val.size),
           "start": measure(start, validate(start, data, val, start.cfg.slots)["tau"])}
    print(json.dumps(out), file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for arm, scale in arms.items():
            model, narrow, new = widened()
            h = model.cfg.hidden_size
            blocks = [slice(j * h, (j + 1) * h) for j, s in enumerate(streams) if s not in narrow]
            for b in blocks:  # in place, on views: the one copy of the features stays
                data.aux[:, b] *= np.float16(scale)
            if arm == "narrow":  # zero gradient, zero moments, decoupled decay of zero: the columns stay zero
                model.fc.weight.register_hook(lambda g, new=new: g.masked_fill(new, 0.0))
            model.train()
            folder = Path(tmp) / arm
            folder.mkdir()
            opts = TrainOptions(steps=args.steps, validate_every=args.steps, checkpoint_every=args.steps,
                                bf16=not args.fp32)
            t0 = time.perf_counter()
            result = train(model, data, train_ids, val, folder, opts, answers=n_answers,
                           progress=lambda m, arm=arm: print(f"[{arm}] {m}", file=sys.stderr, flush=True))
            secs = (time.perf_counter() - t0) / args.steps  # the one validation included
            if arm == "narrow" and bool(model.fc.weight.detach()[new].any()):
                raise RuntimeError("the narrow arm's new-stream columns moved; its result would not be the narrow drafter's")
            with torch.no_grad():  # validated on the features it trained on (the narrow arm never reads them)
                out[arm] = {"s_per_step": round(secs, 3), **measure(model, result["history"][-1]["tau"]),
                            "reach": [round(r, 4) for r in result["history"][-1]["reach"]]}
            for b in blocks:
                data.aux[:, b] /= np.float16(scale)
            print(json.dumps({arm: out[arm]}), file=sys.stderr, flush=True)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    from dspark_edge.cli import run_reporting_errors

    sys.exit(run_reporting_errors(main))
