"""Speculative decoding on the tiny model: exactness, distribution, rollback, stops, stats."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import dspark_edge
from dspark_edge import ConfigError, GenerationConfig
from dspark_edge.drafters import Draft, DraftRequest, NgramDrafter

WORDS = ["The quick", "brown fox", "def add(a, b):", "return a + b", "Une phrase", "accents é è",
         "数字 123", "symbols !@#", "Speculative decoding", "verifies them", "lazy dog."]
PROMPTS = [" ".join(p) for p in itertools.permutations(WORDS, 2)][:60]


@pytest.fixture(scope="module")
def plain(tiny_engine):
    return dspark_edge.load(tiny_engine)


def _tie_at(pipe, prompt_ids, tokens, j) -> bool:
    """Whether plain decoding's step j was a float tie (top-2 logit gap < 1e-4)."""
    t = pipe.target
    cache = t.new_cache()
    out = t.prefill(cache, np.asarray(list(prompt_ids) + list(tokens[:j]), dtype=np.int64))
    top2 = np.sort(out.logits[-1])[-2:]
    return float(top2[1] - top2[0]) < 1e-4


def _check_exact(plain, spec, prompts, n=24, **kw):
    ties = 0
    for prompt in prompts:
        want = plain.generate(prompt, max_new_tokens=n, ignore_eos=True).token_ids
        got = spec.generate(prompt, max_new_tokens=n, ignore_eos=True, **kw)
        if got.token_ids != want:
            j = next(i for i, (a, b) in enumerate(zip(got.token_ids, want)) if a != b)
            assert _tie_at(plain, plain.encode_prompt(prompt), want, j), \
                f"{prompt!r}: speculative output diverged at token {j} without a float tie"
            ties += 1
    return ties


@pytest.mark.parametrize("drafter", ["ngram", "self", "poor"])
def test_greedy_speculative_equals_plain(plain, tiny_engine, tiny_draft_self, tiny_draft_poor, drafter):
    src = {"ngram": "ngram", "self": tiny_draft_self, "poor": tiny_draft_poor}[drafter]
    spec = dspark_edge.load(tiny_engine, scheduler=False, drafter=src)
    ties = _check_exact(plain, spec, PROMPTS)
    assert ties <= 2, f"{ties} float ties in {len(PROMPTS)} prompts"
    r = spec.generate(PROMPTS[0], max_new_tokens=24, ignore_eos=True)
    assert r.stats.drafter == ("ngram" if drafter == "ngram" else "draft_model")
    assert r.stats.draft_n > 0


def test_self_drafter_accepts_everything(tiny_engine, tiny_draft_self):
    spec = dspark_edge.load(tiny_engine, scheduler=False, drafter=tiny_draft_self)
    r = spec.generate(PROMPTS[3], max_new_tokens=40, ignore_eos=True, min_survival=0.0)
    s = r.stats
    assert s.acceptance_rate > 0.95
    assert s.rounds < 40 / 3  # whole blocks of 4 tokens per target pass
    assert s.bonus_tokens > 0 and s.widths.get("4", 0) > 0
    assert s.mean_accepted_length > 3


def test_every_fixed_width_is_exact_and_unlisted_is_rejected(plain, tiny_engine, tiny_draft_poor):
    spec = dspark_edge.load(tiny_engine, scheduler=False, drafter=tiny_draft_poor)
    for k in (0, 1, 2, 3):
        assert _check_exact(plain, spec, PROMPTS[:6], draft_tokens=k) <= 1
        r = spec.generate(PROMPTS[1], max_new_tokens=16, ignore_eos=True, draft_tokens=k)
        # k + 1 is used; narrower widths only where the token budget leaves fewer drafts
        assert max(int(w) for w in r.stats.widths) == k + 1
    with pytest.raises(ConfigError, match="does not list"):
        spec.generate(PROMPTS[0], max_new_tokens=4, draft_tokens=5)


