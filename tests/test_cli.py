"""Command lines: python -m dspark_edge (generate / bench / inspect) and their exit codes."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "dspark_edge", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600)


def test_generate_json(tiny_engine):
    p = run("generate", "--engine", str(tiny_engine), "--raw", "The quick", "--max-new-tokens", "6", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert len(out["token_ids"]) <= 6 and out["stop_reason"] in ("eos", "max_new_tokens")
    assert out["stats"]["new_tokens"] == len(out["token_ids"])


def test_generate_json_with_logprobs(tiny_engine):
    p = run("generate", "--engine", str(tiny_engine), "--raw", "The quick", "--max-new-tokens", "6", "--json",
            "--logprobs", "2", "--drafter", "none")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert [e["token_id"] for e in out["logprobs"]] == out["token_ids"]
    for e in out["logprobs"]:
        assert len(e["top"]) == 2 and e["top"][0]["token_id"] == e["token_id"]  # greedy: the likeliest
        assert e["logprob"] <= 0 and isinstance(e["token"], str)
    p = run("generate", "--engine", str(tiny_engine), "hi", "--logprobs", "2")
    assert p.returncode == 2 and "--logprobs needs --json" in p.stderr and "[load]" not in p.stderr
    p = run("generate", "--engine", str(tiny_engine), "hi", "--logit-bias", "abc")
    assert p.returncode == 2 and "expected ID=BIAS" in p.stderr
    p = run("generate", "--engine", str(tiny_engine), "hi", "--logit-bias", "5=1", "--logit-bias", "5=2")
    assert p.returncode == 2 and "names token 5 twice" in p.stderr
    p = run("generate", "--engine", str(tiny_engine), "--raw", "The quick", "--max-new-tokens", "6", "--json",
            "--frequency-penalty", "1.5", "--logit-bias", "7=3", "--drafter", "none")
    assert p.returncode == 0, p.stderr
    import dspark_edge
    with dspark_edge.load(tiny_engine, drafter="none") as pipe:
        want = pipe.generate("The quick", max_new_tokens=6, frequency_penalty=1.5, logit_bias={7: 3.0})
    assert json.loads(p.stdout)["token_ids"] == list(want.token_ids)


def test_generate_with_structured_output(tiny_engine, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                  "additionalProperties": False}))
    p = run("generate", "--engine", str(tiny_engine), "The quick", "--json-schema", str(schema), "--json",
            "--max-new-tokens", "200")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert isinstance(json.loads(out["text"])["ok"], bool) and out["stop_reason"] == "eos"
    gbnf = tmp_path / "answer.gbnf"
    gbnf.write_text('root ::= "on" | "off"\n')
    for flags in (["--regex", "(on|off)"], ["--grammar", str(gbnf)]):
        p = run("generate", "--engine", str(tiny_engine), "The quick", "--json", *flags)
        assert p.returncode == 0 and json.loads(p.stdout)["text"] in ("on", "off"), p.stderr
    p = run("generate", "--engine", str(tiny_engine), "hi", "--regex", "(on")
    assert p.returncode == 2 and "invalid regex grammar" in p.stderr and "Traceback" not in p.stderr
    p = run("generate", "--engine", str(tiny_engine), "hi", "--json-schema", str(tmp_path / "missing.json"))
    assert p.returncode == 2 and "--json-schema" in p.stderr and "cannot read" in p.stderr
    p = run("generate", "--engine", str(tiny_engine), "hi", "--json-object", "--regex", "a")
    assert p.returncode == 2 and "not allowed with" in p.stderr


def test_generate_streams_text_and_reports(tiny_engine):
    p = run("generate", "--engine", str(tiny_engine), "hello", "--max-new-tokens", "5")
    assert p.returncode == 0 and "tok/s" in p.stderr


def test_bad_input_exits_2_with_a_clear_message(tiny_engine, tmp_path):
    p = run("generate", "--engine", str(tmp_path / "missing"), "hi")
    assert p.returncode == 2 and "does not exist" in p.stderr and "Traceback" not in p.stderr
    p = run("generate", "--engine", str(tiny_engine), "hi", "--temperature", "-1")
    assert p.returncode == 2 and "temperature" in p.stderr
    p = run("generate", "--engine", str(tiny_engine), "hi", "--providers", "CUDAExecutionProvider")
    assert p.returncode == 2 and "not available in this onnxruntime build" in p.stderr
    p = run("generate", "--engine", str(tiny_engine), "hi", "--max-new-tokens", "2",
            "--providers", "CUDAExecutionProvider", "--fallback-to-cpu")
    assert p.returncode == 0, p.stderr


def test_inspect(tiny_engine):
    p = run("inspect", "--engine", str(tiny_engine), "--verify-hashes")
    assert p.returncode == 0, p.stderr
    assert "widths [1, 2, 3, 4]" in p.stdout and "sha256 verified" in p.stdout and "passed" in p.stdout
    assert "the rule's drafter: ngram+self for the fp32 target, ngram for the int8 target" in p.stdout
    assert "--precision auto --drafter auto: target fp32, drafter ngram+self" in p.stdout
    j = run("inspect", "--engine", str(tiny_engine), "--json")
    assert json.loads(j.stdout)["schema_version"] == 1
    assert json.loads(j.stdout)["auto_drafter"] == {"fp32": "ngram+self", "int8": "ngram"}
    assert json.loads(j.stdout)["faithful_precisions"] == ["fp32"]
    assert json.loads(j.stdout)["auto_mode"]["precision"] == "fp32"


def test_inspect_names_the_device_key_when_no_profile_matches(tiny_engine, tmp_path, monkeypatch):
    from dspark_edge.profile import device_identity

    monkeypatch.setenv("DSPARK_PROFILES", str(tmp_path))  # an empty profiles folder
    p = run("inspect", "--engine", str(tiny_engine))
    assert p.returncode == 0, p.stderr
    assert f"profile    missing for this device ({device_identity()[0]})" in p.stdout


def test_bench_prints_measurements(tiny_engine):
    p = run("bench", "--engine", str(tiny_engine), "--limit", "2", "--max-new-tokens", "8", "--repeats", "2",
            "--depth", "16")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["generation"]["prompts"] == 2 and out["generation"]["tokens_per_s"] > 0
    assert set(out["verify_cost"]["median_ms"]) == {"1", "2", "3", "4"}
    c = run("bench", "--engine", str(tiny_engine), "--limit", "1", "--max-new-tokens", "8", "--repeats", "2",
            "--depth", "16", "--drafter", "ngram", "--draft-tokens", "1,3")
    assert c.returncode == 0, c.stderr
    variants = json.loads(c.stdout)["comparison"]["variants"]
    assert set(variants) == {"plain", "ngram auto", "ngram k=1", "ngram k=3"}
    assert variants["ngram k=3"]["exact_prompts"] == "1/1"


def test_bench_passes_shuffle_variants_and_give_intervals(tiny_engine):
    c = run("bench", "--engine", str(tiny_engine), "--limit", "2", "--max-new-tokens", "8", "--repeats", "2",
            "--depth", "16", "--drafter", "ngram", "--draft-tokens", "1,3", "--passes", "2")
    assert c.returncode == 0, c.stderr
    comp = json.loads(c.stdout)["comparison"]
    assert comp["passes"] == 2
    assert all(v["exact_prompts"] == "4/4" for v in comp["variants"].values())
    vs = comp["paired"]["ngram auto vs best fixed"]
    assert vs["best_fixed"] in ("plain", "ngram k=1", "ngram k=3")  # plain is width 1
    lo, hi = vs["overall"]["ci95"]
    assert lo <= vs["overall"]["ratio"] <= hi
    assert "ngram auto vs best fixed" in c.stderr  # the ratios, readable, beside the JSON
    bad = run("bench", "--engine", str(tiny_engine), "--limit", "1", "--passes", "2")
    assert bad.returncode == 2 and "--drafter" in bad.stderr


def test_bench_samples_with_one_seed_per_prompt(tiny_engine):
    """--temperature: sampled decoding, every variant of a prompt with the same seed; with coupled
    sampling the answers depend on the seed alone, so speculative ones are checked against plain."""
    common = ("bench", "--engine", str(tiny_engine), "--limit", "2", "--max-new-tokens", "8", "--repeats", "2",
              "--depth", "16", "--drafter", "ngram:prompt", "--draft-tokens", "2", "--temperature", "0.8",
              "--top-p", "0.9")
    c = run(*common, "--sampling", "coupled", "--seed", "5")
    assert c.returncode == 0, c.stderr
    comp = json.loads(c.stdout)["comparison"]
    assert comp["decoding"] == {"temperature": 0.8, "top_k": 0, "top_p": 0.9, "sampling": "coupled", "seed": 5}
    assert all(v["exact_prompts"] == "2/2" for v in comp["variants"].values())
    c = run(*common)
    assert c.returncode == 0, c.stderr
    comp = json.loads(c.stdout)["comparison"]
    assert comp["decoding"]["sampling"] == "rejection"
    assert all(v["exact_prompts"] is None for v in comp["variants"].values())  # other draws by design
    bad = run("bench", "--engine", str(tiny_engine), "--limit", "1", "--top-p", "0.9")
    assert bad.returncode == 2 and "--temperature" in bad.stderr
    bad = run("bench", "--engine", str(tiny_engine), "--limit", "1", "--temperature", "0.8", "--top-p", "1.5")
    assert bad.returncode == 2 and "top_p" in bad.stderr


def test_bench_compares_several_drafters_in_one_run(tiny_engine, tiny_draft_self):
    c = run("bench", "--engine", str(tiny_engine), "--limit", "1", "--max-new-tokens", "8", "--repeats", "2",
            "--depth", "16", "--drafter", f"ngram:prompt,{tiny_draft_self}", "--draft-tokens", "2")
    assert c.returncode == 0, c.stderr
    variants = json.loads(c.stdout)["comparison"]["variants"]
    assert list(variants) == ["plain", "ngram:prompt auto", "ngram:prompt k=2", f"{tiny_draft_self} auto",
                              f"{tiny_draft_self} k=2"]
    assert all(v["exact_prompts"] == "1/1" for v in variants.values())
    assert variants[f"{tiny_draft_self} k=2"]["acceptance"] > 0.9  # the target's own weights: a real second drafter
    bad = run("bench", "--engine", str(tiny_engine), "--limit", "1", "--drafter", "ngram,ngram")
    assert bad.returncode == 2 and "twice" in bad.stderr
    auto = run("bench", "--engine", str(tiny_engine), "--limit", "1", "--max-new-tokens", "8", "--repeats", "2",
               "--depth", "16", "--drafter", "auto,ngram", "--draft-tokens", "2")
    assert auto.returncode == 0, auto.stderr  # 'auto' is the FP32 target's ngram+self on this CPU
    assert list(json.loads(auto.stdout)["comparison"]["variants"]) == [
        "plain", "ngram+self auto", "ngram+self k=2", "ngram auto", "ngram k=2"]
    twice = run("bench", "--engine", str(tiny_engine), "--limit", "1", "--drafter", "auto,ngram+self")
    assert twice.returncode == 2 and "twice once 'auto' is resolved" in twice.stderr


def test_readme_embedding_example_runs(tiny_engine):
    """The README's first Python example, run against the tiny engine."""
    text = (REPO / "README.md").read_text()
    code = re.findall(r"```python\n(.*?)```", text, re.S)[0]
    code = code.replace('"engines/smollm2-135m"', repr(str(tiny_engine)))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stderr
    assert "tok/s" in p.stdout


