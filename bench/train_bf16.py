"""What does bfloat16 autocast buy a DSpark drafter's training step on this CPU?

    python bench/train_bf16.py --target engines/smollm2-135m --work runs/drafter-work [--steps 10 --rounds 3]

The drafter train-drafter would build (the work folder's answer shards with features and its
draft vocabulary, which a train-drafter run leaves there) takes ``--steps`` optimizer steps in
FP32, then as many under ``torch.autocast("cpu", dtype=torch.bfloat16)``, alternating for
``--rounds`` rounds on the same batches, each mode from the same starting weights. Prints JSON:
seconds per step of each, their ratio, the CPU's bf16 flags, and the loss of each mode's last
step (a sanity check, not a measure of what bf16 costs in held-out τ: that needs a full run).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import numpy as np


def cpu_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return sorted(f for f in flags if "bf16" in f)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True, help="a train-drafter work folder (data/ and vocab_ids.npy)")
    ap.add_argument("--source", default="default")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    import torch

    from dspark_edge.manifest import read_manifest
    from dspark_export.drafter.build import build_model, draft_config, init_from_target
    from dspark_export.drafter.data import load_shards
    from dspark_export.drafter.train import TrainOptions, forward_batch, loss_of, make_batch
    from dspark_export.sources import load_source, resolve_source

    manifest = read_manifest(args.target)
    target, _ = load_source(resolve_source(args.source))
    data = load_shards(sorted((args.work / "data").glob("*.npz")))
    vocab = np.load(args.work / "vocab_ids.npy")
    cfg = draft_config(target, manifest.hidden_state_layers, 2, 7, int(vocab.size), 128)
    base = build_model(cfg, target, vocab)
    init_from_target(base, target)
    opts = TrainOptions()
    rng = np.random.default_rng(0)
    batches = [make_batch(data, rng.choice(len(data), 8, replace=False), opts.anchors, cfg.slots,
                          base.to_draft.numpy(), rng, opts.short_block, opts.short_share) for _ in range(args.steps)]
    times = {"fp32": [], "bf16": []}
    last = {}
    for _ in range(args.rounds):
        for mode in ("fp32", "bf16"):
            model = copy.deepcopy(base).train()
            params = [p for p in model.parameters() if p.requires_grad]
            opt = torch.optim.AdamW(params, lr=opts.lr)
            t0 = time.perf_counter()
            for batch in batches:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16"):
                    out = forward_batch(model, batch)
                    loss, _ = loss_of(out, batch, opts, cfg.slots)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            times[mode].append((time.perf_counter() - t0) / len(batches))
            last[mode] = float(loss.detach())
            print(f"[{mode}] {times[mode][-1]:.2f} s/step", file=sys.stderr, flush=True)
    fp32, bf16 = float(np.median(times["fp32"])), float(np.median(times["bf16"]))
    print(json.dumps({"cpu_bf16_flags": cpu_flags(), "steps": args.steps, "rounds": args.rounds,
                      "fp32_s_per_step": round(fp32, 3), "bf16_s_per_step": round(bf16, 3),
                      "speedup": round(fp32 / bf16, 3), "last_loss": last}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