def test_rollback_cache_equals_plain_cache(tiny_engine, tiny_draft_poor):
    """After accepts and rejects, the KV cache holds exactly what plain prefill would."""
    spec = dspark_edge.load(tiny_engine, scheduler=False, drafter=tiny_draft_poor)
    prompt = PROMPTS[5]
    r = spec.generate(prompt, max_new_tokens=30, ignore_eos=True)
    assert r.stats.draft_n > r.stats.draft_n_accepted > 0, "need both accepts and rejects"
    committed = spec.encode_prompt(prompt) + list(r.token_ids[:-1])
    n = len(committed)
    after = [b.numpy()[:, :, :n].copy() for b in spec._cache.buffers]
    fresh = spec.target.new_cache()
    spec.target.prefill(fresh, np.asarray(committed, dtype=np.int64))
    for got, want in zip(after, (b.numpy()[:, :, :n] for b in fresh.buffers)):
        np.testing.assert_allclose(got, want, atol=1e-4)


def test_eos_inside_accepted_block_ends_there(tiny_engine, tiny_draft_self):
    spec = dspark_edge.load(tiny_engine, scheduler=False, drafter=tiny_draft_self)
    full = spec.generate(PROMPTS[2], max_new_tokens=20, ignore_eos=True, min_survival=0.0)
    assert full.stats.widths.get("4", 0) > 0
    stop_id = full.token_ids[6]  # lands inside a block of 4 accepted drafts
    r = spec.generate(PROMPTS[2], max_new_tokens=20, stop_token_ids=(stop_id,), min_survival=0.0)
    first = full.token_ids.index(stop_id)
    assert r.stop_reason == "eos" and r.token_ids == full.token_ids[:first + 1]


def test_max_new_tokens_never_exceeded(tiny_engine, tiny_draft_self):
    spec = dspark_edge.load(tiny_engine, scheduler=False, drafter=tiny_draft_self)
    for n in (1, 2, 3, 5, 9):
        assert len(spec.generate(PROMPTS[0], max_new_tokens=n, ignore_eos=True).token_ids) == n


