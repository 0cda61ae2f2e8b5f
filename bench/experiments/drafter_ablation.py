"""Which drafter shape to train: backbone layers, Markov rank and the target layers it reads,
compared at one fixed training budget on the same data.

    python bench/experiments/drafter_ablation.py --work runs/drafter --prompts 920 --steps 200 \
        --configs L2-r128-f8.15.22 L1-r128-f8.15.22 L2-r128-f22 L2-r32-f8.15.22

A config ``L<layers>-r<rank>-f<layer>.<layer>…`` reads a subset of the layers the work folder's
shards hold (the target engine's exposed layers). Every config starts from the same
initialisation rule as ``train-drafter`` (backbone from the target's last layers), sees the
same batches (same seed) of the target's answers among the first ``--prompts`` prompts, and is
measured on the recorded held-out answers as ``bench/drafter_heldout.py`` measures a trained
drafter (24 fixed anchors per answer, each slot's Markov input the drafter's own draft). A short budget ranks how fast each shape learns, not where it ends. Each
config trains in ``<work>/ablation/<config>/`` (resumable) and appends one JSON line to
``--out``; configs already there are skipped.

``--train-answers 230,460,920`` trains each config once per size on only the first N answers'
training part (a learning curve: how held-out acceptance grows with data at one budget); every
size is validated on the same recorded held-out answers, and each line also gives τ on 48 of the
answers it trained on (the gap between the two shows how far the drafter memorises instead of
generalising).

    python bench/experiments/drafter_ablation.py --work runs/drafter --prompts 920 --steps 600 \
        --configs L2-r128-f8.15.22 --train-answers 230,460,920
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

CONFIG = re.compile(r"^L(\d+)-r(\d+)-f(\d+(?:\.\d+)*)$")


def parse_config(text: str) -> tuple[int, int, tuple[int, ...]]:
    from dspark_edge.errors import ConfigError

    m = CONFIG.match(text)
    if not m:
        raise ConfigError(f"config {text!r} is not L<layers>-r<rank>-f<layer>.<layer>… (e.g. L2-r128-f8.15.22)")
    return int(m.group(1)), int(m.group(2)), tuple(int(x) for x in m.group(3).split("."))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("runs/drafter"), help="train-drafter work folder")
    ap.add_argument("--prompts", type=int, default=920, help="answers (prompts) to train and validate on")
    ap.add_argument("--steps", type=int, default=200, help="training steps per config")
    ap.add_argument("--configs", nargs="+", default=["L2-r128-f8.15.22", "L1-r128-f8.15.22", "L2-r128-f22",
                                                      "L2-r32-f8.15.22"])
    ap.add_argument("--train-answers", default=None,
                    help="comma-separated sizes: train on the first N answers only (a learning curve)")
    ap.add_argument("--out", type=Path, default=Path("runs/drafter_ablation.jsonl"), help="results, one line each")
    ap.add_argument("--source", default="default", help="the target's source (embeddings, LM head, init)")
    args = ap.parse_args()

    import dataclasses

    import numpy as np
    import torch

    from dspark_edge.errors import ConfigError
    from dspark_edge.manifest import read_manifest
    from dspark_export.drafter.build import build_model, draft_config, init_from_target
    from dspark_export.drafter.data import answer_shards, load_shards
    from dspark_export.drafter.train import TrainOptions, recorded_split, train, validate
    from dspark_export.sources import load_source, resolve_source

    if args.steps < 1:
        raise ConfigError(f"--steps must be at least 1, got {args.steps}")
    configs = [(c, *parse_config(c)) for c in args.configs]
    sizes: list[int | None] = [None]
    if args.train_answers:
        try:
            sizes = [int(x) for x in args.train_answers.split(",")]
        except ValueError:
            raise ConfigError(f"--train-answers takes comma-separated counts, got {args.train_answers!r}") from None
        if min(sizes) < 8 or max(sizes) > args.prompts:
            raise ConfigError(f"--train-answers sizes must lie in 8..{args.prompts} (--prompts), got {args.train_answers}")
    shards = answer_shards(args.work, args.prompts)  # first: names the command when the folder is not a work folder
    opts = json.loads((args.work / "options.json").read_text())
    layers_held = tuple(read_manifest(Path(opts["target_engine"])).hidden_state_layers)
    for name, _, _, feats in configs:
        if not set(feats) <= set(layers_held):
            raise ConfigError(f"{name} reads layers {feats}, but the shards hold only {layers_held}")
    done = set()
    if args.out.is_file():
        done = {json.loads(line)["config"] for line in args.out.read_text().splitlines() if line.strip()}
    data = load_shards(shards)
    train_ids, val_ids = recorded_split(data, args.work, len(data))
    target, _ = load_source(resolve_source(args.source))
    vocab_ids = np.load(args.work / "vocab_ids.npy")
    full_aux = data.aux
    runs = [(f"{c}-a{n}" if n else c, n, nl, r, f) for c, nl, r, f in configs for n in sizes]
    for name, size, n_layers, rank, feats in runs:
        if name in done:
            print(f"[ablation] {name}: already in {args.out}", flush=True)
            continue
        cols = np.concatenate([np.arange(i * target.config.hidden_size, (i + 1) * target.config.hidden_size)
                               for i in (layers_held.index(f) for f in feats)])
        sub = dataclasses.replace(data, aux=full_aux[:, cols]) if len(feats) < len(layers_held) else data
        torch.manual_seed(0)
        cfg = draft_config(target, feats, n_layers, 7, int(vocab_ids.size), rank)
        model = build_model(cfg, target, vocab_ids)
        init_from_target(model, target)
        work = args.work / "ablation" / name
        work.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        ids = train_ids if size is None else train_ids[train_ids < size]
        result = train(model, sub, ids, val_ids, work,
                       TrainOptions(steps=args.steps, validate_every=args.steps, checkpoint_every=50),
                       progress=lambda s, n=name: print(f"[ablation] {n}: {s}", flush=True))
        v = result["history"][-1]  # held-out greedy rounds at the final step (train.validate)
        seen = validate(model, sub, np.random.default_rng(0).choice(ids, size=min(48, ids.size), replace=False),
                        model.cfg.slots)
        rec = {"config": name, "layers": n_layers, "markov_rank": rank, "feature_layers": list(feats),
               "steps": args.steps, "answers": len(data), "trained_on": int(ids.size), "held_out_blocks": v["blocks"],
               "tau": round(v["tau"], 3), "reach": [round(x, 3) for x in v["reach"]],
               "train_tau": round(seen["tau"], 3), "train_reach1": round(seen["reach"][0], 3),
               "trainable_m": round(sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e6, 2),
               "minutes": round((time.perf_counter() - t0) / 60, 1)}
        with args.out.open("a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")
        print(json.dumps(rec), flush=True)
        del sub
    return 0


if __name__ == "__main__":
    from dspark_edge.cli import run_reporting_errors

    sys.exit(run_reporting_errors(main))
