"""Hostile and careless use of the command lines: every failure one line and exit 2, options
checked before the work they would spoil, output that is not lost (docs/RELIABILITY.md)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def run(*args, stdin=None, env=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "dspark_edge", *args], cwd=REPO, capture_output=True,
                          input=stdin, timeout=timeout, env={**os.environ, **(env or {})})


def clean_error(p) -> str:
    err = p.stderr.decode(errors="replace")
    assert p.returncode == 2, (p.returncode, err)
    assert "Traceback" not in err and err.count("error:") == 1, err
    return err


def test_output_paths_are_checked_before_loading(tiny_engine, tmp_path):
    e = ["generate", "--engine", str(tiny_engine), "hi", "--max-new-tokens", "2"]
    for option in ("--trace", "--prometheus", "--plot"):
        err = clean_error(run(*e, option, str(tmp_path)))  # a folder, not a file
        assert "is a folder" in err and option in err
        err = clean_error(run(*e, option, str(tmp_path / "missing" / "out")))
        assert "does not exist" in err
    err = clean_error(run("plot", str(tmp_path / "none.jsonl"), str(tmp_path / "t.png")))
    assert "does not exist" in err
    err = clean_error(run("plot", str(tmp_path / "none.jsonl"), str(tmp_path)))
    assert "is a folder" in err  # the output is checked before the trace is read


def test_an_unwritable_output_is_a_clean_error(tiny_engine, tmp_path):
    # /proc is read-only for everyone, root included.
    err = clean_error(run("generate", "--engine", str(tiny_engine), "hi", "--max-new-tokens", "2",
                          "--trace", "/proc/dspark-trace.jsonl"))
    assert "not writable" in err or "writing failed" in err
    err = clean_error(run("profile", "--engine", str(tiny_engine), "--output-dir", "/proc/dspark-profiles"))
    assert "profile folder" in err and "[profile] target" not in err  # refused before measuring
    err = clean_error(run("profile", "--engine", str(tiny_engine), "--contexts", "64,600"))
    assert "context depths [600]" in err and "[profile] target" not in err


def test_a_full_disk_when_a_trace_opens_is_an_output_error():
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full")
    # /dev/full is what a full disk looks like to a writer.
    from dspark_edge.errors import OutputError
    from dspark_edge.metrics import TraceWriter

    with pytest.raises(OutputError, match="writing failed"):
        TraceWriter("/dev/full")


def test_a_trace_write_failing_mid_answer_ends_with_exit_2_after_the_answer(tiny_engine, capsys):
    import argparse
    import errno
    import io

    import dspark_edge
    from dspark_edge.cli import answer, run_reporting_errors
    from dspark_edge.cli.options import Outputs
    from dspark_edge.config import GenerationConfig
    from dspark_edge.metrics import TraceWriter

    class FillsUp(io.StringIO):  # the header fits; the disk is full from the first round on
        def write(self, text):
            if self.tell() > 0:
                raise OSError(errno.ENOSPC, "No space left on device")
            return super().write(text)

    args = argparse.Namespace(trace=None, prometheus=None, plot=None, command="generate", engine=str(tiny_engine))
    with dspark_edge.load(tiny_engine, "fp32", drafter="ngram") as pipe:
        outputs = Outputs(pipe, args)
        outputs.trace = TraceWriter(FillsUp())
        r = answer(pipe, "The quick brown", GenerationConfig(max_new_tokens=8, ignore_eos=True), False)
        assert r is not None and r.stats.new_tokens == 8  # the answer is not lost
        assert capsys.readouterr().out.strip()
        assert run_reporting_errors(outputs.close) == 2
    assert "trace (stream): writing failed" in capsys.readouterr().err


def test_sched_values_are_checked(tiny_engine):
    e = ["generate", "--engine", str(tiny_engine), "hi", "--max-new-tokens", "2", "--drafter", "ngram"]
    for bad, what in (("max_record=-1", "max_record"), ("hot_c=nan", "hot_c"), ("hot_c=inf", "hot_c"),
                      ("probe_every=2.5", "not a number|integer"), ("nope=1", "KEY one of")):
        err = clean_error(run(*e, "--sched", bad))
        assert any(w in err for w in what.split("|")), err


def test_bench_options_are_checked_before_any_work(tiny_engine):
    b = ["bench", "--engine", str(tiny_engine), "--max-new-tokens", "4"]
    for extra, what in ((["--limit", "0"], "--limit"), (["--repeats", "0"], "--repeats"),
                        (["--depth", "0"], "--depth"), (["--depth", "100000"], "--depth"),
                        (["--drafter", "ngram", "--draft-tokens", "2,abc"], "comma-separated"),
                        (["--drafter", "ngram", "--draft-tokens", "7"], "not among them")):
        t0 = time.monotonic()
        p = run(*b, *extra)
        err = clean_error(p)
        assert what in err, err
        assert "[bench] 1/" not in err  # refused before the first prompt ran
        assert time.monotonic() - t0 < 120


def test_threads_and_context_have_bounds(tiny_engine):
    e = ["generate", "--engine", str(tiny_engine), "hi", "--max-new-tokens", "2"]
    assert "--threads must be between 1 and" in clean_error(run(*e, "--threads", "1000"))
    assert "--max-context must be >= 16" in clean_error(run(*e, "--max-context", "8", "--drafter", "ngram"))


def test_a_broken_ngram_table_is_a_clean_error(engine_copy):
    table = engine_copy / "ngram_table.npz"
    for data in (b"", b"PK\x03\x04 truncated zip"):
        table.write_bytes(data)
        err = clean_error(run("generate", "--engine", str(engine_copy), "hi", "--max-new-tokens", "2",
                              "--drafter", "auto"))
        assert "not a readable n-gram table" in err
        p = run("inspect", "--engine", str(engine_copy))
        assert p.returncode == 0 and b"not a readable n-gram table" in p.stdout


def test_a_broken_chat_template_is_a_clean_error(engine_copy):
    (engine_copy / "chat_template.jinja").unlink()
    assert "missing" in clean_error(run("generate", "--engine", str(engine_copy), "hi", "--max-new-tokens", "2"))


def test_plot_reads_a_trace_cut_mid_line_and_refuses_malformed_records(tiny_engine, tmp_path):
    trace = tmp_path / "t.jsonl"
    p = run("generate", "--engine", str(tiny_engine), "hello", "--max-new-tokens", "8", "--drafter", "ngram",
            "--trace", str(trace))
    assert p.returncode == 0, p.stderr
    lines = trace.read_text().splitlines()
    trace.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][: len(lines[-1]) // 2])  # cut mid-line
    out = tmp_path / "t.png"
    p = run("plot", str(trace), str(out))
    assert p.returncode == 0 and out.is_file(), p.stderr
    assert b"cut short" in p.stderr
    for bad in ({"drafted": "many"}, {"accepted": 99}, {"tokens": None}, {"confidence": ["x"]}, {"telemetry": 3}):
        rounds = [json.loads(line) for line in lines[1:-1] if json.loads(line)["type"] == "round"]
        rounds[0].update(bad)
        trace.write_text("\n".join([lines[0], *map(json.dumps, rounds)]) + "\n")
        assert "round record" in clean_error(run("plot", str(trace), str(out)))


def test_chat_drops_the_oldest_turns_and_refuses_a_bad_line(tiny_engine):
    long_turn = ("The quick brown fox jumps over the lazy dog. " * 6).encode()
    stdin = b"\n".join([long_turn] * 4 + [b"\xff\xfe broken", b"still here", b""])
    p = run("chat", "--engine", str(tiny_engine), "--max-new-tokens", "8", "--max-context", "160", stdin=stdin)
    err = p.stderr.decode()
    assert "Traceback" not in err, err
    assert "not UTF-8" in err and "dropped the" in err
    assert err.count("tok/s, prefill") == 5  # every good line was answered (4 long turns, "still here")
    # A message too long alone is refused, and the chat goes on.
    p = run("chat", "--engine", str(tiny_engine), "--max-new-tokens", "8", "--max-context", "64",
            stdin=long_turn * 3 + b"\nhi\n\n")
    err = p.stderr.decode()
    assert "send a shorter one" in err and "Traceback" not in err and p.returncode == 1


@pytest.mark.parametrize("as_json", [False, True])
@pytest.mark.parametrize("kind", ["terminated", "interrupted"])
def test_sigterm_and_sigint_keep_the_partial_output(tiny_engine, capsys, as_json, kind):
    import dspark_edge
    from dspark_edge import cli
    from dspark_edge.config import GenerationConfig

    exc_type = cli.Terminated if kind == "terminated" else KeyboardInterrupt

    class Stopper:  # the signal arriving mid-generation, after the fifth round
        def on_round(self, info):
            if info.index == 5:
                raise exc_type()

    with dspark_edge.load(tiny_engine, "fp32") as pipe:
        pipe.add_observer(Stopper())
        cfg = GenerationConfig(max_new_tokens=50, ignore_eos=True)
        with pytest.raises(exc_type):
            cli.answer(pipe, "The quick", cfg, as_json)
        out = capsys.readouterr().out
        if as_json:
            rec = json.loads(out)
            assert rec["stop_reason"] == kind and len(rec["token_ids"]) == 5  # the prefill's token and 4 rounds before it
            assert rec["text"] == pipe.tokenizer.decode(rec["token_ids"])
        pipe.remove_observer(pipe.observers[0])
        ref = pipe.generate("The quick", max_new_tokens=5, ignore_eos=True)  # the same five tokens, greedy
        if not as_json:
            assert out == ref.text + "\n"  # streamed pieces and the held-back rest: nothing lost
        # The pipeline stays usable.
        assert pipe.generate("The quick", max_new_tokens=3).stop_reason != "error"
    assert cli.run_reporting_errors(lambda: (_ for _ in ()).throw(exc_type())) == (143 if kind == "terminated" else 130)


def test_sigterm_becomes_terminated_in_the_main_thread():
    from dspark_edge import cli

    old = signal.getsignal(signal.SIGTERM)
    try:
        cli.on_sigterm()
        with pytest.raises(cli.Terminated):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
    finally:
        signal.signal(signal.SIGTERM, old)
