"""The exact int4 target with a graph per width class: width-1 steps on the int4 graph (the GGUF's
own 4-bit blocks, FP32 activations), every wider pass and the prefill on the engine's FP32 graph,
both over one K/V cache; against FP32 and int4 alone, in one process.

    python bench/int4_wide_passes.py --engine engines/smollm2-135m [--drafters none,ngram+self]
        [--limit 8] [--max-new-tokens 64]

On a CPU, onnxruntime's 4-bit kernel with FP32 activations is fast for one row only (a verify
pass of two or more rows costs more than FP32's: docs/performance.md, "INT4 from the GGUF's
blocks"), so speculation on the int4 graph alone rarely pays. Here a round that verifies drafts
runs on the FP32 graph instead, whose K/V layout is the int4 graph's: both compute FP32's output
up to rounding, so the answers are compared with FP32 plain decoding's. The FP32 weights are
held in memory beside the 4-bit ones. Prints the pass cost per width (int4 alone, FP32, the
pair), then per mode the median decode rate, its geometric-mean ratio to FP32 plain decoding on
the same prompts (modes in a rotating order at every prompt) and how many answers equal FP32
plain decoding's. The scheduler of a mode with wide passes plans with the pair's cost curve,
measured here.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

import dspark_edge
from dspark_edge.bench import load_prompts
from dspark_edge.decoder import DecoderModel, prefill_in_chunks
from dspark_edge.profile import verify_curve_ms
from dspark_edge.scheduler import CostModel


def with_wide_passes(model: DecoderModel, wide: DecoderModel) -> None:
    """Make ``model`` (the int4 target of a loaded pipeline) run every pass wider than one token
    on ``wide`` (the same engine's FP32 graph), over a view of the same cache buffers."""
    narrow = model.session.forward

    def view(cache):
        v = getattr(cache, "wide_view", None)
        if v is None:
            v = cache.wide_view = wide.session.view_cache(cache)
        v.length = cache.length
        return v

    def forward(cache, ids: np.ndarray):
        return narrow(cache, ids) if ids.shape[0] == 1 else wide.session.forward(view(cache), ids)

    def step(cache, ids: np.ndarray):
        model.check_width(ids.shape[0])
        return forward(cache, ids)

    def prefill(cache, ids: np.ndarray, chunk: int = 128, hidden_sink=None, logits_sink=None):
        return prefill_in_chunks(forward, cache, ids, chunk, hidden_sink, logits_sink)

    model.step, model.prefill = step, prefill


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", required=True, help="an engine folder with fp32 and int4 target graphs")
    ap.add_argument("--drafters", default="none,ngram+self")
    ap.add_argument("--limit", type=int, default=8, help="benchmark prompts to decode")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    options = dspark_edge.BackendOptions(shared_threads=True)
    drafters = [None if d.strip() == "none" else d.strip() for d in args.drafters.split(",") if d.strip()]
    if None not in drafters:
        drafters.insert(0, None)  # FP32 plain decoding is the reference
    modes: dict[str, dspark_edge.Pipeline] = {}
    curves: dict[str, dict[int, float]] = {}  # pass ms by width, measured once per kind of pass

    def curve(key: str, model) -> dict[int, float]:
        if key not in curves:
            curves[key] = verify_curve_ms(model, repeats=7, warmup=3)
        return curves[key]

    for precision, wide in (("fp32", False), ("int4", False), ("int4", True)):
        for d in drafters:
            if wide and d is None:
                continue  # plain decoding runs width-1 steps only: int4 alone
            pipe = dspark_edge.load(args.engine, precision, drafter=d, options=options)
            name = f"{precision}{' + fp32 wide passes' if wide else ''} {d or 'plain'}"
            if wide:
                with_wide_passes(pipe.target, DecoderModel(pipe.manifest, args.engine, "fp32", options=options))
                measured = curve("int4 + fp32 wide passes", pipe.target)
                if pipe.scheduler is not None:  # plan with the pair's costs
                    cfg = pipe.scheduler.config
                    pipe.scheduler.costs = CostModel(measured, 0.0, cfg.cost_window, cfg.min_observations)
            elif d is None:
                curve(precision, pipe.target)
            modes[name] = pipe
    names = list(modes)
    rates = {n: [] for n in names}
    answers = {n: [] for n in names}
    for i, rec in enumerate(load_prompts()[:args.limit]):
        prompt = rec.get("messages") or rec["prompt"]
        for name in names[i % len(names):] + names[:i % len(names)]:
            r = modes[name].generate(prompt, max_new_tokens=args.max_new_tokens, ignore_eos=True)
            rates[name].append(r.stats.tokens_per_s)
            answers[name].append(r.token_ids)
    ref = "fp32 plain"
    base = np.array(rates[ref])
    report = {}
    for name in names:
        v = np.array(rates[name])
        report[name] = {"median_tok_s": round(float(np.median(v)), 1),
                        "vs_fp32_plain": round(float(np.exp(np.mean(np.log(v / base)))), 3),
                        "equal_to_fp32_plain": f"{sum(a == b for a, b in zip(answers[name], answers[ref]))}/{len(base)}"}
    print(json.dumps({"engine": args.engine, "prompts": len(base), "max_new_tokens": args.max_new_tokens,
                      "pass_ms_by_width": {k: {w: round(ms, 2) for w, ms in c.items()} for k, c in curves.items()},
                      "modes": report}, indent=1))
    return 0


if __name__ == "__main__":
    from dspark_edge.cli import run_reporting_errors

    sys.exit(run_reporting_errors(main))
