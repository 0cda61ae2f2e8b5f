"""Held-out greedy acceptance of trained DSpark drafters on one fixed set of held-out answers.

    python bench/drafter_heldout.py --work runs/campaign-8 \
        --weights drafters/smollm2-135m-campaign runs/drafter-run8
    python bench/drafter_heldout.py --work runs/drafter --prompts 920 --copy \
        --weights runs/drafter-v2/weights drafters/smollm2-135m

Every drafter is measured on the same sequences, drafting exactly as the runtime does (each
slot's Markov input is the drafter's own previous draft), two ways: at the same 24 uniformly
drawn anchors per answer (``tau``, what the learning curve logs) and in rounds anchored where
decoding at a fixed block would start them, each right after the last accepted draft
(``runtime_tau``, ``train.runtime_walk``; lower, as those positions follow rejections).

A work folder of ``train-drafter --data FILE`` (an ``answers/`` folder): its held-out answers
(``held_out.json``, the run's ``--data-from`` / ``--data-to``), reported in all and by answer
kind (the kinds FILE records); ``--trained`` adds the set ``trained``, the answers that run
trained on: a drafter's τ there against its held-out τ (and the τ the drafter it started from
had there) says how much of what a run learns is its own answers and how much carries over. An older work folder (``data/``): the held-out answers among the
first ``--prompts`` training prompts; ``--copy`` adds the held-out copy-task answers apart.
Prints JSON lines. Needs the work folder's feature shards.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("runs/drafter"), help="train-drafter work folder")
    ap.add_argument("--prompts", type=int, default=512,
                    help="an older work folder (data/): answers (prompts) whose held-out part is measured")
    ap.add_argument("--weights", type=Path, nargs="+", required=True, help="drafter folders to compare")
    ap.add_argument("--copy", action="store_true", help="an older work folder: also the held-out copy-task answers")
    ap.add_argument("--source", default="default", help="the target's source (embeddings, LM head)")
    ap.add_argument("--limit", type=int, default=None, metavar="N",
                    help="at most N answers a set, evenly spaced over it (default: all)")
    ap.add_argument("--trained", action="store_true",
                    help="a --data work folder: also the answers its run trained on (the set 'trained')")
    ap.add_argument("--sets", default=None, metavar="NAMES",
                    help="comma-separated sets to measure, e.g. all or magpie,task (default: every one)")
    args = ap.parse_args()
    os.environ.setdefault("TQDM_DISABLE", "1")  # the source's loading bars: no carriage-return spam in logs

    from dspark_edge.errors import ConfigError
    from dspark_export.drafter.build import load_drafter
    from dspark_export.drafter.train import validate, validate_runtime
    from dspark_export.sources import load_source, resolve_source

    for w in args.weights:
        if not (w / "drafter.json").is_file():
            raise ConfigError(f"{w} is not a drafter folder (no drafter.json); train one with "
                              "`python -m export train-drafter`")
    if (args.work / "answers").is_dir():
        data, sets = campaign_sets(args.work, trained=args.trained)
    elif args.trained:
        raise ConfigError(f"--trained needs the work folder of a `train-drafter --data` run; {args.work} has no "
                          "answers/ folder")
    else:
        data, sets = prompt_sets(args)
    if args.sets is not None:
        wanted = [x for x in args.sets.split(",") if x]
        unknown = [x for x in wanted if x not in sets]
        if unknown or not wanted:
            raise ConfigError(f"--sets {args.sets}: this work folder has the sets {', '.join(sets)}")
        sets = {k: sets[k] for k in wanted}
    if args.limit is not None:
        if args.limit < 1:
            raise ConfigError(f"--limit must be at least 1, got {args.limit}")
        sets = {k: evenly(v, args.limit) for k, v in sets.items()}
    target, _ = load_source(resolve_source(args.source))
    for w in args.weights:
        model, _ = load_drafter(w, target)
        for name, ids in sets.items():
            v = validate(model, data, ids, model.cfg.slots)
            rt = validate_runtime(model, data, ids, model.cfg.slots)
            print(json.dumps({"weights": str(w), "answers": name, "sequences": len(ids), "blocks": v["blocks"],
                              "tau": round(v["tau"], 3), "reach": [round(r, 3) for r in v["reach"]],
                              "runtime_tau": round(rt["tau"], 3), "runtime_rounds": rt["rounds"],
                              "runtime_reach": [round(r, 3) for r in rt["reach"]]}), flush=True)
    return 0


def evenly(ids, n: int):
    """At most ``n`` of ``ids``, evenly spaced over them, first and last included (all when
    there are no more than ``n``): a subset that samples every part of a set in file order."""
    import numpy as np

    ids = np.asarray(ids)
    return ids[np.linspace(0, ids.size - 1, min(n, ids.size)).astype(int)] if ids.size else ids


def campaign_sets(work: Path, with_text: bool = False, trained: bool = False):
    """The held-out answers of a ``train-drafter --data`` work folder, as the run loaded them
    (the answers it picked in file order), in all and by kind; ``with_text``: the folder's
    package-text shards loaded after the answers (positions from the answers' count on);
    ``trained``: also the set ``trained``, the run's training answers (text excluded)."""
    import numpy as np

    from dspark_edge.errors import ConfigError
    from dspark_edge.manifest import read_manifest
    from dspark_export.answers import KINDS, load_answers
    from dspark_export.drafter.data import count_sequences, load_shards
    from dspark_export.drafter.train import recorded_split

    try:
        opts = json.loads((work / "options.json").read_text())
        opts["data"], opts["data_from"], opts["data_to"], opts["target_engine"]
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"{work} lacks a readable options.json ({exc}); pass the --work folder of a "
                          "`python -m export train-drafter --data` run") from None
    if not (work / "held_out.json").is_file():
        raise ConfigError(f"{work} records no held-out set (held_out.json); pass the --work folder of a "
                          "`python -m export train-drafter --data` run whose features are made")
    recorded = load_answers(Path(opts["data"]), read_manifest(Path(opts["target_engine"])))
    start, end = int(opts["data_from"]), len(recorded) if opts["data_to"] == "None" else int(opts["data_to"])
    held = recorded_split(None, work, end)[1]  # as the run drew it
    chosen = np.union1d(held, np.arange(start, end)) if (start or end < len(recorded)) else np.arange(len(recorded))
    shards = sorted((work / "answers").glob("shard-*.npz"))
    if count_sequences(shards) != chosen.size:
        raise ConfigError(f"{work}/answers holds {count_sequences(shards)} answers, the run picked {chosen.size}; "
                          "let its features finish first (run its train-drafter command again)")
    data = load_shards(shards + (sorted((work / "text").glob("shard-*.npz")) if with_text else []))
    pos = np.flatnonzero(np.isin(chosen, held))
    kinds = recorded.kinds[chosen[pos]]
    sets = {"all": pos} | {KINDS[k]: pos[kinds == k] for k in np.unique(kinds)}
    if trained:
        sets["trained"] = np.flatnonzero(~np.isin(chosen, held))
    return data, sets


def prompt_sets(args):
    """The held-out answers among an older work folder's first ``--prompts`` prompts (and copy tasks)."""
    from dspark_edge.errors import ConfigError
    from dspark_export.drafter.data import answer_shards, count_sequences, load_shards
    from dspark_export.drafter.train import recorded_split

    shards = answer_shards(args.work, args.prompts)
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
    return data, sets


if __name__ == "__main__":
    from dspark_edge.cli import run_reporting_errors

    sys.exit(run_reporting_errors(main))
