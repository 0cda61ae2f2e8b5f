"""The int4 graph made from a GGUF's own Q4_1 blocks against the FP32 graph (and any other
precision of the engine), plain and speculative, interleaved in one process.

    python -m export target --source default --output engines/smollm2-135m-q4 --precisions fp32,int8,int4
    python bench/int4_exact.py --engine engines/smollm2-135m-q4 --precisions fp32,int4,int8 \
        --drafters none,ngram --max-new-tokens 64

For each prompt of the project's set, every (precision, drafter) pair decodes greedily in turn
(EOS ignored), so machine drift hits all alike. Reports per pair: decode tok/s and its ratio to
FP32 plain decoding (95 % bootstrap interval over prompts), how many answers equal FP32's and the
mean first divergence, whether each divergence is a near-tie of FP32's logits (the two tokens'
FP32 logits closer than --tie of the largest |logit|), and whether speculative answers equal the
same precision's plain answers. Then the cost of one pass at each verify width per precision.
Writes JSON (--output) and prints a table.

``--genai-int4 DIR`` adds onnxruntime-genai decoding its own int4 model of the same weights (its
model builder's CPU default: the weights re-quantized to 4 bits, int8 activations), built into
DIR from the engine's source when DIR holds none, plainly and with its native n-gram
speculative decoding (``--genai-ngram``: N×K, n-gram size N and at most K drafts a round), in
the same turns and on the same prompt token ids as the engine's modes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def genai_ngram_options(spec: str) -> dict[str, dict]:
    """``--genai-ngram`` ("3x4,4x8") as {row name: set_speculative_options keywords}."""
    out = {}
    for part in filter(None, spec.split(",")):
        n, _, k = part.partition("x")
        if not (n.isdigit() and k.isdigit()):
            raise SystemExit(f"--genai-ngram takes NxK items (n-gram size x drafts), got {part!r}")
        out[f"genai-int4+ngram{n}x{k}"] = {"ngram_size": int(n), "max_draft_tokens": int(k)}
    return out


def build_genai_int4(engine: Path, out: Path) -> None:
    """onnxruntime-genai's own int4 model of the engine's source, written to ``out`` (whole, or
    not at all) by its model builder with the CPU defaults."""
    from dspark_export.target import build_graph
    from llamacpp_crosscheck import target_hf_folder

    print(f"building onnxruntime-genai's int4 model into {out} (a few minutes)", file=sys.stderr, flush=True)
    partial = out.with_name(out.name + ".partial")
    with tempfile.TemporaryDirectory() as work:
        try:
            build_graph(target_hf_folder(engine, Path(work)), partial, "int4", (), Path(work) / "builder.log",
                        keep_all=True)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
    partial.rename(out)


def genai_generate(og, model, ids: list[int], n: int, speculative: dict | None) -> tuple[list[int], float]:
    """onnxruntime-genai's greedy answer of ``n`` tokens (EOS ignored) and its decode seconds
    (first token to last, as the engine's ``decode_s``)."""
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + n, min_length=len(ids) + n, do_sample=False)
    if speculative:
        params.set_speculative_options(**speculative)
    gen = og.Generator(model, params)
    gen.append_tokens([ids])
    first = None
    while not gen.is_done() and gen.token_count() < len(ids) + n:
        gen.generate_next_token()
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    return [int(t) for t in gen.get_sequence(0)[len(ids):len(ids) + n]], end - first


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True, type=Path, action="append",
                    help="engine folder; name it again to compare several (their variants are then named "
                         "FOLDER/PRECISION, and FP32 is the first folder's)")
    ap.add_argument("--precisions", default="fp32,int4")
    ap.add_argument("--drafters", default="none,ngram", help="comma-separated: none, or a drafter spec")
    ap.add_argument("--prompts", default=None, help="JSON lines prompt file (default: the project's set)")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--tie", type=float, default=1e-3, help="near-tie: logit gap below this × max |logit|")
    ap.add_argument("--output", type=Path, default=None)
    ap.add_argument("--genai-int4", type=Path, default=None,
                    help="onnxruntime-genai's own int4 model folder (built there from the engine's source when missing)")
    ap.add_argument("--genai-ngram", default="3x4", help="with --genai-int4: its n-gram speculative settings, "
                                                         "comma-separated NxK ('' for plain only)")
    args = ap.parse_args()
    genai_rows = {"genai-int4+plain": None, **genai_ngram_options(args.genai_ngram)} if args.genai_int4 else {}

    import dspark_edge
    from dspark_edge.backends import BackendOptions
    from dspark_edge.bench import load_prompts, ratio_interval, verify_cost_curve
    from dspark_edge.decoder import DecoderModel
    from dspark_edge.errors import ConfigError
    from dspark_edge.manifest import read_manifest

    manifest = read_manifest(args.engine[0])
    precisions = args.precisions.split(",")
    several = len(args.engine) > 1
    drafters = [None if d == "none" else d for d in args.drafters.split(",")]
    # One process-wide thread pool: sessions take turns on the same cores without spinning
    # against each other.
    options = BackendOptions(shared_threads=True)
    pipes = {}
    for engine in args.engine:
        for p in precisions:
            if several and p == "fp32" and engine != args.engine[0]:
                continue  # one FP32 reference
            name = f"{engine.name}/{p}" if several else p
            for d in drafters:
                try:
                    pipes[(name, d)] = dspark_edge.load(engine, p, drafter=d, options=options,
                                                        scheduler=None if d else False)
                except ConfigError as exc:  # e.g. self-drafting for the graph that would draft
                    print(f"skipping {name} + {d}: {exc}", file=sys.stderr)
    genai = None
    if args.genai_int4 is not None:
        import onnxruntime_genai as og

        if not (args.genai_int4 / "genai_config.json").is_file():
            build_genai_int4(args.engine[0], args.genai_int4)
        genai = og.Model(str(args.genai_int4))
    prompts = load_prompts(args.prompts)[:args.limit]
    rows: dict[str, list[dict]] = {f"{p}+{d or 'plain'}": [] for p, d in pipes}
    rows.update({name: [] for name in genai_rows})
    answers: dict[str, list[tuple]] = {k: [] for k in rows}
    prompt_ids = []
    for rec in prompts[:1]:  # warm-up, untimed
        for pipe in pipes.values():
            pipe.generate(rec.get("messages") or rec["prompt"], max_new_tokens=8, ignore_eos=True)
        ids = list(next(iter(pipes.values())).encode_prompt(rec.get("messages") or rec["prompt"]))
        for spec in genai_rows.values():
            genai_generate(og, genai, ids, 8, spec)
    for n, rec in enumerate(prompts, 1):
        for (p, d), pipe in pipes.items():
            r = pipe.generate(rec.get("messages") or rec["prompt"], max_new_tokens=args.max_new_tokens, ignore_eos=True)
            key = f"{p}+{d or 'plain'}"
            rows[key].append({"id": rec["id"], "new_tokens": r.stats.new_tokens, "decode_s": r.stats.decode_s})
            answers[key].append(r.token_ids)
        for key, spec in genai_rows.items():  # the same prompt token ids
            toks, decode_s = genai_generate(og, genai, list(r.prompt_ids), args.max_new_tokens, spec)
            rows[key].append({"id": rec["id"], "new_tokens": len(toks), "decode_s": decode_s})
            answers[key].append(tuple(toks))
        prompt_ids.append(r.prompt_ids)
        print(f"[{n}/{len(prompts)}] {rec['id']}", file=sys.stderr, flush=True)

    fp32 = DecoderModel(manifest, args.engine[0], "fp32", options=options) if "fp32" in precisions else None
    base = (f"{args.engine[0].name}/" if several else "") + "fp32+plain"
    base = base if fp32 is not None else next(iter(rows))

    def near_tie(i: int, want: tuple, got: tuple) -> dict:
        at = next(j for j, (a, b) in enumerate(zip(want, got)) if a != b)
        cache = fp32.new_cache()
        logits = fp32.prefill(cache, np.asarray(list(prompt_ids[i]) + list(want[:at]), dtype=np.int64)).logits[-1]
        gap = abs(float(logits[want[at]] - logits[got[at]])) / float(np.abs(logits).max())
        return {"prompt": prompts[i]["id"], "at": at, "relative_gap": gap, "near_tie": gap < args.tie}

    report = {"engine": [str(e) for e in args.engine] if several else str(args.engine[0]),
              "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "genai_int4": str(args.genai_int4) if args.genai_int4 else None,
              "int4_weights": {e.name: read_manifest(e).exporter.get("int4_weights") for e in args.engine},
              "results": {}}
    for key, rs in rows.items():
        same = [a == b for a, b in zip(answers[key], answers[base])]
        firsts = [next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                  for a, b in zip(answers[key], answers[base])]
        plain_key = key.split("+", 1)[0] + "+plain"
        entry = {"tok_s": round(sum(r["new_tokens"] - 1 for r in rs) / sum(r["decode_s"] for r in rs), 2),
                 "vs_" + base: ratio_interval(rs, rows[base]),
                 "identical_to_" + base: f"{sum(same)}/{len(same)}",
                 "mean_first_divergence": round(statistics.mean(f for f, s in zip(firsts, same) if not s), 1)
                 if not all(same) else None}
        if fp32 is not None and key != base:
            entry["divergences"] = [near_tie(i, answers[base][i], a) for i, (a, s) in
                                    enumerate(zip(answers[key], same)) if not s]
        if plain_key in answers and plain_key != key:
            entry["identical_to_" + plain_key] = (f"{sum(a == b for a, b in zip(answers[key], answers[plain_key]))}"
                                                  f"/{len(rs)}")
        report["results"][key] = entry
    for name in dict.fromkeys(q for q, _ in pipes):
        report.setdefault("verify_ms", {})[name] = verify_cost_curve(next(pipe for (q, _), pipe in pipes.items()
                                                                          if q == name).target)
    text = json.dumps(report, indent=1)
    if args.output:
        args.output.write_text(text)
    print(text)
    print(f"\n{'variant':<30}{'tok/s':>8}{'vs ' + base:>22}{'same as FP32':>14}  near-ties", file=sys.stderr)
    for key, e in report["results"].items():
        r = e["vs_" + base]
        ties = e.get("divergences", [])
        print(f"{key:<30}{e['tok_s']:>8}{r['ratio']:>10.2f} ({r['ci95'][0]:.2f}–{r['ci95'][1]:.2f})"
              f"{e['identical_to_' + base]:>14}  {sum(t['near_tie'] for t in ties)}/{len(ties)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
