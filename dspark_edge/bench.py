"""Benchmark v1: generation speed over a prompt set and the target's verify cost curve.

Prints measured numbers only. Speed comparisons belong in one run (interleaved, same
prompts), since timings on a shared machine drift.
"""

from __future__ import annotations

import copy
import statistics
import time
from pathlib import Path

import numpy as np

from .config import GenerationConfig
from .errors import ConfigError
from .strict_json import read_jsonl
from .profile import verify_curve_ms
from .pipeline import Pipeline
from .decoder import DecoderModel

DEFAULT_PROMPTS = Path(__file__).resolve().parent / "data" / "prompts.jsonl"  # package data


def load_prompts(path: str | Path | None = None) -> list[dict]:
    """Prompt records: {"id", "category", "messages": [...]} or {"id", "category", "prompt": "..."}."""
    path = Path(path) if path else DEFAULT_PROMPTS
    if not path.is_file():
        raise ConfigError(f"prompt file {path} not found: pass --prompts FILE (JSON lines with "
                          "'messages' or 'prompt')")
    records = []
    for n, rec in read_jsonl(path, ConfigError):
        if ("messages" in rec) == ("prompt" in rec):
            raise ConfigError(f"{path}:{n}: each line needs exactly one of 'messages' or 'prompt'")
        rec.setdefault("id", f"line-{n}")
        rec.setdefault("category", "misc")
        records.append(rec)
    if not records:
        raise ConfigError(f"{path} holds no prompts")
    return records


def bench_generation(pipe: Pipeline, prompts: list[dict], max_new_tokens: int = 128, warmup: int = 1,
                     progress=None, sampling: dict | None = None) -> dict:
    """Generation of exactly ``max_new_tokens`` per prompt (EOS ignored): greedy, or sampled
    with ``sampling`` (GenerationConfig fields: temperature, top_k, top_p, sampling, seed)."""
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, ignore_eos=True, **(sampling or {}))
    for rec in prompts[:warmup]:
        pipe.generate(rec.get("messages") or rec["prompt"], cfg)
    rows = []
    for i, rec in enumerate(prompts):
        t0 = time.perf_counter()
        r = pipe.generate(rec.get("messages") or rec["prompt"], cfg)
        wall = time.perf_counter() - t0
        rows.append({"id": rec["id"], "category": rec["category"], "prompt_tokens": r.stats.prompt_tokens,
                     "new_tokens": r.stats.new_tokens, "wall_s": round(wall, 4),
                     "prefill_s": round(r.stats.prefill_s, 4),
                     "tokens_per_s": round(r.stats.tokens_per_s, 2),
                     "tokens_per_s_with_prefill": round(r.stats.new_tokens / wall, 2)})
        if progress:
            progress(i + 1, len(prompts), rows[-1])
    decode_tokens = sum(r["new_tokens"] - 1 for r in rows)
    decode_s = sum(r["wall_s"] - r["prefill_s"] for r in rows)
    return {"prompts": len(rows), "new_tokens": sum(r["new_tokens"] for r in rows),
            "wall_s": round(sum(r["wall_s"] for r in rows), 3),
            "tokens_per_s": round(decode_tokens / decode_s, 2) if decode_s > 0 else 0.0,
            "tokens_per_s_with_prefill": round(sum(r["new_tokens"] for r in rows) / sum(r["wall_s"] for r in rows), 2),
            "per_prompt": rows}


def verify_cost_curve(target: DecoderModel, depth: int = 128, repeats: int = 15, warmup: int = 3,
                      seed: int = 0) -> dict:
    """Median milliseconds of one target pass at each listed width after ``depth`` cached positions."""
    if depth + max(target.widths) > target.capacity:
        raise ConfigError(f"depth {depth} + width {max(target.widths)} exceeds the context {target.capacity}")
    ms = {w: round(v, 3) for w, v in verify_curve_ms(target, depth, repeats, warmup, seed).items()}
    base = ms[min(ms)]
    return {"depth": depth, "repeats": repeats, "median_ms": {str(w): v for w, v in ms.items()},
            "relative_to_width_1": {str(w): round(v / base, 3) for w, v in ms.items()}}


