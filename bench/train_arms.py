"""What does one change to drafter training buy? The same steps from one drafter, in several arms.

    python bench/train_arms.py --work runs/campaign-8 --init-from drafters/smollm2-135m-campaign \
        --steps 250 --held-out 200 --arms "bf16=0; bf16=1"
    python bench/train_arms.py --work runs/campaign-9n --init-from drafters/smollm2-135m-campaign \
        --steps 250 --held-out 200 --arms "bf16=1; bf16=1,alpha_ce=0.5,alpha_tv=0.5"
    python bench/train_arms.py --work runs/campaign-9 --init-from drafters/smollm2-135m-campaign \
        --steps 250 --held-out 200 --arms "bf16=1; bf16=1,streams=all; bf16=1,streams=all,new_scale=0.1"

``--work`` is a finished ``train-drafter --data`` work folder (its feature shards, its held-out
split, its package text). Every arm starts from the ``--init-from`` drafter's weights and takes
the same ``--steps`` optimizer steps of ``train`` (the function ``train-drafter`` runs: the same
batches, drawn from (seed, step), the same schedule); the arms differ only in what they set. An
arm is ``KEY=VALUE`` pairs joined by commas, arms are separated by semicolons:

- any numeric or boolean field of ``TrainOptions`` (``bf16``, ``alpha_ce``, ``alpha_tv``,
  ``alpha_conf``, ``lr``, ``warmup``, ``anchors``, ``seqs_per_step``, ``short_share``,
  ``text_share`` …);
- ``streams=own|all``: where the work folder's engine exposes more residual streams than the
  drafter reads, ``all`` widens it to them (``DSparkDraft.widen``, as ``train-drafter --init-from``
  does) and ``own`` (the default) widens it too but holds the new streams' context columns at
  zero (their gradient masked: exactly the drafter on its own streams);
- ``new_scale=C`` (with ``streams=all``): the new streams' features multiplied by C while that
  arm trains and is validated (Adam moves every weight by about the learning rate, so a stream
  several times louder than the old ones moves the context that much more; the result is the
  drafter with C folded into those columns).

Every arm, and the starting weights, is validated in FP32 on the same ``--held-out`` answers
(evenly spaced over the run's held-out set) by uniform anchors and by runtime rounds
(``train.runtime_walk``). Prints JSON: seconds a step, τ and per-position acceptance of each arm.
The work folder is only read; the arms' checkpoints go to a temporary folder.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

EXTRA = {"streams", "new_scale"}
FIXED = {"steps", "seed", "validate_every", "checkpoint_every"}  # the script sets these for every arm alike


def parse_arms(text: str, fields: dict) -> list[tuple[str, dict]]:
    """``"bf16=1; bf16=1,alpha_ce=0.5"`` → [(label, {key: value})], values typed by ``fields``
    (TrainOptions' field name → default value)."""
    from dspark_edge.errors import ConfigError

    arms = []
    for spec in (s.strip() for s in text.split(";")):
        if not spec:
            continue
        kv: dict = {}
        for pair in (p.strip() for p in spec.split(",")):
            key, eq, raw = pair.partition("=")
            key, raw = key.strip(), raw.strip()
            if not eq or not raw:
                raise ConfigError(f"--arms: {pair!r} in arm {spec!r} is not KEY=VALUE")
            if key == "streams":
                if raw not in ("own", "all"):
                    raise ConfigError(f"--arms: streams must be own or all, got {raw!r}")
                kv[key] = raw
            elif key == "new_scale":
                kv[key] = _number(raw, float, key, spec)
            elif key in fields and isinstance(fields[key], (bool, int, float)) and key not in FIXED:
                default = fields[key]
                if isinstance(default, bool):
                    if raw not in ("0", "1", "true", "false"):
                        raise ConfigError(f"--arms: {key} takes 0 or 1, got {raw!r}")
                    kv[key] = raw in ("1", "true")
                else:
                    kv[key] = _number(raw, type(default), key, spec)
            else:
                allowed = sorted(k for k, v in fields.items() if isinstance(v, (bool, int, float))
                                 and k not in FIXED) + sorted(EXTRA)
                raise ConfigError(f"--arms: unknown key {key!r} in arm {spec!r}; choose from {', '.join(allowed)}")
        if "new_scale" in kv and (kv.get("streams") != "all" or kv["new_scale"] <= 0):
            raise ConfigError(f"--arms: new_scale needs streams=all and a value above 0 (arm {spec!r})")
        arms.append((spec, kv))
    if not arms:
        raise ConfigError("--arms names no arm; e.g. --arms \"bf16=0; bf16=1\"")
    return arms


def _number(raw: str, kind, key: str, spec: str):
    from dspark_edge.errors import ConfigError

    try:
        return kind(raw)
    except ValueError:
        raise ConfigError(f"--arms: {key}={raw!r} in arm {spec!r} is not "
                          + ("a whole number" if kind is int else "a number")) from None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True, help="a finished train-drafter --data work folder")
    ap.add_argument("--init-from", type=Path, required=True, help="the drafter folder every arm starts from")
    ap.add_argument("--arms", required=True, help="arms separated by ';', each KEY=VALUE pairs joined by ','")
    ap.add_argument("--source", default="default", help="the target's source (embeddings, LM head)")
    ap.add_argument("--steps", type=int, default=250, help="optimizer steps of each arm (default: %(default)s)")
    ap.add_argument("--held-out", type=int, default=200, help="held-out answers validated (default: %(default)s)")
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
    from drafter_heldout import campaign_sets, evenly

    if args.steps < 1 or args.held_out < 1:
        raise ConfigError("--steps and --held-out must be at least 1")
    arms = parse_arms(args.arms, {f.name: f.default for f in dataclasses.fields(TrainOptions)})
    if not (args.init_from / "drafter.json").is_file():
        raise ConfigError(f"--init-from {args.init_from} is not a drafter folder (no drafter.json); train one with "
                          "`python -m export train-drafter`")
    data, sets = campaign_sets(args.work, with_text=True)
    engine = Path(json.loads((args.work / "options.json").read_text())["target_engine"])
    streams = tuple(read_manifest(engine).hidden_state_layers)
    n_answers = count_sequences(sorted((args.work / "answers").glob("shard-*.npz")))
    held = sets["all"]
    train_ids = np.concatenate([np.setdiff1d(np.arange(n_answers), held), np.arange(n_answers, len(data))])
    val = evenly(held, args.held_out)
    target, _ = load_source(resolve_source(args.source))

    def start_model():
        """The drafter on the engine's streams, and the mask of its context columns it did not read."""
        model, _ = load_drafter(args.init_from, target)
        own = tuple(model.cfg.feature_layers)
        if not set(own) <= set(streams):
            raise ConfigError(f"{args.init_from} reads streams {list(own)}; {engine} (the --work folder's engine) "
                              f"exposes {list(streams)}")
        if own != streams:
            model.widen(streams)
        h = model.cfg.hidden_size
        blocks = [slice(j * h, (j + 1) * h) for j, s in enumerate(streams) if s not in own]
        new = torch.zeros_like(model.fc.weight, dtype=torch.bool)
        for b in blocks:
            new[:, b] = True
        return model, own, new, blocks

    def measure(model, tau: float) -> dict:
        return {"tau": round(tau, 4), "runtime_tau": round(validate_runtime(model, data, val, model.cfg.slots)["tau"], 4)}

    start, own, _, blocks = start_model()
    if any(kv.get("streams") == "all" for _, kv in arms) and not blocks:
        raise ConfigError(f"streams=all: {engine} exposes no stream beyond the {list(own)} {args.init_from} reads; "
                          "pass the work folder of an engine exported with more --hidden-layers")
    out = {"work": str(args.work), "init_from": str(args.init_from), "steps": args.steps,
           "streams": {"drafter": list(own), "engine": list(streams)}, "held_out_answers": int(val.size),
           "start": measure(start, validate(start, data, val, start.cfg.slots)["tau"]), "arms": {}}
    del start
    print(json.dumps(out), file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, kv) in enumerate(arms):
            model, _, new, blocks = start_model()
            wide, scale = kv.get("streams") == "all", kv.get("new_scale", 1.0)
            if not wide and blocks:  # zero gradient, zero moments, decoupled decay of zero: the columns stay zero
                model.fc.weight.register_hook(lambda g, new=new: g.masked_fill(new, 0.0))
            for b in blocks if wide and scale != 1.0 else []:  # in place, on views: the one copy of the features
                data.aux[:, b] *= np.float16(scale)
            model.train()
            folder = Path(tmp) / f"arm-{i}"
            folder.mkdir()
            opts = TrainOptions(steps=args.steps, validate_every=args.steps, checkpoint_every=args.steps,
                                **{k: v for k, v in kv.items() if k not in EXTRA})
            t0 = time.perf_counter()
            result = train(model, data, train_ids, val, folder, opts, answers=n_answers,
                           progress=lambda m, label=label: print(f"[{label}] {m}", file=sys.stderr, flush=True))
            secs = (time.perf_counter() - t0) / args.steps  # the one validation included
            if not wide and blocks and bool(model.fc.weight.detach()[new].any()):
                raise RuntimeError("an arm on the drafter's own streams moved the other streams' columns")
            with torch.no_grad():
                out["arms"][label] = {"s_per_step": round(secs, 3), **measure(model, result["history"][-1]["tau"]),
                                      "reach": [round(r, 4) for r in result["history"][-1]["reach"]]}
            for b in blocks if wide and scale != 1.0 else []:
                data.aux[:, b] /= np.float16(scale)
            print(json.dumps({label: out["arms"][label]}), file=sys.stderr, flush=True)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    from dspark_edge.cli import run_reporting_errors

    sys.exit(run_reporting_errors(main))