def test_sampling_reproducible_with_seed(tiny_engine, tiny_draft_poor):
    spec = dspark_edge.load(tiny_engine, scheduler=False, drafter=tiny_draft_poor)
    cfg = GenerationConfig(max_new_tokens=20, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
    assert spec.generate(PROMPTS[0], cfg).token_ids == spec.generate(PROMPTS[0], cfg).token_ids


def _exact_joint(pipe, prompt_ids, top_k, depth=3, presence=0.0, frequency=0.0, bias=()):
    """Exact probabilities of the first ``depth`` sampled tokens under the target (top-k, T=1),
    its logits reshaped by the given penalties and logit bias over the answer so far."""
    from dspark_edge.sampling import probs, reshaped_logits

    t = pipe.target
    out = {}

    def walk(prefix, prob):
        if len(prefix) == depth:
            out[tuple(prefix)] = prob
            return
        cache = t.new_cache()
        logits = t.prefill(cache, np.asarray(prompt_ids + prefix, dtype=np.int64)).logits[-1:]
        p = probs(reshaped_logits(logits, prefix, (), presence, frequency, bias)[0], 1.0, top_k, 1.0)
        for x in np.flatnonzero(p):
            walk(prefix + [int(x)], prob * p[x])

    walk([], 1.0)
    return out


def _chi2_rejects(pipe, prompt, exact, n, top_k, depth=3, **extra) -> bool:
    counts = dict.fromkeys(exact, 0)
    for seed in range(n):
        r = pipe.generate(prompt, max_new_tokens=depth, temperature=1.0, top_k=top_k, seed=seed, ignore_eos=True,
                          **extra)
        counts[tuple(r.token_ids)] = counts.get(tuple(r.token_ids), 0) + 1
    keys = [k for k in exact if exact[k] * n >= 5]
    rest = 1.0 - sum(exact[k] for k in keys)
    obs = [counts[k] for k in keys] + [n - sum(counts[k] for k in keys)]
    exp = [exact[k] * n for k in keys] + [rest * n]
    chi2 = sum((o - e) ** 2 / e for o, e in zip(obs, exp) if e > 0)
    df = len([e for e in exp if e > 0]) - 1
    z = 3.09  # p = 0.001, Wilson-Hilferty
    crit = df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3
    return chi2 > crit


def _table_drafter(pipe, prompt: str) -> NgramDrafter:
    """An n-gram drafter with a corpus table counted from a few sampled continuations of
    ``prompt``: it drafts at every position, often the likely token and often not."""
    from dspark_edge.drafters import NgramTable
    from dspark_export.ngram_table import count_continuations, table_arrays

    ids = pipe.encode_prompt(prompt)
    seqs = [(ids + list(pipe.generate(prompt, max_new_tokens=6, temperature=1.0, seed=s, ignore_eos=True).token_ids),
             len(ids)) for s in range(6)]
    return NgramDrafter(min_n=1, max_n=2, table=NgramTable.from_arrays(table_arrays(count_continuations(seqs, 2))))


@pytest.mark.parametrize("drafter", ["poor", "ngram"])
def test_sampled_speculative_follows_target_distribution(plain, tiny_engine, tiny_draft_poor, drafter):
    prompt = "The quick brown fox The quick brown"
    # n-gram drafts are deterministic (no q): accepted with probability p(draft). Prompt lookup
    # alone finds no match after the tiny model's sampled tokens, so the n-gram drafter carries a
    # corpus table of such samples, which makes it draft.
    src = tiny_draft_poor if drafter == "poor" else _table_drafter(plain, prompt)
    spec = dspark_edge.load(tiny_engine, scheduler=False, drafter=src)
    drafted = sum(spec.generate(prompt, max_new_tokens=3, temperature=1.0, top_k=4, seed=s, ignore_eos=True).stats.draft_n
                  for s in range(20))
    assert drafted > 0  # the drafts are really there to be judged
    exact = _exact_joint(spec, spec.encode_prompt(prompt), top_k=4)
    assert not _chi2_rejects(spec, prompt, exact, 3000, 4)


def test_sampled_speculative_follows_the_penalised_distribution(tiny_engine, tiny_draft_poor):
    """Rejection sampling under presence / frequency penalties and a logit bias draws from the
    reshaped target distribution (the draft model's q knows nothing of them)."""
    prompt = "The quick brown fox The quick brown"
    spec = dspark_edge.load(tiny_engine, scheduler=False, drafter=tiny_draft_poor)
    shape = {"presence_penalty": 0.7, "frequency_penalty": 0.9}
    ids = spec.encode_prompt(prompt)
    first = np.argsort(spec.target.prefill(spec.target.new_cache(), np.asarray(ids, dtype=np.int64)).logits[-1])
    bias = ((int(first[-1]), -1.5), (int(first[-5]), 1.0))  # the likeliest first token made rarer, another likelier
    exact = _exact_joint(spec, ids, top_k=4, presence=0.7, frequency=0.9, bias=bias)
    plain_exact = _exact_joint(spec, ids, top_k=4)
    assert max(abs(exact.get(k, 0.0) - plain_exact.get(k, 0.0)) for k in exact | plain_exact) > 0.02  # it reshapes
    assert not _chi2_rejects(spec, prompt, exact, 3000, 4, logit_bias=dict(bias), **shape)


def test_distribution_check_catches_a_wrong_acceptance_rule(tiny_engine, tiny_draft_poor, monkeypatch):
    """The chi-square check has teeth: accepting every draft (a wrong rule) is caught."""
    import dspark_edge.rounds as rounds
    from dspark_edge.verify import VerifyOutcome, verify_sampling

    def always_accept(drafts, q, logits, t, k, p, rng):
        full = verify_sampling(drafts[:0], None, logits[-1:], t, k, p, rng)
        return VerifyOutcome(len(drafts), tuple(int(x) for x in drafts) + full.tokens, True)

    monkeypatch.setattr(rounds, "verify_sampling", always_accept)
    spec = dspark_edge.load(tiny_engine, scheduler=False, drafter=tiny_draft_poor)
    prompt = "The quick brown fox The quick brown"
    exact = _exact_joint(spec, spec.encode_prompt(prompt), top_k=4)
    assert _chi2_rejects(spec, prompt, exact, 3000, 4)


class _Broken:
    name = "broken"

    def begin(self, prompt_ids):
        pass

    def propose(self, request, rng):
        raise RuntimeError("drafter crashed")

    def feedback(self, drafted, accepted, committed):
        pass


def test_failing_drafter_falls_back_to_plain(plain, tiny_engine):
    spec = dspark_edge.load(tiny_engine, scheduler=False, drafter=_Broken())
    r = spec.generate(PROMPTS[0], max_new_tokens=12, ignore_eos=True)
    assert r.stats.drafter_disabled and "drafter crashed" in r.stats.drafter_disabled
    assert r.token_ids == plain.generate(PROMPTS[0], max_new_tokens=12, ignore_eos=True).token_ids


def test_stats_are_consistent(tiny_engine):
    spec = dspark_edge.load(tiny_engine, scheduler=False, drafter="ngram")
    r = spec.generate("The quick brown fox The quick brown fox The quick", max_new_tokens=40, ignore_eos=True)
    s = r.stats
    assert sum(s.widths.values()) == s.rounds
    assert s.rounds + s.draft_n_accepted == len(r.token_ids) - 1  # each round adds accepted + 1
    assert sum(int(k) * v for k, v in s.accept_length_hist.items()) == s.draft_n_accepted
    assert all(0.0 <= a <= 1.0 for a in s.acceptance_per_position)


def test_speculative_off_is_plain(tiny_engine):
    spec = dspark_edge.load(tiny_engine, scheduler=False, drafter="ngram")
    r = spec.generate(PROMPTS[0], max_new_tokens=10, speculative=False)
    assert r.stats.draft_n == 0 and set(r.stats.widths) == {"1"} and r.stats.drafter == "none"


def test_draft_model_with_other_tokenizer_rejected(tiny_engine, tiny_draft_poor, tmp_path):
    import json
    import shutil

    from dspark_edge.errors import EngineError
    from dspark_edge.manifest import file_entry, read_manifest, write_manifest
    from dataclasses import replace

    bad = tmp_path / "draft"
    shutil.copytree(tiny_draft_poor, bad)
    tok = json.loads((bad / "tokenizer.json").read_text())
    tok["added_tokens"][0]["content"] = "<|other|>"
    (bad / "tokenizer.json").write_text(json.dumps(tok))
    m = read_manifest(bad)
    write_manifest(replace(m, files=tuple(file_entry(bad, f.path) if f.path == "tokenizer.json" else f
                                          for f in m.files)), bad)
    with pytest.raises(EngineError, match="different tokenizer"):
        dspark_edge.load(tiny_engine, scheduler=False, drafter=bad)


class _HiddenRecorder:
    """Proposes nothing useful (always token 0) but records the hidden states it is given."""

    name = "recorder"
    needs_hidden = True

    def __init__(self):
        self.rows = []
        self.contexts = []

    def begin(self, prompt_ids):
        self.rows, self.contexts = [], []

    def propose(self, request, rng):
        if request.new_hidden is not None:
            self.rows.append(request.new_hidden)
        self.contexts.append(list(request.context))
        k = min(2, request.max_tokens)
        return Draft(np.zeros(k, dtype=np.int64), None, np.full(k, 0.5))

    def feedback(self, drafted, accepted, committed):
        pass


def test_hidden_states_of_committed_positions_reach_the_drafter(tiny_engine):
    rec = _HiddenRecorder()
    spec = dspark_edge.load(tiny_engine, scheduler=False, drafter=rec)
    spec.generate(PROMPTS[4], max_new_tokens=12, ignore_eos=True)
    got = np.concatenate(rec.rows)
    committed = rec.contexts[-1][:-1]  # everything before the last anchor
    assert got.shape[0] == len(committed)
    fresh = spec.target.new_cache()
    sink = []
    spec.target.prefill(fresh, np.asarray(committed, dtype=np.int64), hidden_sink=sink)
    np.testing.assert_allclose(got, np.concatenate(sink), atol=1e-3)


@pytest.mark.parametrize("conf, floor, keep", [
    ([0.9, 0.9, 0.9, 0.9], 0.5, 4),   # survival 0.9, 0.81, 0.73 before drafts 2-4
    ([0.6, 0.6, 0.6], 0.5, 2),        # 0.6 ≥ 0.5 keeps draft 2; 0.36 < 0.5 drops draft 3
    ([0.1, 0.9, 0.9], 0.5, 1),        # draft 1 always stays
    ([0.2, 0.2], 0.0, 2),             # floor 0 keeps everything
    ([0.4], 0.9, 1),
])
def test_survival_cut(conf, floor, keep):
    from dspark_edge.widths import survival_cut

    assert survival_cut(np.asarray(conf), floor) == keep


def test_survival_cut_ignores_the_last_drafts_own_confidence():
    from dspark_edge.widths import survival_cut

    a = survival_cut(np.asarray([0.9, 0.9, 0.01]), 0.5)
    b = survival_cut(np.asarray([0.9, 0.9, 0.99]), 0.5)
    assert a == b == 3


def test_drafter_statistics_are_per_generation_by_default():
    """Acceptance statistics steer the draft length and so the random stream: by default they
    restart with each generation, so a seed reproduces its output whatever ran before."""
    ctx = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    for learn in (False, True):
        d = NgramDrafter(learn_across_generations=learn)
        d.begin(ctx)
        fresh = d.propose(DraftRequest(ctx, 4, 1.0, 0, 1.0), np.random.default_rng(0)).confidence.copy()
        for _ in range(20):
            d.feedback(4, 4, ctx)  # a history of full accepts
        d.begin(ctx)
        again = d.propose(DraftRequest(ctx, 4, 1.0, 0, 1.0), np.random.default_rng(0)).confidence
        assert np.array_equal(again, fresh) == (not learn)


def test_coupled_sampling_depends_on_the_seed_alone(plain, tiny_engine, tiny_draft_poor, tiny_draft_self):
    """sampling="coupled": the same seed gives plain decoding's answer with any drafter, at any
    fixed width and with the scheduler choosing widths from live timing."""
    drafters = [tiny_draft_poor, tiny_draft_self, NgramDrafter(min_n=1, max_n=2), _table_drafter(plain, PROMPTS[0])]
    for seed in range(4):
        kw = dict(max_new_tokens=24, temperature=0.9, top_k=20, top_p=0.95, seed=seed, ignore_eos=True,
                  sampling="coupled")
        ref = plain.generate(PROMPTS[seed % len(PROMPTS)], **kw).token_ids
        for src in drafters:
            auto = dspark_edge.load(tiny_engine, drafter=src)
            assert auto.generate(PROMPTS[seed % len(PROMPTS)], **kw).token_ids == ref
            for k in (1, 3):
                assert auto.generate(PROMPTS[seed % len(PROMPTS)], draft_tokens=k, **kw).token_ids == ref
            auto.close()
    self_spec = dspark_edge.load(tiny_engine, scheduler=False, drafter=tiny_draft_self)
    r = self_spec.generate(PROMPTS[0], **{**kw, "draft_tokens": 3})
    # the drafter picks with the same per-position noise: a drafter equal to the target always matches
    assert r.stats.acceptance_rate == 1.0 and r.stats.draft_n > 0


def test_coupled_sampling_follows_the_target_distribution(tiny_engine, tiny_draft_poor):
    spec = dspark_edge.load(tiny_engine, scheduler=False, drafter=tiny_draft_poor)
    prompt = "The quick brown fox The quick brown"
    exact = _exact_joint(spec, spec.encode_prompt(prompt), top_k=4)
    assert not _chi2_rejects(spec, prompt, exact, 3000, 4, sampling="coupled", draft_tokens=2)


class _Overconfident(_HiddenRecorder):
    """Says 0.9 for drafts that are almost always rejected; no ``observed_confidence``
    attribute, so its confidences count as calibrated elsewhere."""

    name = "overconfident"
    needs_hidden = False

    def propose(self, request, rng):
        k = min(3, request.max_tokens)
        return Draft(np.zeros(k, dtype=np.int64), None, np.full(k, 0.9))


def test_online_offset_corrects_head_confidences_but_not_observed_rates(tiny_engine):
    """The scheduler's online offset learns from a drafter whose confidences were calibrated
    elsewhere, and leaves the n-gram drafter's (already this generation's observed rates) alone."""
    from forced_width import ForcedWidthScheduler

    from dspark_edge.telemetry import FakeReader

    def widest(confidence):  # every draft verified
        return len(confidence) + 1

    spec = dspark_edge.load(tiny_engine, drafter=_Overconfident(), telemetry=FakeReader())
    spec.scheduler = ForcedWidthScheduler(spec.scheduler, widest, "test: widest")
    r = spec.generate(PROMPTS[1], max_new_tokens=24, ignore_eos=True)
    assert r.stats.draft_n > 0
    assert spec.scheduler.offset < -0.2  # drafts said 0.9 and were rejected: shifted down
    assert any(d.confidence_offset < 0 for d in spec.scheduler.decisions)
    ngram = dspark_edge.load(tiny_engine, drafter="ngram", telemetry=FakeReader())
    ngram.scheduler = ForcedWidthScheduler(ngram.scheduler, widest, "test: widest")
    r = ngram.generate("The quick brown fox The quick brown fox The quick", max_new_tokens=40, ignore_eos=True)
    assert r.stats.draft_n > 0
    assert ngram.scheduler.offset == 0.0
    assert all(d.confidence_offset == 0.0 for d in ngram.scheduler.decisions)


class _CostlyDeclined(_HiddenRecorder):
    """Drafting takes time and every draft looks hopeless: the scheduler declines them all."""

    name = "costly-declined"
    needs_hidden = False

    def __init__(self):
        super().__init__()
        self.calls = 0

    def propose(self, request, rng):
        import time

        self.calls += 1
        time.sleep(0.004)
        k = min(3, request.max_tokens)
        return Draft(np.zeros(k, dtype=np.int64), None, np.full(k, 1e-4))


def test_declined_drafting_rounds_close_the_gate(plain, tiny_engine):
    """Rounds whose drafts were all declined still paid for drafting: they count toward the
    gate, which then stops drafting (probing now and then) instead of paying for drafts that
    are never verified. The output stays plain's."""
    from dspark_edge.scheduler import SchedulerConfig
    from dspark_edge.telemetry import FakeReader

    drafter = _CostlyDeclined()
    spec = dspark_edge.load(tiny_engine, drafter=drafter, telemetry=FakeReader(),
                            scheduler=SchedulerConfig(explore_every=0, min_observations=3))
    r = spec.generate(PROMPTS[0], max_new_tokens=40, ignore_eos=True)
    assert r.token_ids == plain.generate(PROMPTS[0], max_new_tokens=40, ignore_eos=True).token_ids
    assert spec.scheduler.gated
    assert drafter.calls < 15  # 3 rounds to learn, then a probe every 16 rounds
    assert any("the gate" in d.reason for d in spec.scheduler.decisions)


def _shared(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("drafter", [None, "ngram", "self"])
def test_a_chats_next_turn_prefills_only_what_it_does_not_share_and_answers_as_from_scratch(tiny_engine, drafter):
    turn1 = [{"role": "user", "content": "The quick brown fox"}]
    cfg = GenerationConfig(max_new_tokens=16, ignore_eos=True, reuse_prefix=True)
    with dspark_edge.load(tiny_engine, drafter=drafter) as pipe, dspark_edge.load(tiny_engine, drafter=drafter) as fresh:
        first = pipe.generate(turn1, cfg)
        assert first.stats.prompt_reused == 0  # nothing kept yet
        turn2 = turn1 + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And then?"}]
        second = pipe.generate(turn2, cfg)
        kept = first.prompt_ids + first.token_ids[:-1]  # the answer's last token was never run
        assert second.stats.prompt_reused == _shared(kept, second.prompt_ids) >= len(first.prompt_ids)
        assert second.token_ids == fresh.generate(turn2, max_new_tokens=16, ignore_eos=True).token_ids
        # The same prompt again reuses all of it but its last token, whose pass gives the first logits.
        third = pipe.generate(turn2, cfg)
        assert third.stats.prompt_reused == len(third.prompt_ids) - 1
        assert third.token_ids == second.token_ids


def test_prefix_reuse_is_asked_for_and_keeps_nothing_from_a_cancelled_generation(tiny_engine):
    prompt = "Speculative decoding verifies them"
    with dspark_edge.load(tiny_engine, drafter="ngram") as pipe:
        pipe.generate(prompt, max_new_tokens=8)
        assert pipe.generate(prompt, max_new_tokens=8).stats.prompt_reused == 0  # off by default
        pipe.generate(prompt, max_new_tokens=8, reuse_prefix=True)
        s = pipe.stream(prompt, GenerationConfig(max_new_tokens=40, ignore_eos=True, reuse_prefix=True))
        next(iter(s))
        s.cancel()
        list(s)
        assert s.result.stop_reason == "cancelled"
        assert pipe.generate(prompt, max_new_tokens=8, reuse_prefix=True).stats.prompt_reused == 0


def test_a_drafter_that_reads_hidden_states_gets_the_whole_prompts_even_with_prefix_reuse(tiny_engine):
    rec = _HiddenRecorder()
    spec = dspark_edge.load(tiny_engine, scheduler=False, drafter=rec)
    cfg = GenerationConfig(max_new_tokens=12, ignore_eos=True, reuse_prefix=True)
    spec.generate(PROMPTS[4], cfg)
    again = spec.generate(PROMPTS[4], cfg)
    assert again.stats.prompt_reused == 0
    assert np.concatenate(rec.rows).shape[0] == len(rec.contexts[-1]) - 1  # every committed position's


def test_logprobs_are_the_targets_own_whatever_the_drafts(plain, tiny_engine, tiny_draft_self):
    """``logprobs=k``: one entry per new token, read from the pass that verified it; speculative
    rounds (whole blocks accepted) report what plain width-1 steps report, and each value is the
    log-softmax of the target's logits at that position (checked against a fresh prefill)."""
    spec = dspark_edge.load(tiny_engine, scheduler=False, drafter=tiny_draft_self)
    prompt = PROMPTS[3]
    want = plain.generate(prompt, max_new_tokens=20, ignore_eos=True, logprobs=3)
    got = spec.generate(prompt, max_new_tokens=20, ignore_eos=True, logprobs=3, min_survival=0.0)
    assert got.token_ids == want.token_ids and got.stats.draft_n_accepted > 0
    assert len(got.logprobs) == len(want.logprobs) == len(want.token_ids)
    for g, w, tok in zip(got.logprobs, want.logprobs, want.token_ids):
        assert g.token_id == w.token_id == tok
        assert g.logprob == pytest.approx(w.logprob, abs=1e-4)
        assert [t for t, _ in g.top] == [t for t, _ in w.top] and g.top[0][0] == tok  # greedy: the likeliest
        assert [lp for _, lp in g.top] == sorted((lp for _, lp in g.top), reverse=True)
    ids = plain.encode_prompt(prompt) + list(want.token_ids[:5])
    logits = plain.target.prefill(plain.target.new_cache(), np.asarray(ids, dtype=np.int64)).logits[-1]
    z = logits.astype(np.float64)
    expected = z[want.token_ids[5]] - (z.max() + np.log(np.exp(z - z.max()).sum()))
    assert want.logprobs[5].logprob == pytest.approx(expected, abs=1e-5)
    sampled = spec.generate(prompt, max_new_tokens=12, temperature=0.8, seed=3, logprobs=0)
    assert len(sampled.logprobs) == len(sampled.token_ids) and all(e.top == () for e in sampled.logprobs)
    assert all(e.logprob <= 0.0 for e in sampled.logprobs)
    assert plain.generate(prompt, max_new_tokens=4).logprobs is None  # off by default
    with pytest.raises(ConfigError, match="logprobs"):
        GenerationConfig(logprobs=21)


def test_penalties_and_logit_bias_keep_speculative_output_plain(plain, tiny_engine, tiny_draft_self):
    """Presence / frequency penalties and a logit bias reshape the target's distribution; every
    position of a speculative pass is reshaped as plain decoding reshapes it (the drafts before it
    counted), so greedy and coupled answers stay plain decoding's under them."""
    spec = dspark_edge.load(tiny_engine, scheduler=False, drafter=tiny_draft_self)
    kw = dict(max_new_tokens=24, ignore_eos=True, presence_penalty=0.4, frequency_penalty=0.8)
    changed, accepted = 0, 0
    for prompt in PROMPTS[:6]:
        want = plain.generate(prompt, **kw)
        got = spec.generate(prompt, min_survival=0.0, **kw)
        assert got.token_ids == want.token_ids, prompt
        accepted += got.stats.draft_n_accepted
        changed += want.token_ids != plain.generate(prompt, max_new_tokens=24, ignore_eos=True).token_ids
    assert accepted > 0 and changed > 0  # drafts were accepted under the penalties, and the penalties acted
    forced = spec.generate(PROMPTS[0], max_new_tokens=8, ignore_eos=True, logit_bias={5: 100.0})
    assert forced.token_ids == (5,) * 8
    ckw = dict(max_new_tokens=16, temperature=0.9, sampling="coupled", seed=4, frequency_penalty=1.0,
               logit_bias={7: 2.0})
    for prompt in PROMPTS[:3]:
        assert spec.generate(prompt, **ckw).token_ids == plain.generate(prompt, **ckw).token_ids
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        plain.generate(PROMPTS[0], logit_bias={10**6: 1.0})
    with pytest.raises(ConfigError, match="presence_penalty"):
        GenerationConfig(presence_penalty=3.0)
    with pytest.raises(ConfigError, match="logit_bias values"):
        GenerationConfig(logit_bias={3: float("nan")})


def test_prompt_logprobs_score_every_prompt_token_across_prefill_chunks(plain, tiny_engine):
    """``prompt_logprobs``: one entry per prompt token (None for the first), each the log-softmax
    of the prefill's logits at the position before it, across prefill chunks; with
    ``max_new_tokens`` 0 the prompt is scored and nothing answered, and a kept prefix is not reused."""
    from dspark_edge.decoder import PREFILL_CHUNK

    text = " ".join(PROMPTS[:40])
    r = plain.generate(text, max_new_tokens=0, prompt_logprobs=2)
    ids = list(r.prompt_ids)
    assert len(ids) > PREFILL_CHUNK + 2 and r.token_ids == () and len(r.prompt_logprobs) == len(ids)
    assert r.prompt_logprobs[0] is None and [e.token_id for e in r.prompt_logprobs[1:]] == ids[1:]
    for j in (1, PREFILL_CHUNK - 1, PREFILL_CHUNK, PREFILL_CHUNK + 1, len(ids) - 1):
        z = plain.target.prefill(plain.target.new_cache(), np.asarray(ids[:j], dtype=np.int64)).logits[-1]
        z = z.astype(np.float64)
        assert r.prompt_logprobs[j].logprob == pytest.approx(z[ids[j]] - (z.max() + np.log(np.exp(z - z.max()).sum())),
                                                             abs=1e-4)
        assert len(r.prompt_logprobs[j].top) == 2
    plain.generate(text, max_new_tokens=4, reuse_prefix=True)  # keeps its K/V
    again = plain.generate(text, max_new_tokens=4, reuse_prefix=True, prompt_logprobs=0)
    assert again.stats.prompt_reused == 0 and len(again.prompt_logprobs) == len(ids)
