"""Width policies replayed on recorded drafts: what each fixed draft length and the scheduler
would decode at, without timing noise.

    python bench/scheduler_replay.py --engine engines/smollm2-135m --drafter dspark --max-new-tokens 64

Under greedy decoding the drafts a drafter proposes at an answer position depend only on the
committed text, which every variant shares (the output is the target's own greedy output).
So one pass records, for every answer position of every benchmark prompt, the drafter's full
block: how many drafts the target would accept and their calibrated confidences. A policy
(plain, a fixed draft length, the real ``Scheduler`` with a given ``SchedulerConfig``) is then
replayed over those records with round costs from this device's profile (verify cost per
width) plus the measured drafting time, giving tokens per ms per prompt and category: the
same comparison as ``python -m dspark_edge bench``, deterministic, in seconds. It ranks
policies; the interleaved benchmark still measures them. An oracle that knows each round's
accepted count bounds what any width policy can gain over the best fixed length (``vs_best_fixed``).
Prints one JSON object.

Meant for drafters whose confidences depend only on the committed text (the DSpark drafter,
draft models). The n-gram drafter's depend on the rounds themselves (its acceptance statistics,
whether its last proposal foresaw the pending token): replay it with ``bench/ngram_replay.py``,
which runs the drafter round by round.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def record(pipe, prompts: list[dict], max_new: int) -> list[dict]:
    """Per prompt: category, accepted drafts at each answer position (full block), their
    confidences, and the mean drafting time."""
    from dspark_edge.config import GenerationConfig
    from dspark_edge.drafters.base import DraftRequest

    drafter = pipe.drafter
    cfg = GenerationConfig(max_new_tokens=max_new, ignore_eos=True)
    out = []
    for rec in prompts:
        prompt = rec.get("messages") or rec["prompt"]
        pipe.drafter = None
        answer = pipe.generate(prompt, cfg).token_ids
        pipe.drafter = drafter
        prompt_ids = pipe.encode_prompt(prompt)
        ids = list(prompt_ids) + list(answer)
        rows: list[np.ndarray] = []
        cache = pipe.target.new_cache()
        pipe.target.prefill(cache, np.asarray(ids, dtype=np.int64), hidden_sink=rows)
        hidden = np.concatenate(rows)
        drafter.begin(prompt_ids)
        acc, conf, ms = [], [], []
        n_ctx = 0
        for j in range(len(answer) - 1):
            committed = len(prompt_ids) + j  # prompt + answer[:j]; answer[j] is pending
            t = time.perf_counter()
            d = drafter.propose(DraftRequest(ids[:committed + 1], drafter.max_drafts, 0.0, 0, 1.0,
                                             hidden[n_ctx:committed]), np.random.default_rng(0))
            ms.append((time.perf_counter() - t) * 1e3)
            n_ctx = committed
            truth = answer[j + 1:j + 1 + len(d)]
            hit = np.asarray(d.tokens[:len(truth)]) == np.asarray(truth)
            acc.append(int(np.cumprod(hit).sum()))
            conf.append(np.asarray(d.confidence, dtype=np.float64))
        out.append({"id": rec["id"], "category": rec["category"], "acc": acc, "conf": conf,
                    "draft_ms": float(np.median(ms)),
                    "observed_confidence": bool(getattr(drafter, "observed_confidence", False))})
    return out


def replay(records: list[dict], policy, verify_ms: dict[int, float], widths: tuple[int, ...]) -> list[float]:
    """Tokens per ms of every prompt under ``policy``: None (plain), an int (fixed drafts),
    "oracle" (a width policy that knows how many drafts the target will accept and verifies
    exactly those, drafting every round: the ceiling of any width policy for this drafter and
    cost curve), or a ``Scheduler`` (kept across prompts, as a pipeline keeps it). As in the pipeline, the
    confidence offset neither shifts nor learns from a drafter's observed-rate confidences
    (records without the key are from drafters with a confidence head)."""
    from dspark_edge.telemetry import Snapshot

    snap = Snapshot(t=0.0, mem_total_mb=8192, mem_available_mb=4096)
    rates = []
    for r in records:
        n, j, ms = len(r["acc"]) + 1, 0, 0.0
        observed = r.get("observed_confidence", False)
        while j < n - 1:
            k_max = min(len(r["conf"][j]), n - 1 - j - 1)
            if policy is None or k_max < 1:
                w, drafted = 1, False
            elif policy == "oracle":
                k = min(r["acc"][j], k_max)
                w, drafted = max(x for x in widths if x <= k + 1), True
            elif isinstance(policy, int):
                k = min(policy, k_max)
                w, drafted = max(x for x in widths if x <= k + 1), True
            else:  # as the pipeline's loop calls it
                drafted = policy.wants_draft(snap)
                conf = r["conf"][j][:k_max] if drafted else np.zeros(0)
                w = policy.decide(conf, snap, shift=not observed).width
                if drafted:  # after the choice, as the pipeline does
                    policy.costs.observe_draft(r["draft_ms"])
            tokens = 1 + min(r["acc"][j], w - 1)
            cost = verify_ms[w] + (r["draft_ms"] if drafted else 0.0)
            if not isinstance(policy, (int, str, type(None))):
                policy.observe(w, verify_ms[w])
                if drafted:  # the pipeline's gate counts every round that drafted
                    policy.observe_round(tokens, cost)
                if w > 1 and not observed:
                    policy.observe_acceptance(conf[:w - 1], tokens - 1)
            ms += cost
            j += tokens
        rates.append(j / ms)
    return rates


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", type=Path, default=Path("engines/smollm2-135m"))
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--drafter", default="dspark")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=Path, default=None,
                    help="JSON-lines prompt file to record on (default: the project's dspark_edge/data/prompts.jsonl)")
    ap.add_argument("--fixed", default="1,2,3,5,7", help="fixed draft lengths to replay")
    ap.add_argument("--probe-every", default="16", help="scheduler variants: probe cadences to replay")
    ap.add_argument("--online-calibration", default=None,
                    help="scheduler variants: comma-separated step sizes of the online confidence offset "
                         "(default: SchedulerConfig's)")
    ap.add_argument("--draft-ms", type=float, default=None,
                    help="drafting time per round to replay with (default: the recorded median per prompt)")
    ap.add_argument("--records", type=Path, default=None,
                    help="JSON file of recorded drafts: read when it exists (no decoding), else written")
    args = ap.parse_args()

    import dspark_edge
    from dspark_edge.bench import load_prompts
    from dspark_edge.errors import ConfigError
    from dspark_edge.scheduler import CostModel, Scheduler, SchedulerConfig
    from dspark_edge.telemetry import FakeReader

    default_lr = SchedulerConfig().online_calibration
    lrs = [default_lr]
    if args.online_calibration:
        try:
            lrs = [float(x) for x in args.online_calibration.split(",")]
        except ValueError:
            raise ConfigError(f"--online-calibration takes comma-separated step sizes in [0, 1], "
                              f"got {args.online_calibration!r}") from None
    for lr in lrs:  # out-of-range step sizes fail here, before any decoding
        SchedulerConfig(online_calibration=lr)
    if args.records is not None and args.records.is_file():
        saved = json.loads(args.records.read_text())
        verify = {int(w): v for w, v in saved["verify_ms"].items()}
        widths, records = tuple(saved["widths"]), saved["records"]
        for r in records:
            r["conf"] = [np.asarray(c) for c in r["conf"]]
    else:
        pipe = dspark_edge.load(args.engine, args.precision, drafter=args.drafter, telemetry=FakeReader())
        records = record(pipe, load_prompts(args.prompts), args.max_new_tokens)
        verify, widths = dict(pipe.scheduler.costs.verify_ms), pipe.scheduler.widths
        if args.records is not None:
            args.records.write_text(json.dumps({"verify_ms": verify, "widths": list(widths), "records": [
                {**r, "conf": [c.tolist() for c in r["conf"]]} for r in records]}))
    policies: dict[str, object] = {"plain": None}
    for k in (int(x) for x in args.fixed.split(",")):
        policies[f"k={k}"] = k
    policies["oracle (knows the accepted count)"] = "oracle"
    for pe in (int(x) for x in args.probe_every.split(",")):
        for gate in (True, False):
            for lr in lrs:
                cfg = SchedulerConfig(probe_every=pe, gate_draft_share=0.05 if gate else 1.0, online_calibration=lr)
                name = (f"scheduler probe {pe}" + ("" if gate else ", no gate")
                        + ("" if lr == default_lr else f", online calibration {lr:g}"))
                policies[name] = Scheduler(CostModel(verify, 0.0, cfg.cost_window, cfg.min_observations), widths, cfg)
    if args.draft_ms is not None:
        if args.draft_ms < 0:
            raise ConfigError(f"--draft-ms must be 0 or more, got {args.draft_ms}")
        for r in records:
            r["draft_ms"] = args.draft_ms
    cats = sorted({r["category"] for r in records})
    result = {"verify_ms": verify, "draft_ms": round(float(np.median([r["draft_ms"] for r in records])), 2),
              "first_draft_accepted": round(float(np.mean([a > 0 for r in records for a in r["acc"]])), 3),
              "policies": {}}
    for name, pol in policies.items():
        rates = replay(records, pol, verify, widths)
        by_cat = {c: round(1e3 * float(np.mean([x for x, r in zip(rates, records) if r["category"] == c])), 2)
                  for c in cats}
        result["policies"][name] = {"tok_s": round(1e3 * float(np.mean(rates)), 2), "by_category": by_cat}
    base = result["policies"]["plain"]["tok_s"]
    fixed = max(v["tok_s"] for name, v in result["policies"].items() if name.startswith("k="))
    for v in result["policies"].values():
        v["vs_plain"] = round(v["tok_s"] / base, 3)
        v["vs_best_fixed"] = round(v["tok_s"] / fixed, 3)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    from dspark_edge.cli import run_reporting_errors

    sys.exit(run_reporting_errors(main))
