"""What log-probabilities and penalties cost a generation, as ratios measured in one process.

    python bench/request_fields_cost.py --engine engines/smollm2-135m [--drafter ngram+self]
        [--precision fp32] [--limit 8] [--max-new-tokens 96] [--passes 2]

Each benchmark prompt is decoded greedily (EOS ignored) with no extra field, with ``logprobs=5``,
and with presence / frequency penalties and a logit bias, the three in a rotating order at every
prompt; prints, per variant, the median decode rate and the geometric mean of its rate over the
plain variant's on the same prompt. Log-probabilities leave the answer as it is; penalties change
it (and a drafter, which does not know them, has fewer drafts accepted), so their ratio with a
drafter is not a pure overhead.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

import dspark_edge
from dspark_edge.bench import load_prompts

VARIANTS = {
    "none": {},
    "logprobs=5": {"logprobs": 5},
    "penalties+bias": {"presence_penalty": 0.3, "frequency_penalty": 0.3, "logit_bias": {2: -1.0}},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", required=True)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--drafter", default="none")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--passes", type=int, default=2)
    args = ap.parse_args()
    prompts = load_prompts()[:args.limit]
    names = list(VARIANTS)
    rates: dict[str, list[float]] = {k: [] for k in names}
    with dspark_edge.load(args.engine, args.precision, drafter=args.drafter) as pipe:
        pipe.generate(prompts[0]["messages"], max_new_tokens=8)  # untimed warm-up
        for _ in range(args.passes):
            for i, rec in enumerate(prompts):
                for k in names[i % len(names):] + names[:i % len(names)]:
                    r = pipe.generate(rec["messages"], max_new_tokens=args.max_new_tokens, ignore_eos=True,
                                      **VARIANTS[k])
                    rates[k].append(r.stats.tokens_per_s)
    base = np.array(rates["none"])
    report = {k: {"median_tok_s": round(float(np.median(v)), 1),
                  "vs_none": round(float(np.exp(np.mean(np.log(np.array(v) / base)))), 3)} for k, v in rates.items()}
    print(json.dumps({"engine": args.engine, "precision": args.precision, "drafter": args.drafter,
                      "prompts": len(prompts), "passes": args.passes, "variants": report}, indent=1))


if __name__ == "__main__":
    main()
