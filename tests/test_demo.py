"""The on-device demo: plain-line output, the live panel in a real terminal (tmux), --race,
--plot, --trace and --chat. The panel is checked for its fields, the plot for its series."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dspark_edge.metrics import read_trace
from dspark_edge.plots import plot_metadata

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "examples" / "on_device_demo.py"
PANEL_FIELDS = ("variant", "target fp32", "verify width", "confidence", "accepted", "tok/s", "memory", "MiB free",
                "RSS", "CPU load", "temperature", "throttl", "scheduler", "device & decoder")


def demo(*args, stdin=None, timeout=300):
    return subprocess.run([sys.executable, str(DEMO), *args], cwd=REPO, capture_output=True, text=True,
                          input=stdin, timeout=timeout)


def test_plain_output_trace_and_plot(tiny_engine, tiny_draft_poor, tmp_path):
    trace, plot = tmp_path / "t.jsonl", tmp_path / "t.png"
    p = demo("--engine", str(tiny_engine), "--precision", "fp32", "--drafter", str(tiny_draft_poor),
             "--max-new-tokens", "24", "--trace", str(trace), "--plot", str(plot))
    assert p.returncode == 0, p.stderr
    for field in ("variant", "confidence", "accepted", "speed", "memory", "CPU load", "temperature", "scheduler"):
        assert f"{field}:" in p.stdout, field
    assert "tok/s" in p.stderr and "[plot:" in p.stderr
    rounds = [r for r in read_trace(trace) if r["type"] == "round"]
    assert rounds and plot_metadata(plot)["rounds"] == len(rounds)
    assert {"width", "accepted", "acceptance", "tok/s", "cpu %", "free memory MiB"} <= \
        set(plot_metadata(plot)["series"])


def test_race_reports_speedup_and_identical_tokens(tiny_engine, tiny_draft_poor):
    p = demo("--engine", str(tiny_engine), "--drafter", str(tiny_draft_poor), "--max-new-tokens", "20", "--race")
    assert p.returncode == 0, p.stderr
    assert "--- plain" in p.stdout and "--- speculative" in p.stdout
    assert "speedup" in p.stdout and "identical tokens" in p.stdout  # FP32 greedy: lossless
    assert "target fp32" in p.stdout  # the race defaults to FP32
    q = demo("--engine", str(tiny_engine), "--drafter", str(tiny_draft_poor), "--max-new-tokens", "20", "--race",
             "--temperature", "0.8", "--seed", "3", "--sampling", "coupled")
    assert q.returncode == 0, q.stderr
    assert "identical tokens" in q.stdout  # sampled, yet the same answer: it depends on the seed alone


def test_default_drafters_follow_the_engine(tiny_engine):
    # A CPU race with an INT8 graph and no DSpark drafter: n-gram lookup and the INT8 copy draft.
    p = demo("--engine", str(tiny_engine), "--max-new-tokens", "16", "--race")
    assert p.returncode == 0, p.stderr
    assert "drafter ngram+self:int8" in p.stdout and "target fp32" in p.stdout and "identical tokens" in p.stdout
    # Asked for an INT8 target, the race keeps the n-gram drafter (self-drafting needs a more precise target).
    q = demo("--engine", str(tiny_engine), "--max-new-tokens", "8", "--race", "--precision", "int8")
    assert q.returncode == 0, q.stderr
    assert "drafter ngram " in q.stdout or "drafter ngram\n" in q.stdout, q.stdout
    # Self-drafting without --precision runs the FP32 target, not the INT8 default.
    r = demo("--engine", str(tiny_engine), "--max-new-tokens", "8", "--drafter", "self")
    assert r.returncode == 0, r.stderr
    assert "target fp32" in r.stdout and "drafter self:int8" in r.stdout
    # Without --race the defaults are the command line's: the most precise target, drafter auto.
    t = demo("--engine", str(tiny_engine), "--max-new-tokens", "8")
    assert t.returncode == 0, t.stderr
    assert "target fp32" in t.stdout and "drafter ngram+self:int8" in t.stdout


def test_chat_reads_turns_from_stdin(tiny_engine):
    p = demo("--engine", str(tiny_engine), "--chat", "--max-new-tokens", "6", stdin="hello\nand again\n\n")
    assert p.returncode == 0, p.stderr
    assert p.stderr.count("[speculative: 6 tokens") == 2  # one final line per answer


def test_chat_drops_the_oldest_exchanges_when_the_context_fills(tiny_engine):
    line = "the quick brown fox jumps over the lazy dog " * 12
    p = demo("--engine", str(tiny_engine), "--chat", "--max-new-tokens", "4", stdin=(line + "\n") * 8 + "\n")
    assert p.returncode == 0, p.stderr
    assert "oldest exchange" in p.stderr and p.stderr.count("[speculative: 4 tokens") == 8


def test_bad_engine_is_a_clear_error(tmp_path):
    p = demo("--engine", str(tmp_path / "nope"))
    assert p.returncode == 2 and "error:" in p.stderr and "Traceback" not in p.stderr
    p = demo("--engine", str(tmp_path / "nope"), "--race", "--drafter", "none")
    assert p.returncode == 2
    p = demo("--plot", str(tmp_path / "no" / "t.png"))
    assert p.returncode == 2 and "does not exist" in p.stderr and "Traceback" not in p.stderr


def _tmux_capture(cmd: str, tmp_path: Path, timeout: float = 240) -> str:
    """Run ``cmd`` in a detached 150x45 tmux session; the pane text (with escapes) once it exits."""
    sock = str(tmp_path / "tmux.sock")
    done = tmp_path / "done"
    subprocess.run(["tmux", "-S", sock, "new-session", "-d", "-x", "150", "-y", "45",
                    f"{cmd}; echo $? > {done}; sleep 600"], check=True, cwd=REPO)
    try:
        t0 = time.monotonic()
        while not done.exists():
            if time.monotonic() - t0 > timeout:
                pytest.fail("the demo did not finish in tmux: " + subprocess.run(
                    ["tmux", "-S", sock, "capture-pane", "-p"], capture_output=True, text=True).stdout)
            time.sleep(0.5)
        assert done.read_text().strip() == "0"
        return subprocess.run(["tmux", "-S", sock, "capture-pane", "-p", "-e", "-S", "-200"], capture_output=True,
                              text=True, check=True).stdout
    finally:
        subprocess.run(["tmux", "-S", sock, "kill-server"], capture_output=True)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_live_panel_in_a_terminal(tiny_engine, tiny_draft_self, tmp_path):
    # a draft model equal to the target: every draft is accepted, so marked tokens must show
    screen = _tmux_capture(f"{sys.executable} {DEMO} --engine {tiny_engine} --precision fp32 --drafter "
                           f"{tiny_draft_self} --max-new-tokens 40 --race", tmp_path)
    (tmp_path / "screen.txt").write_text(screen)
    for field in PANEL_FIELDS + ("plain ·", "speculative ·", "speedup", "tokens from accepted drafts"):
        assert field in screen, (field, screen)
    assert "\x1b[4m\x1b[32m" in screen or "\x1b[4;32m" in screen  # underlined green: accepted drafts


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_live_panel_on_the_embedded_default(default_engine, tmp_path):
    plot = tmp_path / "timeline.png"
    screen = _tmux_capture(f"{sys.executable} {DEMO} --engine {default_engine} --precision fp32 --max-new-tokens 48 "
                           f"--plot {plot}", tmp_path)
    for field in PANEL_FIELDS + ("SmolLM2-135M-Instruct",):
        assert field in screen, (field, screen)
    assert {"width", "tok/s", "free memory MiB"} <= set(plot_metadata(plot)["series"])


def test_the_demo_races_the_exact_modes_once_and_decodes_in_the_fastest(tiny_engine, tmp_path):
    """An engine with two precisions whose output is the model's own: the demo races them first
    (in a process of its own, kept in the profile), decodes in the fastest, and says why; a
    second start finds the race in the profile."""
    import json
    import os

    engine = tmp_path / "engine"
    shutil.copytree(tiny_engine, engine)
    shutil.copytree(engine / "target" / "fp32", engine / "target" / "int4")
    data = json.loads((engine / "manifest.json").read_text())
    data["variants"] += [{**v, "precision": "int4", "file": v["file"].replace("/fp32/", "/int4/")}
                         for v in data["variants"] if v["role"] == "target" and v["precision"] == "fp32"]
    data["files"] += [{**f, "path": f["path"].replace("target/fp32/", "target/int4/")} for f in data["files"]
                      if f["path"].startswith("target/fp32/")]
    data["exporter"]["int4_output"] = "fp32"
    (engine / "manifest.json").write_text(json.dumps(data))
    env = {**os.environ, "DSPARK_PROFILES": str(tmp_path / "profiles")}
    run = lambda: subprocess.run([sys.executable, str(DEMO), "--engine", str(engine), "--max-new-tokens", "8"],  # noqa: E731
                                 cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    p = run()
    assert p.returncode == 0, p.stderr
    assert "[demo] racing the exact decoding modes" in p.stderr and "[profile] wrote" in p.stderr
    assert "mode: the fastest exact mode raced on this device" in p.stdout
    q = run()
    assert q.returncode == 0, q.stderr
    assert "racing" not in q.stderr and "mode: the fastest exact mode raced on this device" in q.stdout
