"""Held-out greedy acceptance of trained DSpark drafters on one fixed set of held-out answers.

    python bench/drafter_heldout.py --work runs/drafter --prompts 512 \
        --weights runs/drafter-v1/weights drafters/smollm2-135m
    python bench/drafter_heldout.py --work runs/drafter --prompts 920 --copy \
        --weights runs/drafter-v2/weights drafters/smollm2-135m

Every drafter is measured on the same sequences: the held-out answers among the first
``--prompts`` training prompts (as recorded in the work folder's ``held_out.json``),
at the same 24 anchors per answer, drafting exactly as the runtime does (each slot's Markov
input is the drafter's own previous draft). ``--copy`` adds the held-out answers to the copy
tasks (``train-drafter --copy-prompts``) and reports them apart. Prints τ (accepted + 1 at block
γ) and the reach of every position, as JSON lines. Needs the work folder's answer shards.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("runs/drafter"), help="train-drafter work folder")
    ap.add_argument("--prompts", type=int, default=512, help="answers (prompts) whose held-out part is measured")
    ap.add_argument("--weights", type=Path, nargs="+", required=True, help="drafter folders to compare")
    ap.add_argument("--copy", action="store_true", help="also the held-out copy-task answers (work/copy)")
    ap.add_argument("--source", default="default", help="the target's source (embeddings, LM head)")
    args = ap.parse_args()

    from dspark_edge.errors import ConfigError
    from dspark_export.drafter.build import load_drafter
    from dspark_export.drafter.data import answer_shards, count_sequences, load_shards
    from dspark_export.drafter.train import held_out_rounds, recorded_split
    from dspark_export.sources import load_source, resolve_source

    shards = answer_shards(args.work, args.prompts)
    for w in args.weights:
        if not (w / "drafter.json").is_file():
            raise ConfigError(f"{w} is not a drafter folder (no drafter.json); train one with "
                              "`python -m export train-drafter`")
    n_prompt_answers = count_sequences(shards)
    if args.copy:
        trained = json.loads((args.work / "options.json").read_text())["prompts"]
        if int(trained) != args.prompts:
            raise ConfigError(f"--copy needs --prompts {trained} (the work folder's run): the copy answers' held-out "
                              "draw follows the prompt answers")
        copy = sorted((args.work / "copy").glob("shard-*.npz"))
        if not copy:
            raise ConfigError(f"no copy-task shards in {args.work / 'copy'}; run `python -m export train-drafter` "
                              "with --copy-prompts first, or leave out --copy")
        shards += copy
    data = load_shards(shards)
    _, val_ids = recorded_split(data, args.work, len(data))
    sets = {"prompts": val_ids[val_ids < n_prompt_answers]}
    if args.copy:
        sets["copy"] = val_ids[val_ids >= n_prompt_answers]
    target, _ = load_source(resolve_source(args.source))
    for w in args.weights:
        model, _ = load_drafter(w, target)
        for name, ids in sets.items():
            acc, _, _ = held_out_rounds(model, data, ids, model.cfg.slots)
            print(json.dumps({"weights": str(w), "answers": name, "sequences": int(len(ids)), "blocks": int(acc.size),
                              "tau": round(float(1 + acc.mean()), 3),
                              "reach": [round(float((acc >= k).mean()), 3) for k in range(1, model.cfg.slots + 1)]}),
                  flush=True)
    return 0


if __name__ == "__main__":
    from dspark_edge.cli import run_reporting_errors

    sys.exit(run_reporting_errors(main))
