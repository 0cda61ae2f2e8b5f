"""The DSpark drafter committed for the embedded default (``drafters/smollm2-135m`` when one is
shipped under that name, else the drafter campaign's checkpoint ``drafters/smollm2-135m-campaign``):
it installs into the default engine, loads with its hashes checked, keeps greedy output exact,
and reaches a minimum acceptance on a few benchmark prompts. Skipped, with the reason, where
neither folder holds weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

DRAFTERS = Path(__file__).resolve().parent.parent / "drafters"
WEIGHTS = next((d for d in (DRAFTERS / "smollm2-135m", DRAFTERS / "smollm2-135m-campaign")
                if (d / "weights.npz").is_file()), DRAFTERS / "smollm2-135m")

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not (WEIGHTS / "weights.npz").is_file(),
    reason="no trained drafter in drafters/smollm2-135m or drafters/smollm2-135m-campaign (drafters/README.md)")]


@pytest.fixture(scope="module")
def engine(default_engine):
    from dspark_edge.manifest import read_manifest, sha256_file
    from dspark_export.drafter.install import install_drafter

    m = read_manifest(default_engine)
    sha = sha256_file(WEIGHTS / "weights.npz")
    if m.drafter is None or m.drafter.provenance.get("weights_sha256") != sha:
        install_drafter(default_engine, WEIGHTS, progress=lambda msg: None)
    return default_engine


def test_shipped_weights_are_small_and_documented():
    size = sum(p.stat().st_size for p in WEIGHTS.iterdir())
    assert size <= 40 * 2**20
    meta = json.loads((WEIGHTS / "drafter.json").read_text())
    assert "train-drafter" in meta["training"]["command"] and meta["training"]["steps"] > 0
    rep = json.loads((WEIGHTS / "calibration.json").read_text())
    assert len(rep["positions"]) == meta["config"]["slots"]


def test_shipped_drafter_is_exact_and_accepted(engine):
    import dspark_edge
    from dspark_edge.bench import load_prompts

    plain = dspark_edge.load(engine, "fp32")
    spec = dspark_edge.load(engine, "fp32", drafter="dspark", verify_hashes=True)
    accepted = drafted = rounds = 0
    for rec in load_prompts()[::4]:
        a = plain.generate(rec["messages"], max_new_tokens=64, ignore_eos=True)
        b = spec.generate(rec["messages"], max_new_tokens=64, ignore_eos=True, draft_tokens=7)
        assert b.token_ids == a.token_ids, rec["id"]
        accepted += b.stats.draft_n_accepted
        drafted += b.stats.draft_n
        rounds += b.stats.rounds
    tau = (accepted + rounds) / rounds
    assert tau >= 1.3, f"mean accepted length {tau:.2f} per round at block 8"
    spec.close()
