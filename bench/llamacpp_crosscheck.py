"""One DSpark drafter, two runtimes: dspark_edge and llama.cpp side by side.

    python bench/llamacpp_crosscheck.py --engine engines/smollm2-135m --drafter DEEPSPEC_DIR \
        [--limit 12] [--max-new-tokens 128] [--block 7]

The drafter is a DeepSpec-format checkpoint (``train-drafter`` writes one to OUTPUT/deepspec,
``python -m export deepspec`` converts a drafter folder). The script

1. builds llama.cpp's ``llama-server`` from the llama-cpp-python 0.3.36 sdist (``pip download``,
   its vendored llama.cpp, cmake + ninja; cached in .cache/llamacpp, about 10 minutes once);
2. writes the engine's target as a Hugging Face folder and converts it to an F32 GGUF, and the
   drafter to a GGUF, with llama.cpp's own ``convert_hf_to_gguf.py`` (its ``sentencepiece``
   import is installed into .cache/llamacpp/pydeps, not into the project's environment);
3. imports the same checkpoint into a copy of the engine (``python -m export drafter``);
4. starts two llama-servers on 127.0.0.1 (plain, and ``--spec-type draft-dspark``), each
   stopped when the script ends;
5. for each of the project's benchmark prompts, in turn: dspark_edge plain, dspark_edge with the
   drafter at a fixed block and with the scheduler, llama.cpp plain and llama.cpp with the
   drafter, greedy, the same prompt token ids (dspark_edge applies the chat template; llama.cpp
   gets those ids), EOS ignored.

Prints JSON: per mode, decode tok/s (median over prompts) and its ratio to the same runtime's
plain decoding, drafted and accepted tokens, acceptance rate and mean tokens per round, and how
many answers equal the runtime's own plain answer. llama.cpp runs the FP32 GGUF of the same
weights, so its plain answers should equal dspark_edge's FP32 ones; the report counts that too.
Not part of CI (the build takes minutes); its numbers go to docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tarfile
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "llamacpp"
SDIST = "llama-cpp-python==0.3.36"
LLAMA = CACHE / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
SERVER = LLAMA / "build" / "bin" / "llama-server"


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(cmd: list, timeout: float, **kw) -> None:
    say("$ " + " ".join(map(str, cmd)))
    p = subprocess.run([str(c) for c in cmd], timeout=timeout, capture_output=True, text=True, **kw)
    if p.returncode:
        raise SystemExit(f"failed ({p.returncode}): {' '.join(map(str, cmd))}\n{p.stderr[-3000:]}")


def build_llama_server() -> None:
    if SERVER.is_file():
        return
    CACHE.mkdir(parents=True, exist_ok=True)
    if not LLAMA.is_dir():
        run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", SDIST, "-d", CACHE], 600)
        (archive,) = CACHE.glob("llama_cpp_python-0.3.36.tar.gz")
        with tarfile.open(archive) as tar:
            tar.extractall(CACHE, filter="data")
    say("[build] llama-server (about 10 minutes on 2 cores)")
    # Native code without ggml's AMX kernels: on a virtual machine whose CPU reports AMX, its
    # tile instructions died with SIGILL (the kernel did not grant the tile state). GCC keeps an
    # explicit -mno-* over what -march=native implies, whatever their order.
    no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    run(["cmake", "-S", LLAMA, "-B", LLAMA / "build", "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
         "-DLLAMA_OPENSSL=OFF", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
         f"-DCMAKE_C_FLAGS={no_amx}", f"-DCMAKE_CXX_FLAGS={no_amx}"], 600)
    run(["cmake", "--build", LLAMA / "build", "-j", str(os.cpu_count() or 2), "--target", "llama-server"], 3600)


def convert(src: Path, out: Path, target_hf: Path | None = None) -> Path:
    """llama.cpp's converter, FP32 output, with sentencepiece from the cache folder."""
    if out.is_file():
        return out
    deps = CACHE / "pydeps"
    if not (deps / "sentencepiece").is_dir():
        run([sys.executable, "-m", "pip", "install", "-q", "--target", deps, "sentencepiece>=0.1.98,<0.3.0"], 600)
    cmd = [sys.executable, LLAMA / "convert_hf_to_gguf.py", src, "--outtype", "f32", "--outfile", out]
    if target_hf is not None:
        cmd += ["--target-model-dir", target_hf]
    run(cmd, 1800, env={**os.environ, "PYTHONPATH": str(deps), "TQDM_DISABLE": "1"})
    return out


