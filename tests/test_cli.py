"""Command lines: python -m dspark_edge (generate / bench / inspect) and their exit codes."""

from __future__ import annotations

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
    j = run("inspect", "--engine", str(tiny_engine), "--json")
    assert json.loads(j.stdout)["schema_version"] == 1


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
    assert set(variants) == {"plain", "plain, own session", "ngram auto", "ngram k=1", "ngram k=3"}
    assert variants["ngram k=3"]["exact_prompts"] == "1/1"


def test_readme_embedding_example_runs(tiny_engine):
    """The README's first Python example, run against the tiny engine."""
    text = (REPO / "README.md").read_text()
    code = re.findall(r"```python\n(.*?)```", text, re.S)[0]
    code = code.replace('"engines/smollm2-135m"', repr(str(tiny_engine)))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stderr
    assert "tok/s" in p.stdout
