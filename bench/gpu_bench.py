"""Plain vs speculative decoding on several backends, interleaved in one process.

    python bench/gpu_bench.py --engine engines/smollm2-135m-portable --json runs/gpu_check/bench.json

Each configuration is NAME=BACKEND:PRECISION[:PROVIDERS][@ENGINE] (providers comma-separated,
ONNX Runtime only; @ENGINE another engine folder than --engine); the defaults are ONNX Runtime CUDA FP16 and the TensorRT FP16 and INT8 engines.
For every prompt, every configuration runs plain and with the n-gram drafter back to back
(greedy, exactly --max-new-tokens tokens), so the ratios come from the same minutes of the same
machine. Prints and writes measured numbers only; "exact" counts prompts whose speculative
tokens equal that configuration's plain tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFAULT_CONFIGS = ("ort-cuda-fp16=onnxruntime:fp16:CUDAExecutionProvider",
                   "trt-fp16=tensorrt:fp16", "trt-int8=tensorrt:int8")


def parse_config(text: str) -> tuple[str, str, str, tuple[str, ...], str | None]:
    name, _, spec = text.partition("=")
    spec, _, engine = spec.partition("@")
    parts = spec.split(":")
    if not name or len(parts) not in (2, 3):
        raise SystemExit(f"error: --config {text!r}: expected NAME=BACKEND:PRECISION[:PROVIDERS][@ENGINE]")
    providers = tuple(parts[2].split(",")) if len(parts) == 3 else ("CPUExecutionProvider",)
    return name, parts[0], parts[1], providers, engine or None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", type=Path, required=True, help="portable engine folder (with TensorRT engines)")
    ap.add_argument("--config", action="append", default=None,
                    help="NAME=BACKEND:PRECISION[:PROVIDERS][@ENGINE] (repeatable; default: %s)"
                    % ", ".join(DEFAULT_CONFIGS))
    ap.add_argument("--prompts", type=Path, default=None, help="prompt file (default: dspark_edge/data/prompts.jsonl)")
    ap.add_argument("--limit", type=int, default=6, help="prompts to use (default: %(default)s)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="tokens per answer (default: %(default)s)")
    ap.add_argument("--draft-tokens", type=int, default=None,
                    help="fixed drafts per round for the speculative runs (default: the scheduler chooses)")
    ap.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = ap.parse_args(argv)

    import dspark_edge
    from dspark_edge.backends import BackendOptions
    from dspark_edge.bench import load_prompts
    from dspark_edge.config import GenerationConfig
    from dspark_edge.errors import DSparkError

    configs = [parse_config(c) for c in (args.config or DEFAULT_CONFIGS)]
    prompts = load_prompts(args.prompts)[:args.limit]
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, ignore_eos=True, draft_tokens=args.draft_tokens)
    pipes, report = {}, {"engine": str(args.engine), "max_new_tokens": args.max_new_tokens,
                         "prompts": len(prompts), "configs": {}, "errors": {}}
    for name, backend, precision, providers, engine in configs:
        engine = engine or str(args.engine)
        try:
            t0 = time.perf_counter()
            opts = BackendOptions(providers=providers)
            plain = dspark_edge.load(engine, precision, backend=backend, options=opts)
            spec = dspark_edge.load(engine, precision, backend=backend, options=opts, drafter="ngram")
            pipes[name] = (plain, spec)
            report["configs"][name] = {"engine": engine, "backend": backend, "precision": precision,
                                       "providers": list(providers), "load_s": round(time.perf_counter() - t0, 2)}
        except DSparkError as exc:
            report["errors"][name] = str(exc)
            print(f"[gpu-bench] {name}: {exc}", file=sys.stderr)
    if not pipes:
        print(json.dumps(report, indent=1))
        return 1
    rows: dict[str, dict[str, list]] = {n: {"plain": [], "spec": [], "exact": [], "accept": []} for n in pipes}
    warm = prompts[0].get("messages") or prompts[0]["prompt"]
    for plain, spec in pipes.values():
        plain.generate(warm, cfg)
        spec.generate(warm, cfg)
    for i, rec in enumerate(prompts):
        prompt = rec.get("messages") or rec["prompt"]
        for name, (plain, spec) in pipes.items():
            a = plain.generate(prompt, cfg)
            b = spec.generate(prompt, cfg)
            rows[name]["plain"].append((a.stats.new_tokens - 1, a.stats.decode_s))
            rows[name]["spec"].append((b.stats.new_tokens - 1, b.stats.decode_s))
            rows[name]["exact"].append(a.token_ids == b.token_ids)
            rows[name]["accept"].append((b.stats.draft_n_accepted, b.stats.draft_n, b.stats.rounds))
        print(f"[gpu-bench] prompt {i + 1}/{len(prompts)}", file=sys.stderr, flush=True)
    for name, r in rows.items():
        rate = lambda pairs: sum(t for t, _ in pairs) / max(1e-9, sum(s for _, s in pairs))  # noqa: E731
        plain_rate, spec_rate = rate(r["plain"]), rate(r["spec"])
        acc, drafted, rounds = (sum(x[k] for x in r["accept"]) for k in range(3))
        report["configs"][name].update({
            "plain_tokens_per_s": round(plain_rate, 1), "speculative_tokens_per_s": round(spec_rate, 1),
            "speedup": round(spec_rate / plain_rate, 3), "exact_prompts": f"{sum(r['exact'])}/{len(r['exact'])}",
            "acceptance": round(acc / drafted, 3) if drafted else None,
            "tokens_per_round": round((acc + rounds) / rounds, 3) if rounds else None})
    first = next(iter(rows))
    base = report["configs"][first]["plain_tokens_per_s"]
    for name in rows:
        report["configs"][name]["plain_vs_" + first] = round(report["configs"][name]["plain_tokens_per_s"] / base, 3)
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n", encoding="utf-8")
    return 0 if not report["errors"] else 1


if __name__ == "__main__":
    from dspark_edge.cli import run_reporting_errors

    sys.exit(run_reporting_errors(main))
