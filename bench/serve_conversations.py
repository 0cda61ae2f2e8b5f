"""Several clients each holding a conversation with one server: the time to a turn's first token
with the prompt cache (each turn starts from the K/V its slot kept of the conversation) and
without it (``--no-prompt-cache``: every turn prefills the whole conversation).

    python bench/serve_conversations.py --engine engines/smollm2-135m --clients 2 --turns 6 --rounds 2 \
        [--llama-gguf MODEL.gguf]

Each round starts ``python -m dspark_edge serve --parallel C`` twice in turns, with and without
the prompt cache (same precision and drafter, on 127.0.0.1), then, with ``--llama-gguf``,
llama-server ``-np C`` on that GGUF (its prompt cache on, as by default; built by
bench/llamacpp_crosscheck.py), and C client threads talk to each at once: client i's user messages are the project's benchmark prompts starting at the i-th, one a
turn, each answer streamed (greedy, ``--max-tokens``, usage included) and appended to its
history. Reports per server: time to first token p50/p90 over the turns after the first, the
share of prompt tokens the server reused (``usage.prompt_tokens_details.cached_tokens``), and the
median per turn index. One JSON object on stdout, a line per server and round on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.serve_load import SERVER, free_port, percentile, wait_ready  # noqa: E402
from dspark_edge.bench import load_prompts  # noqa: E402


def converse(url: str, clients: int, turns: int, max_tokens: int) -> list[dict]:
    """Every client's turns at once: (client, turn, ttft_s, prompt_tokens, cached_tokens)."""
    import openai

    prompts = load_prompts()
    records: list[dict] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
        history: list[dict] = []
        try:
            for t in range(turns):
                rec = prompts[(i + t) % len(prompts)]
                message = rec["messages"][-1]["content"] if rec.get("messages") else rec["prompt"]
                history.append({"role": "user", "content": message})
                t0, first, text, usage, timings = time.perf_counter(), None, "", None, None
                for chunk in c.chat.completions.create(model="m", messages=history, max_tokens=max_tokens,
                                                       temperature=0, stream=True,
                                                       stream_options={"include_usage": True}):
                    if chunk.choices and chunk.choices[0].delta.content:
                        first = first or time.perf_counter()
                        text += chunk.choices[0].delta.content
                    if chunk.usage is not None:
                        usage = chunk.usage
                    timings = (chunk.model_extra or {}).get("timings") or timings  # llama-server's counts
                history.append({"role": "assistant", "content": text})
                details = getattr(usage, "prompt_tokens_details", None)
                if details is not None:
                    prompt, cached = usage.prompt_tokens, details.cached_tokens
                elif timings:
                    prompt, cached = timings.get("prompt_n", 0) + timings.get("cache_n", 0), timings.get("cache_n")
                else:
                    prompt, cached = None, None
                with lock:
                    records.append({"client": i, "turn": t + 1, "ttft_s": (first or time.perf_counter()) - t0,
                                    "prompt_tokens": prompt, "cached_tokens": cached})
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=1800)
    if errors:
        raise SystemExit(f"a client failed: {errors[0]!r}")
    return records


def summary(records: list[dict]) -> dict:
    later = [r for r in records if r["turn"] > 1]
    counted = [r for r in later if r["cached_tokens"] is not None and r["prompt_tokens"]]
    by_turn = {}
    for r in records:
        by_turn.setdefault(r["turn"], []).append(r["ttft_s"] * 1e3)
    return {"ttft_ms_p50_after_turn_1": round(percentile([r["ttft_s"] * 1e3 for r in later], 0.5), 1),
            "ttft_ms_p90_after_turn_1": round(percentile([r["ttft_s"] * 1e3 for r in later], 0.9), 1),
            "cached_share_after_turn_1": (round(sum(r["cached_tokens"] for r in counted) /
                                                max(1, sum(r["prompt_tokens"] for r in counted)), 3)
                                          if counted else None),
            "ttft_ms_median_by_turn": {t: round(statistics.median(v), 1) for t, v in sorted(by_turn.items())}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--clients", type=int, default=2, help="conversations at once = serve --parallel (default 2)")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--precision", default="auto")
    ap.add_argument("--drafter", default="auto")
    ap.add_argument("--llama-gguf", type=Path, default=None, help="a GGUF of the same model for llama-server")
    args = ap.parse_args()
    if args.clients < 1 or args.turns < 2 or args.rounds < 1:
        raise SystemExit("--clients >= 1, --turns >= 2 and --rounds >= 1")
    if args.llama_gguf is not None and not SERVER.is_file():
        raise SystemExit(f"{SERVER} is missing: build it with bench/llamacpp_crosscheck.py")
    serve = [sys.executable, "-m", "dspark_edge", "serve", "--engine", args.engine, "--parallel", str(args.clients),
             "--precision", args.precision, "--drafter", args.drafter, "--max-queue", str(2 * args.clients)]
    servers = {"prompt cache": serve, "no prompt cache": serve + ["--no-prompt-cache"]}
    if args.llama_gguf is not None:
        servers[f"llama-server {args.llama_gguf.name}"] = [
            str(SERVER), "-m", str(args.llama_gguf), "-np", str(args.clients), "-c", str(4096 * args.clients),
            "-t", str(os.cpu_count() or 2), "--no-warmup"]
    runs: dict[str, list[dict]] = {name: [] for name in servers}
    for rnd in range(args.rounds):
        for name, cmd in servers.items():
            port = free_port()
            cmd = cmd + ["--host", "127.0.0.1", "--port", str(port)]
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                url = f"http://127.0.0.1:{port}"
                wait_ready(url, proc)
                records = converse(url, args.clients, args.turns, args.max_tokens)
            finally:
                proc.terminate()
                proc.wait(timeout=60)
            runs[name].append(records)
            s = summary(records)
            print(f"[round {rnd + 1}] {name}: first token p50 {s['ttft_ms_p50_after_turn_1']} ms after turn 1, "
                  + (f"{s['cached_share_after_turn_1']:.0%} of prompt tokens reused"
                     if s["cached_share_after_turn_1"] is not None else "reuse not reported"),
                  file=sys.stderr, flush=True)
    out = {"engine": args.engine, "clients": args.clients, "turns": args.turns, "max_tokens": args.max_tokens,
           "precision": args.precision, "drafter": args.drafter,
           "servers": {name: {"rounds": [summary(r) for r in rs], "all": summary([x for r in rs for x in r])}
                       for name, rs in runs.items()}}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