def bench_compare(pipe: Pipeline, prompts: list[dict], variants: list[tuple[str, object, dict]],
                  max_new_tokens: int = 128, progress=None, passes: int = 1, seed: int = 0,
                  sampling: dict | None = None) -> dict:
    """Interleaved comparison: for each prompt, every variant (name, drafter, config overrides)
    runs back to back, exactly ``max_new_tokens`` tokens, ``passes`` times over the prompt set:
    greedy, or sampled with ``sampling`` (GenerationConfig fields: temperature, top_k, top_p,
    sampling), every variant of a prompt and pass with the same seed (``seed`` plus the run's
    index). The first variant is the baseline: speedups are relative to it, and ``exact``
    counts runs whose tokens equal its tokens for the same prompt — greedy, or with coupled
    sampling, whose answer depends on the seed alone; rejection sampling draws other tokens by
    design, so there it is None. With several passes the
    variants run in a new random order at every prompt (``seed``), so that none always runs
    right after the same other one, and every ratio comes with a 95 % bootstrap interval over
    the prompts (``paired``). Plain decoding (drafter None) runs on the same target session as
    the speculative variants, whose options a drafter leaves as they are (``load`` only changes
    the drafter's own). Each drafter's scheduled variant keeps a scheduler of its own, started
    from the pipeline's: a shared one would carry one drafter's drafting cost, acceptance offset
    and gate into the other's rounds."""
    if passes < 1:
        raise ConfigError(f"passes must be at least 1, got {passes}")
    base_cfg = GenerationConfig(max_new_tokens=max_new_tokens, ignore_eos=True, **(sampling or {}))
    comparable = base_cfg.temperature == 0.0 or base_cfg.sampling == "coupled"
    rows: dict[str, list[dict]] = {name: [] for name, _, _ in variants}
    warm = prompts[0].get("messages") or prompts[0]["prompt"]
    order_rng = np.random.default_rng(seed)

    # One twin per drafter (same target session, own KV cache): the caller's pipeline keeps its
    # drafter and scheduler, and each drafter's rounds tune a scheduler of its own.
    initial = pipe.scheduler  # None when loaded without one
    twins: dict[int, Pipeline] = {}
    for _, drafter, _ in variants:
        if id(drafter) not in twins:
            sched = None if initial is None or drafter is None else copy.deepcopy(initial)
            twins[id(drafter)] = pipe.twin(drafter, sched)

    def run(drafter, prompt, overrides, run_seed):
        return twins[id(drafter)].generate(prompt, base_cfg, seed=run_seed, **overrides)

    for _, drafter, overrides in variants:
        run(drafter, warm, overrides, seed)
    done = 0
    for pass_index in range(passes):
        for i, rec in enumerate(prompts):
            run_seed = seed + pass_index * len(prompts) + i
            prompt = rec.get("messages") or rec["prompt"]
            order = list(range(len(variants))) if passes == 1 else list(order_rng.permutation(len(variants)))
            tokens: dict[str, tuple[int, ...]] = {}
            for v in order:
                name, drafter, overrides = variants[v]
                r = run(drafter, prompt, overrides, run_seed)
                tokens[name] = r.token_ids
                s = r.stats
                rows[name].append({"id": rec["id"], "category": rec["category"], "pass": pass_index,
                                   "tokens_per_s": s.tokens_per_s, "decode_s": s.decode_s,
                                   "new_tokens": s.new_tokens, "rounds": s.rounds, "draft_n": s.draft_n,
                                   "draft_n_accepted": s.draft_n_accepted, "hist": dict(s.accept_length_hist),
                                   "widths": dict(s.widths), "drafter_disabled": s.drafter_disabled})
            baseline = tokens[variants[0][0]]
            for name in tokens:
                rows[name][-1]["exact"] = tokens[name] == baseline if comparable else None
            done += 1
            if progress:
                progress(done, passes * len(prompts), {n: rows[n][-1]["tokens_per_s"] for n in rows})
    summary = {}
    base_rate = None
    for name, rs in rows.items():
        rate = _rate(rs)
        base_rate = base_rate or rate
        drafted = sum(r["draft_n"] for r in rs)
        accepted = sum(r["draft_n_accepted"] for r in rs)
        rounds = sum(r["rounds"] for r in rs)
        per_cat: dict[str, list[float]] = {}
        for r in rs:
            per_cat.setdefault(r["category"], []).append(r["tokens_per_s"])
        hist: dict[int, int] = {}
        widths: dict[str, int] = {}
        for r in rs:
            for k, v in r["hist"].items():
                hist[int(k)] = hist.get(int(k), 0) + v
            for k, v in r["widths"].items():
                widths[k] = widths.get(k, 0) + v
        drafted_rounds = sum(hist.values())
        reach = [round(sum(v for k, v in hist.items() if k >= j) / drafted_rounds, 3)
                 for j in range(1, max(hist, default=0) + 1)] if drafted_rounds else []
        summary[name] = {
            "tokens_per_s": round(rate, 2), "speedup": round(rate / base_rate, 3),
            "accepted_at_least": reach, "widths": dict(sorted(widths.items(), key=lambda kv: int(kv[0]))),
            "acceptance": round(accepted / drafted, 3) if drafted else None,
            "mean_accepted_length": round((accepted + rounds) / rounds, 3) if rounds else None,
            "exact_prompts": f"{sum(r['exact'] for r in rs)}/{len(rs)}" if comparable else None,
            "tokens_per_s_by_category": {c: round(statistics.mean(v), 2) for c, v in per_cat.items()},
            # Runs in which the drafter failed and speculation stopped: their speed is not the drafter's.
            "drafter_failures": sum(r["drafter_disabled"] is not None for r in rs),
        }
        failures = [r["drafter_disabled"] for r in rs if r["drafter_disabled"]]
        if failures:
            summary[name]["drafter_failure"] = failures[-1]
    for name, drafter, overrides in variants:
        sched = twins[id(drafter)].scheduler
        if sched is not None and "draft_tokens" not in overrides:
            summary[name]["scheduler"] = {"draft_ms": round(sched.costs.draft_ms, 3),
                                          "confidence_offsets": [round(float(d), 3) for d in sched.offsets[:8]],
                                          "gated": sched.gated}
    for twin in twins.values():
        twin.close()
    report = {"max_new_tokens": max_new_tokens, "prompts": len(prompts), "passes": passes,
              "decoding": "greedy" if base_cfg.temperature == 0.0 else {
                  "temperature": base_cfg.temperature, "top_k": base_cfg.top_k, "top_p": base_cfg.top_p,
                  "sampling": base_cfg.sampling, "seed": seed},
              "variants": summary}
    if passes > 1 or len(prompts) > 1:
        report["paired"] = paired_comparison(rows, variants, seed=seed)
    return report


