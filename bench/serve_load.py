"""Several clients at once: dspark_edge's server against llama-server on the same model and CPU.

    python bench/serve_load.py --engine engines/smollm2-135m [--clients 1,2,4] [--drafters none,auto] [--precisions auto]
        [--parallel 1,c] [--shared-verify on,off] [--llama-gguf .cache/llamacpp/work/target-f32.gguf] [--requests 8] [--max-tokens 64]
        [--rounds 3]

For each concurrency c, each server in turn (dspark_edge at each ``--precisions`` setting with each
drafter at each ``--parallel`` setting, "c" standing for the concurrency: ``serve --parallel c`` batches the requests, with
several requests' drafts verified in one pass or not (``--shared-verify``); then
llama-server with ``-np c`` when ``--llama-gguf`` is given: build it with
bench/llamacpp_crosscheck.py),
c client threads send the project's benchmark prompts (chat completions, streamed, greedy,
``--max-tokens`` each, EOS ignored where the server allows it) until ``--requests`` have been
answered. Every server runs on 127.0.0.1 and is stopped when its turn ends; every request has a
time limit. Prints JSON per server and concurrency: total decode throughput (completion tokens
over the wall time), per-request decode tok/s (median), time to first token p50/p99 and
per-token latency p50/p99 (between streamed chunks). With ``--rounds R`` the servers of each
concurrency take turns R times (one measurement each per round, so machine drift hits all alike)
and a summary gives each one's median and range over the rounds: one measurement of a server on
a 2-core machine can be 15 % off the next.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVER = ROOT / ".cache/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, seconds: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode})")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"{url} did not become ready")


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 2)


def load(url: str, model: str, prompts: list, clients: int, requests: int, max_tokens: int, extra: dict) -> dict:
    from openai import OpenAI

    lock = threading.Lock()
    todo = list(range(requests))
    rows: list[dict] = []

    def client() -> None:
        c = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop(0)
            rec = prompts[i % len(prompts)]
            t0 = time.perf_counter()
            stamps = []
            n = 0
            for chunk in c.chat.completions.create(model=model, messages=rec["messages"], max_tokens=max_tokens,
                                                   temperature=0, stream=True, extra_body=extra):
                if chunk.choices and chunk.choices[0].delta.content:
                    stamps.append(time.perf_counter())
                    n += 1
            with lock:
                rows.append({"ttft_ms": (stamps[0] - t0) * 1e3 if stamps else None,
                             "gaps_ms": [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])],
                             "decode_s": stamps[-1] - stamps[0] if len(stamps) > 1 else None, "chunks": n,
                             "end": time.perf_counter(), "start": t0})

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=1800)
    wall = time.perf_counter() - t0
    tokens = max_tokens * len(rows)  # every answer decodes max_tokens (EOS ignored)
    gaps = [g for r in rows for g in r["gaps_ms"]]
    per_user = [(max_tokens - 1) / r["decode_s"] for r in rows if r["decode_s"]]
    return {"requests": len(rows), "wall_s": round(wall, 2), "total_tok_s": round(tokens / wall, 2),
            "per_request_tok_s_median": round(statistics.median(per_user), 2) if per_user else None,
            "ttft_ms_p50": percentile([r["ttft_ms"] for r in rows if r["ttft_ms"]], 0.5),
            "ttft_ms_p99": percentile([r["ttft_ms"] for r in rows if r["ttft_ms"]], 0.99),
            "token_ms_p50": percentile(gaps, 0.5), "token_ms_p99": percentile(gaps, 0.99)}


def summarise(runs: list[dict]) -> list[dict]:
    """Per (server, clients): median, min and max over the rounds of the total and per-request
    rates and of the first token's p50."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["server"], r["clients"]), []).append(r)
    out = []
    for (server, clients), rows in groups.items():
        entry = {"server": server, "clients": clients, "rounds": len(rows)}
        for key, field in (("total_tok_s", "total_tok_s"), ("per_request_tok_s", "per_request_tok_s_median"),
                           ("ttft_ms_p50", "ttft_ms_p50")):
            xs = [r[field] for r in rows if r[field] is not None]
            entry[key] = {"median": round(statistics.median(xs), 2), "min": min(xs), "max": max(xs)} if xs else None
        out.append(entry)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", type=Path, required=True)
    ap.add_argument("--clients", default="1,2,4")
    ap.add_argument("--drafters", default="none,auto", help="dspark_edge drafters to serve with, comma-separated")
    ap.add_argument("--precisions", default="auto", help="dspark_edge serve --precision settings, comma-separated "
                                                         "(default: %(default)s, what the device's race chose)")
    ap.add_argument("--llama-gguf", type=Path, default=None, help="the same model as a GGUF for llama-server")
    ap.add_argument("--parallel", default="1", help="dspark_edge serve --parallel settings, comma-separated; "
                                                     "'c' is the number of clients (default: %(default)s)")
    ap.add_argument("--shared-verify", default="on", help="with --parallel > 1: 'on', 'off' or both "
                                                          "('on,off'; default: %(default)s)")
    ap.add_argument("--requests", type=int, default=8, help="requests per server and concurrency")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1, help="turns of every server per concurrency (default: %(default)s)")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")

    from dspark_edge.bench import load_prompts

    prompts = [p for p in load_prompts() if "messages" in p]
    report: dict = {"engine": str(args.engine), "max_tokens": args.max_tokens, "requests": args.requests, "runs": []}
    for clients in [int(c) for c in args.clients.split(",")]:
        servers = []
        for par in sorted({clients if p == "c" else int(p) for p in args.parallel.split(",")}):
            for shared in (args.shared_verify.split(",") if par > 1 else ["on"]):
                if shared not in ("on", "off"):
                    ap.error(f"--shared-verify takes on and off, got {shared!r}")
                flag = "--shared-verify" if shared == "on" else "--no-shared-verify"
                servers += [(f"dspark_edge {prec} {d}" + (f" --parallel {par}" if par > 1 else "")
                             + (" --no-shared-verify" if par > 1 and shared == "off" else ""),
                             [sys.executable, "-m", "dspark_edge", "serve", "--engine", str(args.engine), "--drafter",
                              d, "--precision", prec, "--max-queue", "64", "--parallel", str(par), flag],
                             {"ignore_eos": True})
                            for prec in args.precisions.split(",") for d in args.drafters.split(",")]
        if args.llama_gguf is not None:
            servers.append((f"llama-server -np {clients}", [str(SERVER), "-m", str(args.llama_gguf), "-np",
                                                              str(clients), "-c", str(4096 * clients), "-t",
                                                              str(os.cpu_count() or 2), "--no-warmup"],
                            {"ignore_eos": True}))
        for rnd, (name, cmd, extra) in [(r, srv) for r in range(args.rounds) for srv in servers]:
            port = free_port()
            proc = subprocess.Popen(cmd + ["--host", "127.0.0.1", "--port", str(port)], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
            try:
                url = f"http://127.0.0.1:{port}"
                wait_ready(url, proc)
                row = load(url, "m", prompts, clients, args.requests, args.max_tokens, extra)
            finally:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
            report["runs"].append({"server": name, "clients": clients, "round": rnd + 1, **row})
            print(f"[{name}, {clients} clients, round {rnd + 1}] {row['total_tok_s']} tok/s total, "
                  f"{row['per_request_tok_s_median']} per request", file=sys.stderr, flush=True)
    if args.rounds > 1:
        report["summary"] = summarise(report["runs"])
        for row in report["summary"]:
            print(f"[{row['server']}, {row['clients']} clients] total {row['total_tok_s']['median']} tok/s "
                  f"({row['total_tok_s']['min']}–{row['total_tok_s']['max']}), per request "
                  f"{row['per_request_tok_s']['median']}", file=sys.stderr)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
