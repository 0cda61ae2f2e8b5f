"""The n-gram drafter with and without a corpus table, replayed without timing noise: accepted
length per fixed draft length, and tokens per unit of this device's verify cost for the fixed
lengths, the scheduler, and an oracle.

Under greedy decoding the tokens at every answer position are the target's whatever drafts
were verified, so the target's plain greedy answers are recorded once and every drafter and
policy is replayed over them: each round proposes up to k drafts for the committed text, keeps
the longest prefix equal to the answer, and adds the target's own token. Rounds cost the device
profile's verify time at their width (``--precision``; drafting is left out, its median time per
proposal is reported), so a policy's speed relative to plain decoding is tokens / Σ cost ×
cost(width 1). The scheduler is the runtime's ``Scheduler`` called as the pipeline calls it
(confidences, online offset, cost correction). The oracle (``oracle``) knows how many of each
proposal's drafts the target accepts and picks every round's width by a dynamic program over
answer positions: no width choice made before verifying can do better with these drafts, so it
bounds what any scheduler can gain over the best fixed length. Prints one JSON object (with τ
per category and the reliability of the table drafts' confidences by bin) and a line per policy.

    python bench/ngram_replay.py --engine engines/smollm2-135m --table drafters/smollm2-135m-ngram.npz \
        --answers runs/bench_answers.json --precision int8
"""

from __future__ import annotations

import argparse
import json
import sys
import time
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


def replay(make_drafter, answers: list[dict], policy, verify_ms: dict[int, float] | None = None,
           widths: tuple[int, ...] = ()) -> dict:
    """Replays rounds over the recorded answers. ``policy``: an int (fixed draft length k) or a
    ``Scheduler`` (kept across prompts, as a pipeline keeps it). With ``verify_ms`` (the device
    profile's cost per verify width) the rounds are also costed: tokens per ms, against plain
    decoding at width 1."""
    from dspark_edge.drafters import DraftRequest
    from dspark_edge.telemetry import Snapshot

    snap = Snapshot(t=0.0, mem_total_mb=8192, mem_available_mb=4096)
    rng = np.random.default_rng(0)
    tokens = rounds = 0
    per_cat: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0])  # tokens, rounds, ms
    bins: dict[int, list[float]] = defaultdict(lambda: [0, 0, 0.0])  # table drafts: judged, accepted, Σ confidence
    used: dict[int, int] = defaultdict(int)
    propose_s: list[float] = []
    max_k = policy if isinstance(policy, int) else max(widths) - 1
    for rec in answers:
        prompt, ans = rec["prompt"], rec["answer"]
        d = make_drafter()
        d.begin(prompt)
        j = 0
        while j < len(ans):
            room = min(max_k, len(ans) - j - 1)
            drafts, conf = [], []
            sched = policy if not isinstance(policy, int) else None
            wants = sched is None or sched.wants_draft(snap)
            if room > 0 and wants:
                request = DraftRequest(context=prompt + ans[:j], max_tokens=room, temperature=0.0, top_k=0, top_p=1.0)
                t = time.perf_counter()
                draft = d.propose(request, rng)
                propose_s.append(time.perf_counter() - t)
                drafts, conf = draft.tokens.tolist(), draft.confidence.tolist()
            full = 0
            while full < len(drafts) and drafts[full] == ans[j + full]:
                full += 1
            observed = bool(getattr(d, "observed_confidence", False))
            if sched is not None:  # as the pipeline calls it
                keep = sched.decide(np.asarray(conf), snap, shift=not observed).width - 1
            else:
                keep = len(drafts)
            if widths:  # the widest listed width the drafts fill
                keep = max(w for w in widths if w <= min(keep, len(drafts)) + 1) - 1
            drafts, conf = drafts[:keep], conf[:keep]
            acc = min(full, keep)
            if getattr(d, "_last_buckets", None) is not None:
                for i in range(min(len(drafts), acc + 1)):
                    b = bins[min(int(conf[i] * 10), 9)]
                    b[0] += 1
                    b[1] += i < acc
                    b[2] += conf[i]
            ms = verify_ms[len(drafts) + 1] if verify_ms else 0.0
            if sched is not None:
                sched.observe(len(drafts) + 1, ms)
                if room > 0 and wants:  # as the pipeline's gate: every round that drafted
                    sched.observe_round(acc + 1, ms)
                if drafts and not observed:
                    sched.observe_acceptance(np.asarray(conf), acc)
            if drafts:
                d.feedback(len(drafts), acc, ans[j:j + acc + 1])
            used[len(drafts) + 1] += 1
            tokens += acc + 1
            rounds += 1
            c = per_cat[rec["category"]]
            c[0] += acc + 1
            c[1] += 1
            c[2] += ms
            j += acc + 1
    out = {"tau": round(tokens / rounds, 3), "rounds": rounds,
           "tau_by_category": {c: round(t / r, 3) for c, (t, r, _) in sorted(per_cat.items())},
           "widths": dict(sorted(used.items())),
           "propose_ms_median": round(1e3 * float(np.median(propose_s)), 4) if propose_s else None}
    if verify_ms:
        out["vs_plain"] = round(tokens / sum(m for _, _, m in per_cat.values()) * verify_ms[1], 3)
        out["vs_plain_by_category"] = {c: round(t / m * verify_ms[1], 3) for c, (t, _, m) in sorted(per_cat.items())}
    out["table_reliability"] = {f"{b / 10:.1f}-{(b + 1) / 10:.1f}": {
        "drafts": int(n), "accepted": round(a / n, 3), "confidence": round(c / n, 3)} for b, (n, a, c) in sorted(bins.items())}
    return out


