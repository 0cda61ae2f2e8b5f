"""How good a drafter the engine's cheaper graph is for its target, and what a drafting step
costs beside the target with one thread pool per session or one shared pool.

``agreement``: the target's greedy answers to the benchmark prompts are generated (or read from
``--answers``, a file ``bench/ngram_replay.py`` writes), then the copy runs teacher-forced over
prompt + answer once: how often its top-1 token equals the target's, the AUROC of its top-1 −
top-2 margin for that, agreement by top-probability bin, and one step of each graph alone.

``threads``: one child process per setting (the shared pool is process-wide), each alternating
copy steps and target passes over one shared cache: medians of the drafting step after a target
pass, after another drafting step, and of a width-3 target pass after drafting.

    python bench/self_draft.py agreement --engine engines/smollm2-135m --copy int8
    python bench/self_draft.py agreement --engine engines/smollm2-135m \
        --answers drafters/smollm2-135m-answers.npz --sample 120     # the margin bins' priors
    python bench/self_draft.py threads --engine engines/smollm2-135m --copy int8 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def step_ms(model, repeats: int = 60) -> float:
    cache = model.new_cache()
    model.prefill(cache, np.arange(100, 250, dtype=np.int64))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        model.step(cache, np.array([5], dtype=np.int64))
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times))


def agreement(args) -> dict:
    from dspark_edge.decoder import DecoderModel
    from dspark_edge.manifest import read_manifest
    from dspark_export.drafter.calibrate import auroc

    from ngram_replay import record_answers  # bench/ is on the path when run as a script

    if args.answers and args.answers.endswith(".npz"):  # a packed answers file (python -m export answers)
        from dspark_export.answers import load_answers

        packed = load_answers(Path(args.answers), read_manifest(args.engine))
        n = packed.prompt_lens.shape[0]
        pick = np.random.default_rng(0).choice(n, min(args.sample, n), replace=False) if args.sample else range(n)
        answers = []
        for i in pick:
            seq = packed.tokens[packed.offsets[i]:packed.offsets[i + 1]].astype(np.int64).tolist()
            p = int(packed.prompt_lens[i])
            if len(seq) - p >= 2:
                answers.append({"prompt": seq[:p], "answer": seq[p:]})
    elif args.answers:
        answers = json.loads(Path(args.answers).read_text())
    else:
        prompts = [json.loads(line) for line in (ROOT / "dspark_edge" / "data" / "prompts.jsonl").read_text().splitlines() if line]
        answers = record_answers(Path(args.engine), prompts, args.max_new_tokens)
    m = read_manifest(args.engine)
    copy = DecoderModel(m, args.engine, args.copy)
    equal, top, margin = [], [], []
    for rec in answers:
        ids = np.asarray(rec["prompt"] + rec["answer"][:-1], dtype=np.int64)
        cache = copy.new_cache()
        logits = copy.prefill(cache, ids, chunk=len(ids)).logits[-len(rec["answer"]):]
        z = np.exp(logits - logits.max(-1, keepdims=True))
        p = z / z.sum(-1, keepdims=True)
        two = np.sort(p, -1)[:, -2:]
        equal += list(p.argmax(-1) == np.asarray(rec["answer"]))
        top += list(two[:, 1])
        margin += list(two[:, 1] - two[:, 0])
    y, top, margin = np.asarray(equal), np.asarray(top), np.asarray(margin)
    bins = {}
    for lo, hi in ((0.0, 0.3), (0.3, 0.5), (0.5, 0.7), (0.7, 1.01)):
        sel = (top >= lo) & (top < hi)
        bins[f"{lo}-{min(hi, 1.0)}"] = {"tokens": int(sel.sum()), "equal": round(float(y[sel].mean()), 3) if sel.any() else None}
    from dspark_edge.drafters.self_draft import MARGIN_EDGES

    b = np.searchsorted(MARGIN_EDGES, margin, side="right")
    by_margin = [{"tokens": int((b == k).sum()), "equal": round(float(y[b == k].mean()), 4) if (b == k).any() else None}
                 for k in range(len(MARGIN_EDGES) + 1)]
    target = DecoderModel(m, args.engine, m.precisions("target")[0])
    return {"copy": args.copy, "target": target.precision, "tokens": int(len(y)), "equal": round(float(y.mean()), 4),
            "auroc_margin": round(auroc(margin, y), 3), "auroc_top_probability": round(auroc(top, y), 3),
            "equal_by_top_probability": bins, "equal_by_margin_bin": by_margin, "copy_step_ms": round(step_ms(copy), 2),
            "target_step_ms": round(step_ms(target), 2)}


def _one_setting(args) -> dict:
    """In a child process: one thread-pool setting."""
    from dspark_edge.backends import BackendOptions
    from dspark_edge.decoder import DecoderModel
    from dspark_edge.manifest import read_manifest

    m = read_manifest(args.engine)
    shared = args.setting == "shared"
    target = DecoderModel(m, args.engine, m.precisions("target")[0], options=BackendOptions(shared_threads=shared))
    copy = DecoderModel(m, args.engine, args.copy,
                        options=BackendOptions(shared_threads=shared, allow_spinning=False))
    cache = target.new_cache()
    target.prefill(cache, np.arange(100, 250, dtype=np.int64))
    view = copy.session.view_cache(cache)
    after_pass, after_step, wide = [], [], []
    one, three = np.array([5], dtype=np.int64), np.array([5, 6, 7], dtype=np.int64)
    for _ in range(args.steps):
        for sink, run in ((after_pass, lambda: copy.step(view, one)), (after_step, lambda: copy.step(view, one)),
                          (wide, lambda: target.step(cache, three))):
            t = time.perf_counter()
            run()
            sink.append(time.perf_counter() - t)
    med = lambda xs: round(1e3 * float(np.median(xs)), 2)  # noqa: E731
    return {"setting": args.setting, "draft_after_target_ms": med(after_pass), "draft_after_draft_ms": med(after_step),
            "target_width3_after_draft_ms": med(wide)}


def threads(args) -> list[dict]:
    from dspark_edge.errors import ConfigError
    from dspark_edge.manifest import read_manifest

    present = read_manifest(args.engine).precisions("target")  # bad input fails here, not in a child
    if args.copy not in present:
        raise ConfigError(f"precision {args.copy!r} is not in {args.engine} (it has {present}); export it with "
                          f"`--precisions {args.copy}` or pick one of those")
    rows = []
    for i in range(args.repeats):
        for setting in ("own", "shared"):
            cmd = [sys.executable, __file__, "one-setting", "--engine", args.engine, "--copy", args.copy,
                   "--setting", setting, "--steps", str(args.steps)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"[self_draft] {i + 1}/{args.repeats} {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("agreement", "threads", "one-setting"):
        p = sub.add_parser(name)
        p.add_argument("--engine", required=True)
        p.add_argument("--copy", default="int8", help="the drafting precision (default: int8)")
        if name == "agreement":
            p.add_argument("--answers", default=None,
                           help="recorded answers: JSON (bench/ngram_replay.py) or a packed .npz (python -m export "
                                "answers); default: generate the target's answers to the benchmark prompts")
            p.add_argument("--sample", type=int, default=0,
                           help="with a packed file: this many answers drawn at random (seed 0; default: all)")
            p.add_argument("--max-new-tokens", type=int, default=128)
        else:
            p.add_argument("--steps", type=int, default=30, help="alternations per setting")
        if name == "threads":
            p.add_argument("--repeats", type=int, default=2, help="child processes per setting")
        if name == "one-setting":
            p.add_argument("--setting", choices=("own", "shared"), required=True)
    args = ap.parse_args()
    result = {"agreement": agreement, "threads": threads, "one-setting": _one_setting}[args.cmd](args)
    print(json.dumps(result, indent=None if args.cmd == "one-setting" else 2))
    return 0


if __name__ == "__main__":
    from dspark_edge.cli import run_reporting_errors

    sys.exit(run_reporting_errors(main))
