"""Plain decoding: dspark_edge vs onnxruntime-genai's own generator, same graph, interleaved.

    python bench/compare_genai.py --engine engines/smollm2-135m --precisions fp32,int8

For each prompt of the project's set, the two decoders run back to back in this process
on the same graph file, greedy, --max-new-tokens each, so machine drift hits both alike.
Prints JSON: tok/s of each (decode only, and with prefill), their ratio, and whether the
greedy tokens agree. onnxruntime-genai is the peer: it comes with the export extra.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import dspark_edge
from dspark_edge.bench import load_prompts


def genai_folder(engine: Path, manifest, precision: str, max_length: int) -> Path:
    """A throw-away onnxruntime-genai model folder pointing at the engine's graph."""
    graph = engine / manifest.variants_for("target", precision)[0].file
    folder = Path(tempfile.mkdtemp(prefix=f"genai-{precision}-"))
    names = ["model.onnx", "model.onnx.data"]
    table = manifest.embedding_table(manifest.variants_for("target", precision)[0].file)
    if table is not None:  # the graph's embedding table, named by its external data entry
        names.append(Path(table.file).name)
    for name in names:
        os.symlink(graph.parent.resolve() / name, folder / name)
    m, io = manifest.model, manifest.io
    config = {
        "model": {
            "bos_token_id": manifest.tokenizer.bos_id, "context_length": max_length,
            "eos_token_id": list(manifest.tokenizer.eos_ids), "pad_token_id": manifest.tokenizer.pad_id or 0,
            "type": m.architecture, "vocab_size": m.vocab_size,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": "model.onnx", "head_size": m.head_dim, "hidden_size": m.hidden_size,
                "inputs": {"input_ids": io.input_ids, "attention_mask": io.attention_mask,
                           "past_key_names": io.past_key.replace("{layer}", "%d"),
                           "past_value_names": io.past_value.replace("{layer}", "%d")},
                "outputs": {"logits": io.logits, "present_key_names": io.present_key.replace("{layer}", "%d"),
                            "present_value_names": io.present_value.replace("{layer}", "%d")},
                "num_attention_heads": m.num_heads, "num_hidden_layers": m.num_layers,
                "num_key_value_heads": m.num_kv_heads,
            },
        },
        "search": {"do_sample": False, "max_length": max_length, "past_present_share_buffer": True,
                   "num_beams": 1, "top_k": 1, "temperature": 1.0},
    }
    (folder / "genai_config.json").write_text(json.dumps(config))
    return folder


def genai_generate(og, model, ids: list[int], n: int) -> tuple[list[int], float, float]:
    """(tokens, seconds to the first token, total seconds)."""
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + n, min_length=len(ids) + n, do_sample=False)
    t0 = time.perf_counter()
    gen = og.Generator(model, params)
    gen.append_tokens([ids])
    out, first = [], None
    while not gen.is_done() and len(out) < n:
        gen.generate_next_token()
        out.append(int(gen.get_next_tokens()[0]))
        if first is None:
            first = time.perf_counter() - t0
    return out, first or 0.0, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True, type=Path)
    ap.add_argument("--precisions", default="fp32")
    ap.add_argument("--prompts", default=None)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    import onnxruntime_genai as og

    prompts = load_prompts(args.prompts)[:args.limit]
    report = {"engine": str(args.engine), "max_new_tokens": args.max_new_tokens, "results": {}}
    for precision in args.precisions.split(","):
        pipe = dspark_edge.load(args.engine, precision)
        folder = genai_folder(args.engine, pipe.manifest, precision, 2048)
        model = og.Model(str(folder))
        ours_rates, peer_rates, ours_wall, peer_wall, agree = [], [], [], [], []
        for i, rec in enumerate([prompts[0]] + prompts):  # the first run of each is a warm-up
            messages = rec["messages"] if "messages" in rec else rec["prompt"]
            ids = pipe.encode_prompt(messages)
            r = pipe.generate(messages, max_new_tokens=args.max_new_tokens, ignore_eos=True)
            toks, first, total = genai_generate(og, model, ids, args.max_new_tokens)
            if i == 0:
                continue
            ours_rates.append(r.stats.tokens_per_s)
            ours_wall.append(r.stats.new_tokens / r.stats.total_s)
            peer_rates.append((len(toks) - 1) / (total - first))
            peer_wall.append(len(toks) / total)
            same = next((j for j, (a, b) in enumerate(zip(r.token_ids, toks)) if a != b), min(len(toks), len(r.token_ids)))
            agree.append(same)
            print(f"[{precision}] {rec['id']}: ours {ours_rates[-1]:.1f} tok/s, onnxruntime-genai "
                  f"{peer_rates[-1]:.1f} tok/s, greedy agree {same}/{args.max_new_tokens}", file=sys.stderr, flush=True)
        report["results"][precision] = {
            "prompts": len(ours_rates),
            "dspark_edge_tok_s": round(statistics.mean(ours_rates), 2),
            "onnxruntime_genai_tok_s": round(statistics.mean(peer_rates), 2),
            "ratio": round(statistics.mean(ours_rates) / statistics.mean(peer_rates), 3),
            "dspark_edge_tok_s_with_prefill": round(statistics.mean(ours_wall), 2),
            "onnxruntime_genai_tok_s_with_prefill": round(statistics.mean(peer_wall), 2),
            "greedy_tokens_agreeing_before_divergence": agree,
        }
        del model
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
