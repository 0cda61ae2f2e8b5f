"""What turning one row of logits into a sampling distribution costs (``dspark_edge.sampling.probs``)
against the filter as plainly written (top-p over a full stable sort of the vocabulary), on the
target's own logits: the rows of its greedy answers to the first benchmark prompts. A sampled
round computes it for every draft a drafter with a model draws and for every verified row, so at
a 49k vocabulary a full sort (several ms) cost more than a drafting step saved. Every row's
result is also checked equal to the full sort's, bit for bit. Last, greedy drafting's margin
(``greedy_margin``, float32) against the same margin through ``probs``.

    python bench/sampling_cost.py --engine engines/smollm2-135m --precision fp32
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dspark_edge.sampling import exp_shifted  # noqa: E402  (the same float32 exp as probs)

SETTINGS = ((0.7, 0, 1.0), (0.7, 0, 0.9), (1.0, 0, 0.95), (0.7, 50, 0.9), (0.2, 0, 0.9), (1.0, 40, 1.0))


def probs_by_full_sort(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """The filter as plainly written: top-p over a full stable sort of the vocabulary (the
    exponential is ``probs``'s own float32 one, whose precision is not what is compared)."""
    with np.errstate(over="ignore"):
        z = logits.astype(np.float64) / temperature
        vocab = z.shape[-1]
        if 0 < top_k < vocab:
            z = np.where(z >= np.partition(z, vocab - top_k)[vocab - top_k], z, -np.inf)
        top = z.max()
        p = exp_shifted(z - top) if np.isfinite(top) else (logits == logits.max()).astype(np.float64)
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        keep = int(np.searchsorted(np.cumsum(p[order]), top_p, side="left")) + 1
        mask = np.zeros_like(p, dtype=bool)
        mask[order[:keep]] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return p


def target_rows(engine: str, precision: str | None, prompts: int, tokens: int) -> np.ndarray:
    """Logit rows of the target's greedy answers ([prompts * tokens, V] float32)."""
    import dspark_edge
    from dspark_edge.bench import load_prompts

    pipe = dspark_edge.load(engine, precision)
    rows = []
    for rec in load_prompts()[:prompts]:
        ids = pipe.encode_prompt(rec.get("messages") or rec["prompt"])
        cache = pipe.target.new_cache()
        logits = pipe.target.prefill(cache, np.asarray(ids, dtype=np.int64)).logits[-1]
        for _ in range(tokens):
            rows.append(logits.astype(np.float32, copy=True))
            nxt = np.array([int(np.argmax(logits))], dtype=np.int64)
            logits = pipe.target.step(cache, nxt).logits[-1]
            cache.commit(1)
    return np.stack(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", required=True)
    ap.add_argument("--precision", default=None)
    ap.add_argument("--prompts", type=int, default=6, help="benchmark prompts whose answers give the rows")
    ap.add_argument("--tokens", type=int, default=32, help="answer tokens (rows) per prompt")
    args = ap.parse_args()
    from dspark_edge.sampling import greedy_margin, probs, top_margin

    rows = target_rows(args.engine, args.precision, args.prompts, args.tokens)
    print(f"[sampling_cost] {rows.shape[0]} rows of {rows.shape[1]} logits", file=sys.stderr, flush=True)
    report = {"rows": int(rows.shape[0]), "vocab": int(rows.shape[1]), "settings": []}
    for temperature, top_k, top_p in SETTINGS:
        times: dict[str, list[float]] = {"probs": [], "full_sort": []}
        equal = 0
        for row in rows:  # the two interleaved row by row: drift hits both alike
            t = time.perf_counter()
            got = probs(row, temperature, top_k, top_p)
            times["probs"].append((time.perf_counter() - t) * 1e3)
            t = time.perf_counter()
            want = probs_by_full_sort(row, temperature, top_k, top_p)
            times["full_sort"].append((time.perf_counter() - t) * 1e3)
            equal += bool(np.array_equal(got, want))
        kept = [int(np.count_nonzero(probs(r, temperature, top_k, top_p))) for r in rows]
        entry = {"temperature": temperature, "top_k": top_k, "top_p": top_p,
                 "probs_ms_median": round(statistics.median(times["probs"]), 3),
                 "full_sort_ms_median": round(statistics.median(times["full_sort"]), 3),
                 "equal_rows": f"{equal}/{len(rows)}", "kept_tokens_median": int(statistics.median(kept))}
        report["settings"].append(entry)
        print(f"[sampling_cost] T={temperature} top_k={top_k} top_p={top_p}: {entry['probs_ms_median']} ms "
              f"(full sort {entry['full_sort_ms_median']} ms), equal {entry['equal_rows']}, "
              f"{entry['kept_tokens_median']} tokens kept", file=sys.stderr, flush=True)
    # Greedy drafting needs the top token and its margin only (self-drafting's confidence).
    fast, full, worst = [], [], 0.0
    for row in rows:
        t = time.perf_counter()
        token, margin = greedy_margin(row)
        fast.append((time.perf_counter() - t) * 1e3)
        t = time.perf_counter()
        want_token, want_margin = top_margin(probs(row, 1.0))
        full.append((time.perf_counter() - t) * 1e3)
        worst = max(worst, abs(margin - want_margin) + (token != want_token))
    report["greedy_margin"] = {"ms_median": round(statistics.median(fast), 3),
                               "via_probs_ms_median": round(statistics.median(full), 3), "max_abs_diff": worst}
    print(f"[sampling_cost] greedy margin: {report['greedy_margin']['ms_median']} ms (through probs "
          f"{report['greedy_margin']['via_probs_ms_median']} ms), largest difference {worst:.1e}",
          file=sys.stderr, flush=True)
    print(json.dumps(report, indent=2))
    return 0 if worst < 1e-6 and all(e["equal_rows"].split("/")[0] == e["equal_rows"].split("/")[1] for e in report["settings"]) else 1


if __name__ == "__main__":
    from dspark_edge.cli import run_reporting_errors

    sys.exit(run_reporting_errors(main))
