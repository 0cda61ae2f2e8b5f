"""How often does a DSpark drafter's block get accepted on each benchmark prompt?

    python bench/prompt_acceptance.py --engine engines/A [--engine engines/B] [--draft-tokens 7]
        [--max-new-tokens 128] [--precision fp32]

For each engine folder with a DSpark drafter installed: every benchmark prompt decoded greedily
with exactly ``--draft-tokens`` drafts verified a round, and per prompt the tokens a round (τ:
accepted drafts + 1) and the share of rounds whose first draft was accepted, then the mean over
the prompts and per category. Counts only, no timing: the numbers do not depend on the machine's
load, so two drafters (two engine folders with the same target) compare exactly on the prompts
the speed benchmarks use, where ``drafter_heldout.py`` measures held-out training answers.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path


class _Rounds:
    def __init__(self) -> None:
        self.accepted: list[int] = []

    def on_round(self, info) -> None:
        if info.drafts is not None and len(info.drafts):
            self.accepted.append(int(info.accepted))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", type=Path, action="append", required=True, help="engine folder (repeatable)")
    ap.add_argument("--precision", default="fp32", help="the drafter's precision (default: fp32)")
    ap.add_argument("--draft-tokens", type=int, default=7, help="drafts verified every round (default: 7)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompts", default=None, help="prompt file (default: the benchmark prompts)")
    args = ap.parse_args()

    import dspark_edge
    from dspark_edge.bench import load_prompts

    prompts = load_prompts(args.prompts)
    report = {}
    for engine in args.engine:
        rows = []
        with dspark_edge.load(engine, "fp32", drafter=f"dspark:{args.precision}") as pipe:
            rounds = _Rounds()
            pipe.add_observer(rounds)
            for rec in prompts:
                rounds.accepted.clear()
                pipe.generate(rec.get("messages") or rec["prompt"], max_new_tokens=args.max_new_tokens,
                              draft_tokens=args.draft_tokens)
                acc = rounds.accepted
                rows.append({"id": rec.get("id"), "category": rec.get("category"), "rounds": len(acc),
                             "tau": 1 + statistics.fmean(acc) if acc else None,
                             "first": statistics.fmean(a >= 1 for a in acc) if acc else None})
        by_cat = defaultdict(list)
        for r in rows:
            by_cat[r["category"]].append(r)
        report[str(engine)] = {
            "mean_tau": statistics.fmean(r["tau"] for r in rows if r["tau"] is not None),
            "mean_first": statistics.fmean(r["first"] for r in rows if r["first"] is not None),
            "by_category": {c: {"tau": round(statistics.fmean(r["tau"] for r in rs), 3),
                                "first": round(statistics.fmean(r["first"] for r in rs), 3)}
                            for c, rs in by_cat.items()},
            "prompts": rows}
        print(json.dumps({"engine": str(engine), **{k: v for k, v in report[str(engine)].items() if k != "prompts"}}),
              flush=True)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