def _rate(rows: list[dict]) -> float:
    """Decode tokens per second over these runs (the first token of each comes from the prefill)."""
    return sum(r["new_tokens"] - 1 for r in rows) / sum(r["decode_s"] for r in rows)


def ratio_interval(rows_a: list[dict], rows_b: list[dict], resamples: int = 2000, seed: int = 0) -> dict:
    """Decode rate of runs ``a`` over that of runs ``b``, which cover the same prompts, with a 95 %
    bootstrap interval: the prompts are drawn with replacement (each with all its passes), so the
    interval shows how much the ratio depends on which prompts were measured and on the run's noise
    at each of them."""
    ids = sorted({r["id"] for r in rows_a})
    index = {p: i for i, p in enumerate(ids)}
    n = len(ids)

    def sums(rows):
        tok, sec = np.zeros(n), np.zeros(n)
        for r in rows:
            tok[index[r["id"]]] += r["new_tokens"] - 1
            sec[index[r["id"]]] += r["decode_s"]
        return tok, sec

    (ta, sa), (tb, sb) = sums(rows_a), sums(rows_b)
    ratio = (ta.sum() / sa.sum()) / (tb.sum() / sb.sum())
    draws = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    boot = (ta[draws].sum(1) / sa[draws].sum(1)) / (tb[draws].sum(1) / sb[draws].sum(1))
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return {"ratio": round(float(ratio), 4), "ci95": [round(float(lo), 4), round(float(hi), 4)], "prompts": n}


def paired_comparison(rows: dict[str, list[dict]], variants: list[tuple[str, object, dict]], seed: int = 0) -> dict:
    """Every variant against the baseline (the first), and every scheduled variant (no fixed
    ``draft_tokens``) of a drafter against that drafter's best fixed width: over the whole set
    (the width with the highest rate) and in each category (the best width there), each a
    ratio with its 95 % interval. Plain decoding, when it is the baseline, is width 1 and
    counts among the fixed widths (where drafting does not pay, it is the one to beat). With
    several drafters, each scheduled variant is also compared with the best fixed width of any
    drafter in the run (``best_fixed_any``): a drafter whose fixed widths are weak could
    otherwise look good against them alone."""
    base = variants[0][0]
    fixed_pairs = [(n, d) for n, d, o in variants if d is not None and "draft_tokens" in o]
    fixed_any = [n for n, _ in fixed_pairs]
    several = len({id(d) for _, d in fixed_pairs}) > 1
    out: dict = {"vs_" + base: {name: ratio_interval(rows[name], rows[base], seed=seed)
                                for name, _, _ in variants[1:]}}
    plain = [base] if variants[0][1] is None else []
    for name, drafter, overrides in variants:
        if drafter is None or "draft_tokens" in overrides:
            continue
        fixed = [n for n, d, o in variants if d is drafter and "draft_tokens" in o] + plain
        if len(fixed) == len(plain):
            continue
        best = max(fixed, key=lambda n: _rate(rows[n]))
        entry = {"best_fixed": best, "overall": ratio_interval(rows[name], rows[best], seed=seed), "by_category": {}}
        for cat in sorted({r["category"] for r in rows[name]}):
            pick = {n: [r for r in rows[n] if r["category"] == cat] for n in [name, *fixed]}
            best_here = max(fixed, key=lambda n: _rate(pick[n]))
            entry["by_category"][cat] = {"best_fixed": best_here,
                                         **ratio_interval(pick[name], pick[best_here], seed=seed)}
        if several:
            best_any = max(fixed_any + plain, key=lambda n: _rate(rows[n]))
            entry["best_fixed_any"] = {"best_fixed": best_any, **ratio_interval(rows[name], rows[best_any], seed=seed)}
        out[f"{name} vs best fixed"] = entry
    return out