def oracle(make_drafter, answers: list[dict], verify_ms: dict[int, float], widths: tuple[int, ...]) -> dict:
    """The fastest any width policy could decode these answers with this drafter's proposals:
    the proposal at each answer position (the drafter's tokens depend only on the committed
    text) with its accepted length known, and a dynamic program over positions choosing each
    round's listed width to minimise the total verify cost. An upper bound for the scheduler,
    which must choose before verifying."""
    from dspark_edge.drafters import DraftRequest

    rng = np.random.default_rng(0)
    max_k = max(widths) - 1
    tokens = rounds = 0
    total_ms = 0.0
    per_cat: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0])
    used: dict[int, int] = defaultdict(int)
    for rec in answers:
        prompt, ans = rec["prompt"], rec["answer"]
        n = len(ans)
        d = make_drafter()
        d.begin(prompt)
        full, offered = [0] * n, [0] * n
        for j in range(n):
            room = min(max_k, n - j - 1)
            if room > 0:
                got = d.propose(DraftRequest(context=prompt + ans[:j], max_tokens=room, temperature=0.0, top_k=0,
                                             top_p=1.0), rng).tokens.tolist()
                offered[j] = len(got)
                while full[j] < len(got) and got[full[j]] == ans[j + full[j]]:
                    full[j] += 1
        best = [0.0] * (n + 1)  # best[j]: least cost from position j to the end
        pick = [1] * n
        for j in range(n - 1, -1, -1):
            best[j] = float("inf")
            for w in widths:
                if w - 1 <= offered[j]:
                    c = verify_ms[w] + best[min(n, j + 1 + min(full[j], w - 1))]
                    if c < best[j]:
                        best[j], pick[j] = c, w
        j = 0
        while j < n:
            used[pick[j]] += 1
            rounds += 1
            per_cat[rec["category"]][1] += 1
            j += 1 + min(full[j], pick[j] - 1)
        tokens += n
        total_ms += best[0]
        per_cat[rec["category"]][0] += n
        per_cat[rec["category"]][2] += best[0]
    return {"tau": round(tokens / rounds, 3), "rounds": rounds,
            "tau_by_category": {c: round(t / r, 3) for c, (t, r, _) in sorted(per_cat.items())},
            "widths": dict(sorted(used.items())), "vs_plain": round(tokens / total_ms * verify_ms[1], 3),
            "vs_plain_by_category": {c: round(t / m * verify_ms[1], 3) for c, (t, _, m) in sorted(per_cat.items())}}