def test_chat_keeps_history_and_commands(tiny_engine):
    p = subprocess.run([sys.executable, "-m", "dspark_edge", "chat", "--engine", str(tiny_engine), "--max-new-tokens",
                        "5", "--json"], input="hello\n/stats\n/reset\nagain\n\n", cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    answers = [json.loads(line) for line in p.stdout.splitlines() if line.strip()]
    assert len(answers) == 2 and all(a["stats"]["new_tokens"] <= 5 for a in answers)
    # "hello" and "again" are one token each; after /reset the second prompt holds one user turn too
    assert answers[0]["stats"]["prompt_tokens"] == answers[1]["stats"]["prompt_tokens"]
    assert '"prompt_tokens"' in p.stderr and "[history cleared]" in p.stderr


def test_chat_turns_start_from_the_conversations_kv(tiny_engine):
    """Each turn prefills only what it does not share with the conversation so far."""
    def turns(*flags):
        p = subprocess.run([sys.executable, "-m", "dspark_edge", "chat", "--engine", str(tiny_engine),
                            "--max-new-tokens", "5", "--json", *flags], input="hello\nagain\n\n", cwd=REPO,
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        return [json.loads(line) for line in p.stdout.splitlines() if line.strip()]

    first, second = turns()
    assert first["stats"]["prompt_reused"] == 0 and second["stats"]["prompt_reused"] >= first["stats"]["prompt_tokens"]
    assert [a["stats"]["prompt_reused"] for a in turns("--no-prompt-cache")] == [0, 0]


def test_chat_interrupted_exits_130(tiny_engine):
    import os
    import pty
    import select
    import signal
    import time

    # A terminal on stdin makes chat interactive: it prints its banner once loaded and waits in
    # input(), where Ctrl-C must end it with 130 however long loading took.
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "dspark_edge", "chat", "--engine", str(tiny_engine)], cwd=REPO,
                            stdin=slave, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # a test runner started in the background inherits SIGINT ignored
                            # (POSIX, for asynchronous commands): give chat the default, as a terminal does
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    os.close(slave)
    try:
        # Read the raw descriptor: a buffered readline may take several lines at once, after
        # which select() would not report the ones already buffered.
        deadline, seen, fd = time.monotonic() + 240, "", proc.stderr.fileno()
        while "[chat with" not in seen and time.monotonic() < deadline and proc.poll() is None:
            ready, _, _ = select.select([fd], [], [], 1.0)
            if ready:
                seen += os.read(fd, 65536).decode(errors="replace")
        assert "[chat with" in seen, seen
        time.sleep(0.5)  # from the banner to input()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err


def test_generate_writes_trace_metrics_and_plot(tiny_engine, tmp_path):
    from dspark_edge.metrics import read_trace
    from dspark_edge.plots import plot_metadata

    trace, prom, png = tmp_path / "t.jsonl", tmp_path / "m.prom", tmp_path / "t.png"
    p = run("generate", "--engine", str(tiny_engine), "--raw", "a b a b a b a b", "--drafter", "ngram",
            "--max-new-tokens", "16", "--trace", str(trace), "--prometheus", str(prom), "--plot", str(png), "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    recs = read_trace(trace)
    rounds = [r for r in recs if r["type"] == "round"]
    assert len(rounds) == out["stats"]["rounds"] and recs[-1]["type"] == "summary"
    text = prom.read_text()
    assert f"dspark_edge_draft_n_total {float(out['stats']['draft_n'])}" in text
    assert f"dspark_edge_generation_tokens_total {float(out['stats']['new_tokens'])}" in text
    meta = plot_metadata(png)
    assert meta["rounds"] == len(rounds)
    assert meta["title"] == "hf · target fp32 · drafter ngram"  # what was decoded, not just "timeline"
    assert "other processes' cpu %" in meta["series"]
    q = run("plot", str(trace), str(tmp_path / "again.png"), "--json")
    assert q.returncode == 0, q.stderr
    assert json.loads(q.stdout)["rounds"] == len(rounds)
    bad = run("plot", str(trace), str(tmp_path / "x.png"), "--generation", "5")
    assert bad.returncode == 2 and "holds answers 0..0" in bad.stderr
    missing = run("plot", str(tmp_path / "none.jsonl"), str(tmp_path / "x.png"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr and "Traceback" not in missing.stderr
    nodir = run("generate", "--engine", str(tiny_engine), "hi", "--prometheus", str(tmp_path / "no" / "m.prom"))
    assert nodir.returncode == 2 and "does not exist" in nodir.stderr and "Traceback" not in nodir.stderr


def test_every_option_is_explained():
    from dspark_edge.cli import build_parser

    parser = build_parser()
    subs = next(a for a in parser._actions if a.dest == "command").choices
    assert set(subs) == {"generate", "chat", "serve", "bench", "profile", "inspect", "plot"}
    for name, sub in subs.items():
        for action in sub._actions:
            if action.dest != "help":
                assert action.help, f"{name} {action.option_strings or action.dest} has no --help text"
    top = run("--help")
    assert "Exit codes" in top.stdout and "130" in top.stdout


def test_inspect_lists_files_and_hashes(tiny_engine):
    from dspark_edge.manifest import read_manifest

    p = run("inspect", "--engine", str(tiny_engine))
    m = read_manifest(tiny_engine)
    for f in m.files:
        assert f"{f.sha256[:16]}" in p.stdout and f.path in p.stdout
    j = json.loads(run("inspect", "--engine", str(tiny_engine), "--json").stdout)
    assert j["profile"]["status"] in ("ok", "stale", "throttled", "missing") and "psutil" in j["telemetry_sources"]


def test_docs_drafter_example_runs(tiny_engine):
    """docs/drafters.md's example drafter, on the tiny engine: it loads, drafts, stays exact."""
    text = (REPO / "docs" / "drafters.md").read_text()
    code = next(c for c in re.findall(r"```python\n(.*?)```", text, re.S) if "BaseDrafter" in c)
    code = code.replace('"engines/smollm2-135m"', repr(str(tiny_engine))) + (
        "\nr = pipe.generate('The quick brown', max_new_tokens=12, draft_tokens=2)\n"
        "ref = dspark_edge.load(" + repr(str(tiny_engine)) + ", 'fp32').generate('The quick brown', max_new_tokens=12)\n"
        "assert r.token_ids == ref.token_ids and r.stats.draft_n > 0 and r.stats.drafter == 'repeat-last'\n"
        "print('ok')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "ok"


def test_docs_structured_output_example_runs(tiny_engine):
    """docs/library.md's structured-output example, on the tiny engine: the answer parses as the schema's JSON."""
    text = (REPO / "docs" / "library.md").read_text()
    code = next(c for c in re.findall(r"```python\n(.*?)```", text, re.S) if "Grammar.json" in c)
    # (room for the whitespace the random tiny model puts wherever the grammar allows it)
    code = code.replace('"engines/smollm2-135m"', repr(str(tiny_engine))).replace("max_new_tokens=64",
                                                                               "max_new_tokens=400")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stderr
    value = ast.literal_eval(p.stdout.strip())  # the printed dict
    assert set(value) == {"city", "population"} and 0 <= value["population"] <= 100000000


def test_readme_metrics_example_runs(tiny_engine):
    """docs/library.md's metrics example, on a pipeline over the tiny engine (server on a free port)."""
    text = (REPO / "docs" / "library.md").read_text()
    code = next(c for c in re.findall(r"```python\n(.*?)```", text, re.S) if "PrometheusMetrics()" in c)
    code = (f"import dspark_edge\nspec = dspark_edge.load({str(tiny_engine)!r}, drafter='ngram')\n"
            + code.replace("start_http_server(9100", "start_http_server(0").replace('"rounds.jsonl"', '"/dev/null"')
            + "\nspec.generate('a b a b a b', max_new_tokens=8, draft_tokens=2)\n"
              "print(prom.registry.get_sample_value('dspark_edge_generation_tokens_total'), "
              "prom.registry.get_sample_value('dspark_edge_draft_n_total'))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stderr
    tokens, draft_n = p.stdout.split()[-2:]
    assert float(tokens) == 8 and float(draft_n) >= 0


def test_prompt_sources_verbose_anywhere_and_a_template_override(tiny_engine, tmp_path):
    e = ["generate", "--engine", str(tiny_engine), "--raw", "--max-new-tokens", "3", "--json"]
    ref = json.loads(run(*e, "The quick brown").stdout)
    p = subprocess.run([sys.executable, "-m", "dspark_edge", *e, "-"], input="The quick brown", cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["token_ids"] == ref["token_ids"]  # '-' reads the prompt from stdin
    (tmp_path / "p.txt").write_text("The quick brown")
    assert json.loads(run(*e, "-f", str(tmp_path / "p.txt")).stdout)["token_ids"] == ref["token_ids"]
    p = run(*e, "-f", str(tmp_path / "p.txt"), "also an argument")
    assert p.returncode == 2 and "not both" in p.stderr
    p = run(*e, "-v", "The quick brown")  # -v after the command
    assert p.returncode == 0 and "INFO" in p.stderr and "[load] ready" in p.stderr
    (tmp_path / "t.jinja").write_text("{% for m in messages %}<<{{ m.content }}>>{% endfor %}")
    chat = ["generate", "--engine", str(tiny_engine), "--max-new-tokens", "2", "--json", "hello"]
    own = json.loads(run(*chat).stdout)["stats"]["prompt_tokens"]
    other = json.loads(run(*chat, "--chat-template", str(tmp_path / "t.jinja")).stdout)["stats"]["prompt_tokens"]
    assert own != other
    p = run(*chat, "--chat-template", str(tmp_path / "none.jinja"))
    assert p.returncode == 2 and "does not exist" in p.stderr


def test_cli_errors_name_flags_not_library_parameters(tiny_engine):
    p = run("generate", "--engine", str(tiny_engine), "--raw", "word " * 600, "--max-new-tokens", "2")
    assert p.returncode == 2 and "--context-policy truncate" in p.stderr and "context_policy" not in p.stderr
    p = run("generate", "--engine", str(tiny_engine), "--raw", "hi", "--draft-tokens", "4", "--drafter", "ngram")
    assert p.returncode == 2 and "--draft-tokens 4" in p.stderr and "draft_tokens=" not in p.stderr
    p = run("generate", "--engine", str(tiny_engine), "hi", "--drafter", "banana")
    assert p.returncode == 2 and "auto" in p.stderr


def test_a_reader_that_goes_away_ends_the_command_quietly(tiny_engine):
    proc = subprocess.Popen([sys.executable, "-m", "dspark_edge", "inspect", "--engine", str(tiny_engine)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0)
    proc.stdout.read(10)
    proc.stdout.close()  # as `| head -1` does
    _, err = proc.communicate(timeout=120)
    assert b"Traceback" not in err and proc.returncode in (0, 141)
