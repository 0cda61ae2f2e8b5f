"""The corpus n-gram table shipped for the embedded default (``drafters/smollm2-135m-ngram.npz``):
it is small and documented, installs into the default engine (tokenizer checked), keeps greedy
output exact, and makes the n-gram drafter accepted more often than prompt lookup alone."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import dspark_edge
from dspark_edge.drafters.ngram_table import FILE_NAME, NgramTable

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
TABLE = REPO / "drafters" / "smollm2-135m-ngram.npz"


@pytest.fixture(scope="module")
def engine(default_engine, tmp_path_factory):
    """The default engine's files hard-linked (copied across file systems) into a folder of
    its own, with the table installed there (the shared default engine stays without one).
    Not symlinked: the runtime reads no file that resolves outside its engine folder."""
    from dspark_export.__main__ import main

    out = tmp_path_factory.mktemp("default-with-table") / "engine"
    out.mkdir()
    for item in default_engine.resolve().rglob("*"):
        rel = item.relative_to(default_engine.resolve())
        if item.name == FILE_NAME or item.is_dir():
            continue
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(item, out / rel)
        except OSError:
            shutil.copy2(item, out / rel)
    assert main(["ngram-table", "--target", str(out), "--from", str(TABLE)]) == 0
    return out


def test_shipped_table_is_small_and_documented(default_engine):
    assert TABLE.stat().st_size <= 5 * 2**20
    m = dspark_edge.read_manifest(default_engine)
    table = NgramTable.load_for(TABLE, m)
    assert table.meta["source_sha256"] == m.model.source_sha256
    assert "ngram-table" in table.meta["command"] and table.meta["answers"] >= 400
    assert table.entries == sum(table.meta["entries"].values()) > 10_000
    # it carries a confidence model the drafter uses, better than a constant on held-out drafts
    from dspark_edge.drafters import NgramDrafter
    from dspark_edge.drafters.ngram import FEATURES

    cal = table.calibration
    assert cal is not None and cal["features"] == list(FEATURES) and cal["judged_drafts"] >= 5000
    assert cal["two_fold"]["log_loss"] < cal["constant"]["log_loss"] - 0.1 and cal["two_fold"]["ece"] < 0.05
    assert NgramDrafter(table=table).weights is not None


def test_table_drafts_keep_greedy_exact_and_are_accepted_more(engine):
    prompts = [json.loads(line) for line in (REPO / "dspark_edge" / "data" / "prompts.jsonl").read_text().splitlines()]
    picked = [p["messages"] for p in prompts if p["id"] in ("chat-1", "story-1", "code-1")]
    plain = dspark_edge.load(engine, "fp32")
    with_table = dspark_edge.load(engine, "fp32", drafter="ngram", scheduler=False)
    prompt_only = dspark_edge.load(engine, "fp32", drafter="ngram:prompt", scheduler=False)
    scheduled = dspark_edge.load(engine, "fp32", drafter="ngram")  # calibrated confidences, scheduler on
    assert with_table.drafter.name == "ngram+table" and prompt_only.drafter.table is None
    accepted = {"table": 0, "prompt": 0}
    for messages in picked:
        want = plain.generate(messages, max_new_tokens=48, ignore_eos=True).token_ids
        for name, pipe in (("table", with_table), ("prompt", prompt_only)):
            r = pipe.generate(messages, max_new_tokens=48, ignore_eos=True, draft_tokens=3)
            assert r.token_ids == want, name
            accepted[name] += r.stats.draft_n_accepted
        assert scheduled.generate(messages, max_new_tokens=48, ignore_eos=True).token_ids == want
    assert accepted["table"] > accepted["prompt"], accepted
    assert np.isfinite(with_table.drafter.table.shares[2]).all()


CAMPAIGN_ANSWERS = REPO / "runs" / "answers-all11.npz"


def test_shipped_table_is_counted_again_from_the_campaign_answers(default_engine, tmp_path):
    """The table is counted from the drafter campaign's 71,383 answers (``runs/answers-all11.npz``,
    which ``scripts/campaign_answers.sh`` rebuilds from the answer folders committed under
    drafters/, about six minutes where it is missing): counted again with the options its
    metadata records, every array is the same, and so is its confidence model."""
    from dspark_export.ngram_table import build_table

    m = dspark_edge.read_manifest(default_engine)
    shipped = NgramTable.load_for(TABLE, m)
    assert "--answers runs/answers-all11.npz" in shipped.meta["command"] and shipped.meta["answers"] == 71_383
    assert f"--min-count {shipped.meta['min_count']}" in shipped.meta["command"]
    if not CAMPAIGN_ANSWERS.is_file():
        subprocess.run(["bash", str(REPO / "scripts" / "campaign_answers.sh"), str(default_engine)], cwd=REPO,
                       check=True, timeout=3600)
    again = NgramTable.load(build_table(default_engine, None, output=tmp_path / "again.npz", progress=lambda s: None,
                                        answers=CAMPAIGN_ANSWERS, min_count=shipped.meta["min_count"]))
    assert again.meta["answers"] == shipped.meta["answers"] and again.meta["answer_tokens"] == shipped.meta["answer_tokens"]
    for n in shipped.lengths:
        assert np.array_equal(again.keys[n], shipped.keys[n]) and np.array_equal(again.nexts[n], shipped.nexts[n])
        assert np.array_equal(again.shares[n], shipped.shares[n]) and np.array_equal(again.counts[n], shipped.counts[n])
    # the fit's sums over 1.3 million judged drafts may round apart in the last bits on another CPU
    assert np.allclose(again.calibration["weights"], shipped.calibration["weights"], atol=1e-4)