def main() -> int:
    from dspark_edge.bench import load_prompts
    from dspark_edge.drafters import NgramDrafter, NgramTable
    from dspark_edge.errors import ConfigError
    from dspark_edge.manifest import read_manifest

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", type=Path, default=Path("engines/smollm2-135m"), help="target engine folder (FP32)")
    ap.add_argument("--table", type=Path, required=True, help="n-gram table file")
    ap.add_argument("--prompts", default=None, help="JSON-lines prompts (default: dspark_edge/data/prompts.jsonl)")
    ap.add_argument("--answers", type=Path, default=None,
                    help="recorded answers: read when the file exists, else recorded there")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="answer length when recording (default: 128)")
    ap.add_argument("--draft-tokens", default="1,3,5,7", help="fixed draft lengths to replay (default: 1,3,5,7)")
    ap.add_argument("--precision", default="fp32",
                    help="cost the rounds with the device profile's verify curve of this precision, and replay "
                         "the scheduler and the oracle too; 'none': accepted lengths only (default: fp32)")
    args = ap.parse_args()
    try:
        ks = [int(x) for x in args.draft_tokens.split(",")]
    except ValueError:
        raise ConfigError(f"--draft-tokens takes comma-separated integers, got {args.draft_tokens!r}") from None
    if not ks or min(ks) < 1:
        raise ConfigError(f"--draft-tokens must list lengths >= 1, got {args.draft_tokens!r}")
    manifest = read_manifest(args.engine)
    table = NgramTable.load_for(args.table, manifest)
    verify_ms, widths = None, ()
    if args.precision != "none":  # checked before any answer is recorded
        from dspark_edge.profile import load_profile

        listed = manifest.precisions("target")
        if args.precision not in listed:
            raise ConfigError(f"--precision {args.precision!r}: the engine's target has {', '.join(listed)}; pick one "
                              "of those, or 'none' for accepted lengths only")

        prof, status = load_profile(args.engine)
        if prof is None or status not in ("ok", "throttled"):
            raise ConfigError(f"costing the rounds needs a current device profile of {args.engine} (status: "
                              f"{status}); run `python -m dspark_edge profile --engine {args.engine}` or pass "
                              f"--precision none")
        from dspark_edge.scheduler import monotone

        verify_ms = monotone(prof.verify_ms(args.precision))
        widths = tuple(sorted(verify_ms))
        for k in ks:
            if k + 1 not in widths:
                raise ConfigError(f"draft length {k} needs verify width {k + 1}, which the profile does not list "
                                  f"{list(widths)}")
    if args.answers is not None and args.answers.is_file():
        answers = json.loads(args.answers.read_text())
    else:
        answers = record_answers(args.engine, load_prompts(args.prompts), args.max_new_tokens)
        if args.answers is not None:
            args.answers.parent.mkdir(parents=True, exist_ok=True)
            args.answers.write_text(json.dumps(answers))
    report = {"table": str(args.table), "table_contexts": table.entries, "answers": len(answers),
              "answer_tokens": sum(len(a["answer"]) for a in answers), "precision": args.precision,
              "verify_ms": verify_ms, "replays": {}}
    drafters = {"prompt lookup": NgramDrafter, "prompt lookup + table": lambda: NgramDrafter(table=table)}
    policies: list = list(ks)
    if verify_ms:
        policies += ["oracle", "scheduler"]
    for pol in policies:
        key = f"k={pol}" if isinstance(pol, int) else pol
        report["replays"][key] = r = {}
        for name, make in drafters.items():
            run = pol
            if pol == "scheduler":
                from dspark_edge.scheduler import CostModel, Scheduler, SchedulerConfig

                cfg = SchedulerConfig()
                run = Scheduler(CostModel(verify_ms, 0.0, cfg.cost_window, cfg.min_observations), widths, cfg)
            r[name] = (oracle(make, answers, verify_ms, widths) if pol == "oracle"
                       else replay(make, answers, run, verify_ms, widths))
        speed = "" if not verify_ms else (f", {r['prompt lookup']['vs_plain']}x → "
                                          f"{r['prompt lookup + table']['vs_plain']}x plain")
        print(f"[replay] {key}: τ {r['prompt lookup']['tau']} → {r['prompt lookup + table']['tau']}{speed}",
              file=sys.stderr, flush=True)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    from dspark_edge.cli import run_reporting_errors

    sys.exit(run_reporting_errors(main))
