"""Accepted length of the n-gram drafter with and without a corpus table, without timing noise.

Under greedy decoding the tokens at every answer position are the target's whatever drafts
were verified, so the target's plain greedy answers are recorded once and every drafter and
fixed draft length is replayed over them: each round proposes up to k drafts for the committed
text, keeps the longest prefix equal to the answer, and adds the target's own token. Prints
tokens per round (τ) per draft length and category, and how the table drafts' confidences
compare with how often they were accepted (reliability by confidence bin).

    python bench/ngram_replay.py --engine engines/smollm2-135m --table drafters/smollm2-135m-ngram.npz \\
        --answers runs/bench_answers.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def record_answers(engine: Path, prompts: list[dict], max_new_tokens: int) -> list[dict]:
    import dspark_edge

    pipe = dspark_edge.load(engine, "fp32")
    out = []
    for i, rec in enumerate(prompts, 1):
        prompt = rec.get("messages") or rec["prompt"]
        r = pipe.generate(prompt, max_new_tokens=max_new_tokens)
        out.append({"id": rec["id"], "category": rec["category"], "prompt": pipe.encode_prompt(prompt),
                    "answer": list(r.token_ids)})
        print(f"[replay] answer {i}/{len(prompts)}: {rec['id']} ({len(r.token_ids)} tokens)", file=sys.stderr, flush=True)
    return out


def replay(make_drafter, answers: list[dict], k: int) -> dict:
    from dspark_edge.drafters import DraftRequest

    rng = np.random.default_rng(0)
    tokens = rounds = 0
    per_cat: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    bins: dict[int, list[float]] = defaultdict(lambda: [0, 0, 0.0])  # table drafts: judged, accepted, Σ confidence
    for rec in answers:
        prompt, ans = rec["prompt"], rec["answer"]
        d = make_drafter()
        d.begin(prompt)
        j = 0
        while j < len(ans):
            room = min(k, len(ans) - j - 1)
            drafts, conf = [], []
            if room > 0:
                draft = d.propose(DraftRequest(context=prompt + ans[:j], max_tokens=room, temperature=0.0, top_k=0,
                                               top_p=1.0), rng)
                drafts, conf = draft.tokens.tolist(), draft.confidence.tolist()
            acc = 0
            while acc < len(drafts) and drafts[acc] == ans[j + acc]:
                acc += 1
            if getattr(d, "_last_buckets", None) is not None:
                for i in range(min(len(drafts), acc + 1)):
                    b = bins[min(int(conf[i] * 10), 9)]
                    b[0] += 1
                    b[1] += i < acc
                    b[2] += conf[i]
            d.feedback(len(drafts), acc, ans[j:j + acc + 1])
            tokens += acc + 1
            rounds += 1
            per_cat[rec["category"]][0] += acc + 1
            per_cat[rec["category"]][1] += 1
            j += acc + 1
    return {"tau": round(tokens / rounds, 3), "rounds": rounds,
            "tau_by_category": {c: round(t / r, 3) for c, (t, r) in sorted(per_cat.items())},
            "table_reliability": {f"{b / 10:.1f}-{(b + 1) / 10:.1f}": {"drafts": int(n), "accepted": round(a / n, 3),
                                                                      "confidence": round(c / n, 3)}
                                  for b, (n, a, c) in sorted(bins.items())}}


def main() -> int:
    from dspark_edge.bench import load_prompts
    from dspark_edge.drafters import NgramDrafter, NgramTable
    from dspark_edge.errors import ConfigError
    from dspark_edge.manifest import read_manifest

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", type=Path, default=Path("engines/smollm2-135m"), help="target engine folder (FP32)")
    ap.add_argument("--table", type=Path, required=True, help="n-gram table file")
    ap.add_argument("--prompts", default=None, help="JSON-lines prompts (default: bench/prompts.jsonl)")
    ap.add_argument("--answers", type=Path, default=None,
                    help="recorded answers: read when the file exists, else recorded there")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="answer length when recording (default: 128)")
    ap.add_argument("--draft-tokens", default="1,3,5,7", help="fixed draft lengths to replay (default: 1,3,5,7)")
    args = ap.parse_args()
    try:
        ks = [int(x) for x in args.draft_tokens.split(",")]
    except ValueError:
        raise ConfigError(f"--draft-tokens takes comma-separated integers, got {args.draft_tokens!r}") from None
    if not ks or min(ks) < 1:
        raise ConfigError(f"--draft-tokens must list lengths >= 1, got {args.draft_tokens!r}")
    table = NgramTable.load_for(args.table, read_manifest(args.engine))
    if args.answers is not None and args.answers.is_file():
        answers = json.loads(args.answers.read_text())
    else:
        answers = record_answers(args.engine, load_prompts(args.prompts), args.max_new_tokens)
        if args.answers is not None:
            args.answers.parent.mkdir(parents=True, exist_ok=True)
            args.answers.write_text(json.dumps(answers))
    report = {"table": str(args.table), "table_contexts": table.entries, "answers": len(answers),
              "answer_tokens": sum(len(a["answer"]) for a in answers), "replays": {}}
    for k in ks:
        report["replays"][f"k={k}"] = {"prompt lookup": replay(NgramDrafter, answers, k),
                                      "prompt lookup + table": replay(lambda: NgramDrafter(table=table), answers, k)}
        r = report["replays"][f"k={k}"]
        print(f"[replay] k={k}: τ {r['prompt lookup']['tau']} → {r['prompt lookup + table']['tau']}", file=sys.stderr,
              flush=True)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    from dspark_edge.cli import run_reporting_errors

    sys.exit(run_reporting_errors(main))
