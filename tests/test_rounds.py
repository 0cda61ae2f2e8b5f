"""The round and the width policies on a numpy fake decoder (tests/fake_decoder.py): what each
policy verifies, what is committed, and that greedy output is the target's whatever the drafter."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_edge.config import GenerationConfig
from dspark_edge.drafters import BaseDrafter, Draft
from dspark_edge.rounds import Speculator, Target
from dspark_edge.scheduler import CostModel, Scheduler, SchedulerConfig
from dspark_edge.widths import FixedLength, Scheduled, SurvivalCut
from fake_decoder import FakeDecoder, next_token


class ChainDrafter(BaseDrafter):
    """Drafts the fake target's own chain, wrong from draft ``wrong_at`` on (None: never)."""

    name = "chain"

    def __init__(self, vocab: int, confidence=(0.9,), wrong_at: int | None = None, most: int | None = None):
        self.vocab, self.confidence, self.wrong_at, self.most = vocab, confidence, wrong_at, most
        self.feedbacks = []

    def propose(self, request, rng):
        k = request.max_tokens if self.most is None else min(self.most, request.max_tokens)
        toks, x = [], request.context[-1]
        for i in range(k):
            x = next_token(x, self.vocab)
            toks.append((x + 1) % self.vocab if self.wrong_at is not None and i >= self.wrong_at else x)
        conf = np.resize(np.asarray(self.confidence, dtype=np.float64), k)
        return Draft(np.asarray(toks, dtype=np.int64), None, conf, source="chain", record={"k": k})

    def feedback(self, drafted, accepted, committed):
        self.feedbacks.append((drafted, accepted))


def run(policy, drafter, model=None, new_tokens=24, start=5, max_drafts=None):
    """Decode ``new_tokens`` after ``start`` with rounds; returns (tokens, infos, speculator)."""
    model = model or FakeDecoder()
    cache = model.new_cache()
    cache.commit(1)  # the prompt's positions (one token) are cached; ``start``'s successor is pending
    released = []
    target = Target(model, lambda: None, model.vocab, lambda: released.append(1))
    cfg = GenerationConfig(max_new_tokens=new_tokens)
    spec = Speculator(target, cfg, drafter, policy, max_drafts or max(model.widths) - 1,
                      np.random.default_rng(0), None)
    committed = [start]
    pending = next_token(start, model.vocab)
    spec.begin(committed, cache)
    tokens, infos = [pending], []
    while len(tokens) < new_tokens:
        info = spec.round(cache, committed, tokens[-1], len(tokens), new_tokens - len(tokens) - 1, 0.0, infos.append)
        tokens += list(info.tokens)
    return tokens[:new_tokens], infos, spec


def test_a_round_without_a_drafter_is_one_plain_step():
    tokens, infos, _ = run(SurvivalCut(0.3), None, new_tokens=6)
    assert tokens == FakeDecoder().chain(5, 6)
    assert all(i.width == 1 and i.drafted == 0 and len(i.tokens) == 1 for i in infos)


@pytest.mark.parametrize("wrong_at", [None, 0, 2])
@pytest.mark.parametrize("policy", [FixedLength(3), SurvivalCut(0.3), SurvivalCut(0.0)])
def test_greedy_output_is_the_targets_whatever_the_drafts(policy, wrong_at):
    d = ChainDrafter(50, wrong_at=wrong_at)
    tokens, infos, _ = run(policy, d)
    assert tokens == FakeDecoder().chain(5, 24)
    for info in infos:
        assert info.accepted == (info.drafted if wrong_at is None else min(wrong_at, info.drafted))
        assert len(info.tokens) == info.accepted + 1  # the accepted drafts, then the target's own token
    assert d.feedbacks == [(i.drafted, i.accepted) for i in infos if i.drafted]


def test_fixed_length_verifies_k_and_the_width_is_never_padded():
    model = FakeDecoder(widths=(1, 2, 4))
    _, infos, _ = run(FixedLength(3), ChainDrafter(50), model=model, max_drafts=3)
    assert {i.width for i in infos} <= {1, 2, 4} and infos[0].width == 4 and infos[0].accepted == 3
    # Two drafts offered for a fixed length of 3: width 3 is not listed, so one draft at width 2.
    _, infos, _ = run(FixedLength(3), ChainDrafter(50, most=2), model=FakeDecoder(widths=(1, 2, 4)), max_drafts=3)
    assert all(i.width == 2 and i.drafted == 1 for i in infos[:-1])


def test_survival_cut_keeps_drafts_while_the_survival_before_them_holds():
    _, infos, _ = run(SurvivalCut(0.3), ChainDrafter(50, confidence=(0.9, 0.2, 0.9, 0.9)), max_drafts=4)
    # survival before draft 3 is 0.9 * 0.2 = 0.18 < 0.3: two drafts (width 3)
    assert infos[0].drafted == 2 and infos[0].width == 3


def test_the_scheduler_policy_decides_records_and_learns():
    model = FakeDecoder()
    sched = Scheduler(CostModel({w: 10.0 + 0.1 * w for w in model.widths}, 0.0), model.widths, SchedulerConfig())
    _, infos, spec = run(Scheduled(sched), ChainDrafter(50, confidence=(0.95,)), model=model)
    assert all(i.decision is not None for i in infos)
    assert infos[0].width == 8  # nearly free wide passes and confident drafts: the widest width
    assert sum(spec.stats.modes.values()) == len(infos)
    assert infos[0].drafting == {"k": 7}  # the proposal's record reaches the round's record
    assert sched.costs.draft_by_source.get("chain") is not None  # drafting time costed per source
    # Unconfident drafts on a costly wide pass: plain steps.
    sched = Scheduler(CostModel({w: 10.0 * w for w in model.widths}, 0.0), model.widths, SchedulerConfig())
    _, infos, _ = run(Scheduled(sched), ChainDrafter(50, confidence=(0.05,)), model=model, new_tokens=8)
    assert infos[0].width == 1


def test_a_drafter_over_its_budget_or_out_of_vocabulary_is_a_failure_never_a_pass():
    class Bad(ChainDrafter):
        def propose(self, request, rng):
            return Draft(np.full(request.max_tokens + 2, 999, dtype=np.int64), None, np.full(request.max_tokens + 2, 0.5))

    model = FakeDecoder()
    tokens, infos, spec = run(FixedLength(3), Bad(50), model=model, new_tokens=10)
    assert tokens == model.chain(5, 10) and set(model.passes) == {1}
    assert "consecutive failures" in spec.disabled