def target_hf_folder(engine: Path, work: Path) -> Path:
    """The engine's source as a Hugging Face folder (what llama.cpp's converter reads)."""
    from dspark_edge.manifest import read_manifest
    from dspark_export.sources import load_source, resolve_source

    out = work / "hf-target"
    if (out / "config.json").is_file():
        return out
    source = read_manifest(engine).model.source
    kind, _, path = source.partition(":")
    model, tok = load_source(resolve_source("default" if kind == "default" else path))
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A llama-server on 127.0.0.1, stopped on exit; every request bounded in time."""

    def __init__(self, args: list, log: Path) -> None:
        self.port = free_port()
        self.log = open(log, "w")
        self.proc = subprocess.Popen([str(SERVER), *map(str, args), "--host", "127.0.0.1", "--port", str(self.port)],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if json.loads(r.read()).get("status") == "ok":
                        return
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise SystemExit(f"llama-server exited ({self.proc.returncode}); see {log}")
            time.sleep(0.5)
        raise SystemExit(f"llama-server did not become ready in 120 s; see {log}")

    def complete(self, ids: list[int], n: int) -> dict:
        body = json.dumps({"prompt": ids, "n_predict": n, "temperature": 0, "top_k": 1, "ignore_eos": True,
                           "return_tokens": True, "cache_prompt": False}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def summarise(rows: list[dict], plain_key: str) -> dict:
    out = {}
    for mode in rows[0]["modes"]:
        vals = [r["modes"][mode] for r in rows]
        tps = [v["tok_s"] for v in vals]
        ratio = [v["tok_s"] / r["modes"][plain_key(mode)]["tok_s"] for v, r in zip(vals, rows)]
        drafted, accepted = sum(v["drafted"] for v in vals), sum(v["accepted"] for v in vals)
        rounds = sum(v.get("rounds", 0) for v in vals)
        out[mode] = {"median_tok_s": round(statistics.median(tps), 2),
                     "median_ratio_to_own_plain": round(statistics.median(ratio), 3),
                     "drafted": drafted, "accepted": accepted,
                     "acceptance": round(accepted / drafted, 4) if drafted else None,
                     "tokens_per_round": round(sum(v["new"] for v in vals) / rounds, 3) if rounds else None,
                     "same_as_own_plain": sum(v["same_as_plain"] for v in vals), "prompts": len(vals)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", type=Path, required=True, help="the target's engine folder (FP32)")
    ap.add_argument("--drafter", type=Path, required=True, help="a DeepSpec-format DSpark checkpoint folder")
    ap.add_argument("--limit", type=int, default=12, help="prompts of the project's set (default: %(default)s)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--block", type=int, default=None, help="drafts per round at a fixed block (default: the "
                    "checkpoint's block_size)")
    ap.add_argument("--p-min", type=float, default=0.0, help="llama.cpp's --spec-draft-p-min (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama.cpp's threads (default: the "
                    "cores; dspark_edge uses its own default, one ONNX Runtime thread per core)")
    ap.add_argument("--work", type=Path, default=CACHE / "work")
    args = ap.parse_args()

    import dspark_edge
    from dspark_edge.bench import load_prompts
    from dspark_export.drafter.install import install_drafter

    block = args.block or json.loads((args.drafter / "config.json").read_text())["block_size"]
    args.work.mkdir(parents=True, exist_ok=True)
    build_llama_server()
    hf = target_hf_folder(args.engine, args.work)
    target_gguf = convert(hf, args.work / "target-f32.gguf")
    drafter_gguf = args.work / f"drafter-{args.drafter.resolve().name}.gguf"
    drafter_gguf.unlink(missing_ok=True)  # the checkpoint may have changed under the same name
    convert(args.drafter, drafter_gguf, hf)
    engine = args.work / "engine"
    shutil.rmtree(engine, ignore_errors=True)
    shutil.copytree(args.engine, engine, ignore=shutil.ignore_patterns("drafter-*"))
    install_drafter(engine, args.drafter, precisions=("fp32",), progress=say)

    prompts = load_prompts()[: args.limit]
    common = ["-m", target_gguf, "-t", args.threads, "-c", 4096, "--no-warmup"]
    with ExitStack() as stack:
        plain_srv = Server(common, args.work / "server-plain.log")
        stack.callback(plain_srv.close)
        spec_srv = Server(common + ["-md", drafter_gguf, "--spec-type", "draft-dspark", "--spec-draft-n-max", block,
                                    "--spec-draft-p-min", args.p_min, "-td", args.threads],
                          args.work / "server-dspark.log")
        stack.callback(spec_srv.close)
        plain = dspark_edge.load(engine, "fp32")
        stack.callback(plain.close)
        spec = dspark_edge.load(engine, "fp32", drafter="dspark")  # scheduled unless draft_tokens is given
        stack.callback(spec.close)
        n = args.max_new_tokens
        rows = []
        for i, rec in enumerate(prompts):
            msgs = rec.get("messages") or rec["prompt"]
            modes = {}
            base = plain.generate(msgs, max_new_tokens=n, ignore_eos=True)
            ids = list(base.prompt_ids)
            for name, r in (("dspark_edge plain", base),
                            ("dspark_edge dspark fixed", spec.generate(msgs, max_new_tokens=n, ignore_eos=True,
                                                                      draft_tokens=block)),
                            ("dspark_edge dspark scheduler", spec.generate(msgs, max_new_tokens=n, ignore_eos=True))):
                modes[name] = {"tok_s": r.stats.tokens_per_s, "new": r.stats.new_tokens, "drafted": r.stats.draft_n,
                               "accepted": r.stats.draft_n_accepted, "rounds": r.stats.rounds,
                               "same_as_plain": r.token_ids == base.token_ids, "tokens": r.token_ids}
            for name, srv in (("llama.cpp plain", plain_srv), ("llama.cpp dspark", spec_srv)):
                d = srv.complete(ids, n)
                t = d["timings"]
                modes[name] = {"tok_s": t["predicted_per_second"], "new": t["predicted_n"],
                               "drafted": t.get("draft_n", 0), "accepted": t.get("draft_n_accepted", 0),
                               "rounds": t["predicted_n"] - t.get("draft_n_accepted", 0),
                               "tokens": d.get("tokens", [])}
            lp = modes["llama.cpp plain"]["tokens"]
            modes["llama.cpp plain"]["same_as_plain"] = True
            modes["llama.cpp dspark"]["same_as_plain"] = modes["llama.cpp dspark"]["tokens"] == lp
            same_ref = lp == list(base.token_ids)
            for m in modes.values():
                m.pop("tokens")
            rows.append({"id": rec["id"], "modes": modes, "llama_plain_equals_dspark_edge_plain": same_ref})
            say(f"[{i + 1}/{len(prompts)}] {rec['id']}: " + ", ".join(
                f"{k} {v['tok_s']:.1f}" for k, v in modes.items()))
    own_plain = lambda mode: "llama.cpp plain" if mode.startswith("llama.cpp") else "dspark_edge plain"  # noqa: E731
    report = {"engine": str(args.engine), "drafter": str(args.drafter), "block": block, "p_min": args.p_min,
              "max_new_tokens": n, "threads": args.threads, "prompts": len(rows),
              "modes": summarise(rows, own_plain),
              "llama_plain_equals_dspark_edge_plain": sum(r["llama_plain_equals_dspark_edge_plain"] for r in rows),
              "rows": rows}
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
