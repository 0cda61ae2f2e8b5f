"""Self-drafting: the target's INT8 graph drafts over the target's own KV cache (tiny model)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import dspark_edge
from dspark_edge import ConfigError
from dspark_edge.backends.base import BackendError
from dspark_edge.drafters import Draft, DraftRequest
from dspark_edge.telemetry import FakeReader
from dspark_edge.verify import judged
from dspark_edge.widths import Yardstick
from test_speculative_tiny import PROMPTS, _check_exact, _chi2_rejects, _exact_joint


@pytest.fixture(scope="module")
def plain(tiny_engine):
    return dspark_edge.load(tiny_engine, "fp32")


def _bound(pipe, prompt: str):
    """The pipeline's self drafter bound to a fresh target cache holding ``prompt`` but its
    last token; returns (drafter, cache, context)."""
    d = pipe.drafter
    ids = pipe.encode_prompt(prompt)
    cache = pipe.target.new_cache()
    pipe.target.prefill(cache, np.asarray(ids[:-1], dtype=np.int64))
    d.bind_target(pipe.target, cache)
    d.begin(ids[:-1])
    return d, cache, ids


@pytest.mark.parametrize("spec", ["self", "ngram+self"])
def test_greedy_self_drafting_equals_plain(plain, tiny_engine, spec):
    fixed = dspark_edge.load(tiny_engine, "fp32", scheduler=False, drafter=spec)
    assert _check_exact(plain, fixed, PROMPTS[:20]) <= 1
    for k in (1, 2, 3):
        assert _check_exact(plain, fixed, PROMPTS[20:24], draft_tokens=k) == 0
    auto = dspark_edge.load(tiny_engine, "fp32", drafter=spec, telemetry=FakeReader())
    assert _check_exact(plain, auto, PROMPTS[24:34]) <= 1
    r = fixed.generate(PROMPTS[0], max_new_tokens=24, ignore_eos=True, draft_tokens=3)
    assert r.stats.draft_n > 0 and r.stats.drafter == fixed.drafter.name
    if spec == "self":  # the INT8 copy of the tiny model agrees with it nearly always
        assert r.stats.draft_n_accepted >= 0.8 * r.stats.draft_n


def test_drafting_leaves_the_target_cache_as_it_was(tiny_engine):
    pipe = dspark_edge.load(tiny_engine, "fp32", scheduler=False, drafter="self")
    d, cache, ids = _bound(pipe, PROMPTS[5])
    before = pipe.target.step(cache, np.asarray(ids[-1:], dtype=np.int64)).logits.copy()
    length = cache.length
    draft = d.propose(DraftRequest(ids, 3, 0.0, 0, 1.0), np.random.default_rng(0))
    assert len(draft) == 3 and cache.length == length
    # The drafts' K/V were written past the committed positions; a target pass writes its own
    # there before reading them, so it computes exactly what it computed before the drafting.
    after = pipe.target.step(cache, np.asarray(ids[-1:], dtype=np.int64)).logits
    np.testing.assert_array_equal(before, after)
    block = np.concatenate((ids[-1:], draft.tokens)).astype(np.int64)
    wide = pipe.target.step(cache, block).logits.copy()
    fresh = pipe.target.new_cache()  # the same pass over a cache no drafter has touched
    pipe.target.prefill(fresh, np.asarray(ids[:-1], dtype=np.int64))
    np.testing.assert_array_equal(wide, pipe.target.step(fresh, block).logits)


def test_sampled_self_drafting_follows_the_target_distribution(tiny_engine):
    prompt = "The quick brown fox The quick brown"
    spec = dspark_edge.load(tiny_engine, "fp32", scheduler=False, drafter="self")
    drafted = sum(spec.generate(prompt, max_new_tokens=3, temperature=1.0, top_k=4, seed=s, ignore_eos=True,
                                draft_tokens=2).stats.draft_n for s in range(10))
    assert drafted > 0
    exact = _exact_joint(spec, spec.encode_prompt(prompt), top_k=4)
    assert not _chi2_rejects(spec, prompt, exact, 3000, 4, draft_tokens=2)


def test_confidences_are_known_before_the_draw(tiny_engine, tiny_draft_poor):
    """A confidence must not depend on the token it admits: sampled drafts differ from seed to
    seed, the first draft's confidence does not (also for an independent draft model)."""
    pipe = dspark_edge.load(tiny_engine, "fp32", scheduler=False, drafter="self")
    d, _, ids = _bound(pipe, PROMPTS[7])
    request = DraftRequest(ids, 3, 1.5, 0, 1.0)
    drafts = [d.propose(request, np.random.default_rng(s)) for s in range(12)]
    assert len({int(x.tokens[0]) for x in drafts}) > 1
    first = [float(x.confidence[0]) for x in drafts]
    assert max(first) - min(first) < 1e-6
    # The draft model re-runs its cache after each proposal: equal up to float rounding.
    model = dspark_edge.load(tiny_engine, "fp32", scheduler=False, drafter=tiny_draft_poor).drafter
    model.begin(ids[:-1])
    drafts = [model.propose(request, np.random.default_rng(s)) for s in range(12)]
    assert len({int(x.tokens[0]) for x in drafts}) > 1
    first = [float(x.confidence[0]) for x in drafts]
    assert max(first) - min(first) < 1e-6


def test_drafting_stops_where_it_does_not_pay(tiny_engine):
    pipe = dspark_edge.load(tiny_engine, "fp32", scheduler=False, drafter="self")
    d, _, ids = _bound(pipe, PROMPTS[9])
    flat = {w: 10.0 for w in pipe.target.widths}.__getitem__
    request = DraftRequest(ids, 3, 0.0, 0, 1.0, yardstick=Yardstick(flat, pipe.target.widths))
    d.step_ms = 1e-3  # drafting costs nothing: every listed width is worth filling
    assert len(d.propose(request, np.random.default_rng(0))) == 3
    d.step_ms = 1e4  # a draft costs far more than a pass: not worth drafting at all
    assert len(d.propose(request, np.random.default_rng(0))) == 0
    d.step_ms = 4.0  # in between: fewer drafts than allowed, a listed length
    d.tried[:], d.accepted[:] = 100, 60  # observed: 60 % accepted
    assert len(d.propose(request, np.random.default_rng(0))) == 1  # 1.6 / 14 ms beats 1.96 / 18 ms


def test_ngram_drafts_are_used_where_they_promise_more(tiny_engine):
    pipe = dspark_edge.load(tiny_engine, "fp32", scheduler=False, drafter="ngram+self")
    text = "alpha beta gamma delta epsilon zeta eta theta iota kappa " * 3
    d, _, ids = _bound(pipe, text)
    costs = {w: 10.0 for w in pipe.target.widths}.__getitem__
    request = DraftRequest(ids, 3, 0.0, 0, 1.0, yardstick=Yardstick(costs, pipe.target.widths))
    d.step_ms = 1e4  # the copy is too dear: the n-gram drafts of the repeated text are used
    draft = d.propose(request, np.random.default_rng(0))
    assert draft.source == "ngram" and len(draft) > 0 and draft.record["source"] == "ngram"
    d.feedback(len(draft), len(draft), ids)  # goes to the n-gram drafter, not the copy's counts
    assert d.tried.sum() == 0
    d.step_ms = 1e-3
    d.tried[:], d.accepted[:] = 1000, 1000  # a free copy that is always right: it drafts instead
    again = d.propose(request, np.random.default_rng(0))
    assert again.source == "self" and again.observed is True


def test_self_drafting_errors_name_the_fix(tiny_engine, tiny_portable):
    with pytest.raises(ConfigError, match="--precisions fp16,fp32,int8"):
        dspark_edge.load(tiny_engine, "fp32", drafter="self:fp16")
    with pytest.raises(ConfigError, match="target's own int8 graph.*load the target in fp32"):
        dspark_edge.load(tiny_engine, "int8", drafter="ngram+self")
    pipe = dspark_edge.load(tiny_engine, "fp32", scheduler=False, drafter="self")
    other = dspark_edge.load(tiny_portable, "fp32")
    with pytest.raises(BackendError, match="cannot share this KV cache"):
        pipe.drafter.model.session.view_cache(other.target.new_cache())


def test_auto_picks_the_drafter_for_the_precision_and_device(tiny_engine):
    from dataclasses import replace
    from types import SimpleNamespace

    from dspark_edge.drafters import create
    from dspark_edge.pipeline import auto_drafter

    assert dspark_edge.load(tiny_engine, "fp32", drafter="auto").drafter.name == "ngram+self:int8"
    assert dspark_edge.load(tiny_engine, "int8", drafter="auto").drafter.name == "ngram"  # the copy would be the target
    m = dspark_edge.read_manifest(tiny_engine)
    assert auto_drafter(m, "fp32") == "ngram+self"
    assert auto_drafter(m, "fp32", providers=("CUDAExecutionProvider", "CPUExecutionProvider")) == "ngram"
    assert auto_drafter(m, "fp32", backend="tensorrt") == "ngram"
    fp32_only = replace(m, variants=tuple(v for v in m.variants if v.precision != "int8"))
    assert auto_drafter(fp32_only, "fp32") == "ngram"
    # A folder with a DSpark drafter installed (its manifest section and precisions are all that
    # is read): self-drafting on the CPU still measures faster.
    with_drafter = SimpleNamespace(drafter=object(), precisions=m.precisions)
    assert auto_drafter(with_drafter, "fp32") == "ngram+self"
    assert auto_drafter(with_drafter, "int8") == "dspark"
    assert auto_drafter(with_drafter, "fp32", providers=("CUDAExecutionProvider",)) == "dspark"
    assert auto_drafter(SimpleNamespace(drafter=object(), precisions=fp32_only.precisions), "fp32") == "dspark"
    with pytest.raises(ConfigError, match="pass it to load"):
        create("auto", m, engine_dir=tiny_engine)


def test_shared_thread_pool_in_a_process_of_its_own(tiny_engine):
    """``shared_threads``: the target and the drafter run on the process-wide pool, and every
    session opened afterwards in that process too (onnxruntime refuses others once the pool
    exists). Run in a child process: the pool would outlive this test in the test process."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(f"""
        import dspark_edge
        shared = dspark_edge.BackendOptions(shared_threads=True)
        spec = dspark_edge.load({str(tiny_engine)!r}, "fp32", drafter="self", scheduler=False, options=shared)
        plain = dspark_edge.load({str(tiny_engine)!r}, "fp32")
        pools = [s.get_session_options().use_per_session_threads
                 for s in (spec.target.session.session, spec.drafter.model.session.session, plain.target.session.session)]
        want = plain.generate("The quick brown", max_new_tokens=12, ignore_eos=True).token_ids
        got = spec.generate("The quick brown", max_new_tokens=12, ignore_eos=True, draft_tokens=2)
        print(pools, got.token_ids == want, got.stats.draft_n > 0)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == "[False, False, False] True True"


def test_the_command_line_shares_the_pool_only_in_its_own_process(tiny_engine):
    """`python -m dspark_edge` with a drafter that has a graph of its own puts both on the shared
    pool; ``cli.main`` called inside another program (this test process) leaves pools alone, or
    that program could open no session with a pool of its own afterwards."""
    import subprocess
    import sys

    from dspark_edge.backends import ort as ort_backend
    from dspark_edge.cli import main

    args = ["-v", "generate", "--engine", str(tiny_engine), "--raw", "The quick brown", "--max-new-tokens", "6",
            "--drafter", "self", "--draft-tokens", "2"]
    assert main(args) == 0
    assert ort_backend._SHARED_POOL == []
    out = subprocess.run([sys.executable, "-m", "dspark_edge", *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "share the process-wide onnxruntime thread pool" in out.stderr


def test_with_a_fixed_length_ngram_drafts_are_used_when_they_reach_as_far(tiny_engine):
    pipe = dspark_edge.load(tiny_engine, "fp32", scheduler=False, drafter="ngram+self")
    d = pipe.drafter
    ng = lambda conf: Draft(np.arange(len(conf), dtype=np.int64), None, np.asarray(conf))  # noqa: E731
    d.tried[:], d.accepted[:] = 100, 90  # the copy: about 0.9 per draft, 2.44 of 3 expected
    assert d._use_ngram(ng([0.95, 0.95, 0.95]), 3, None)  # 2.71 expected: as far, and free
    assert not d._use_ngram(ng([0.6, 0.6, 0.6]), 3, None)  # 1.18 expected
    assert not d._use_ngram(ng([0.99, 0.99]), 3, None)  # fewer than asked for


def _flat_copy_costs(d, ms: float = 1.0) -> None:
    """Every width of the copy's pass costs the same: a staged check of every guess pays. The
    passes' timings scale the curve as a whole but never bend it (no width reaches ``min_obs``),
    so a slow pass on a busy machine cannot tip a choice."""
    from dspark_edge.scheduler import CostModel

    d.copy_costs = CostModel({w: ms for w in d.model.widths}, 0.0, min_obs=10**9)


def test_a_staged_check_draws_the_drafts_step_by_step_drafting_draws(tiny_engine):
    """The copy's first pass over the pending token and the n-gram's guesses gives, for as long
    as its draws equal the guesses, the drafts one step at a time would have given."""
    pipe = dspark_edge.load(tiny_engine, "fp32", scheduler=False, drafter="ngram+self")
    d, cache, ids = _bound(pipe, PROMPTS[11])
    request = DraftRequest(ids, 3, 0.0, 0, 1.0)
    length = cache.length
    own = d._draft(request, 3, None, np.random.default_rng(0)).tokens.tolist()
    assert len(own) == 3 and d._agreed == 0 and not d._guesses
    wrong = (own[1] + 1) % pipe.manifest.model.vocab_size
    for guesses, agreed in ((own[:2], 2), (own[:1], 1), ([own[0], wrong], 1), ([wrong], 0)):
        staged = d._draft(request, 3, None, np.random.default_rng(0), guesses)
        assert staged.tokens.tolist() == own and d._agreed == agreed, guesses
        assert cache.length == length and d._guesses == guesses
    assert d.staged == [4, 6, 4]
    assert len(d.copy_costs.ratios[3]) == 2 and len(d.copy_costs.ratios[2]) == 2  # its passes are timed


def test_how_many_guesses_the_copy_checks(tiny_engine):
    pipe = dspark_edge.load(tiny_engine, "fp32", scheduler=False, drafter="ngram+self")
    d = pipe.drafter
    ng = lambda conf: Draft(np.arange(len(conf), dtype=np.int64), None, np.asarray(conf))  # noqa: E731
    d.tried[:], d.accepted[:] = 1000, 1000  # the copy: always right
    _flat_copy_costs(d)
    assert d._stage_width(ng([0.9, 0.9, 0.9]), 4, None) == 3  # a wider pass is free: all guesses
    assert d._stage_width(ng([0.9, 0.9, 0.9]), 3, None) == 2  # the chain never outgrows k
    assert d._stage_width(ng([0.9, 0.9, 0.9]), 1, None) == 0
    from dspark_edge.scheduler import CostModel
    d.copy_costs = CostModel({1: 10.0, 2: 11.6, 3: 18.0, 4: 26.0}, 0.0)  # a steep curve
    assert d._stage_width(ng([0.9, 0.9, 0.9]), 4, None) == 1  # 1.9 / 11.6 ms beats 2.71 / 18 and 3.44 / 26
    assert d._stage_width(ng([0.1, 0.9, 0.9]), 4, None) == 0  # 1.1 / 11.6 ms loses to 1 / 10 ms


@pytest.mark.parametrize("seen", [
    ((3, 3, 4, 4), (3, 3)),  # every guess agreed and accepted
    ((3, 3, 4, 1), (2, 1)),  # the target rejected the second (agreed) guess
    ((3, 1, 4, 3), (2, 1)),  # it accepted the copy's token where the second guess differed
    ((3, 1, 4, 1), (1, 1)),  # it rejected that token: the second guess is not judged
    ((3, 3, 2, 2), (2, 2)),  # only two drafts verified, both accepted
    ((2, 0, 3, 0), (0, 0)),
])
def test_what_a_round_says_of_the_checked_guesses(seen):
    from dspark_edge.drafters.self_draft import guesses_judged

    args, want = seen
    assert guesses_judged(*args) == want


class _Guesser:
    """An n-gram drafter stand-in proposing given tokens by answer position (a staged check
    must keep the output exact whatever the guesses are)."""
    name, observed_confidence = "guesses", False

    def __init__(self, tokens, extend: bool = False, propose: bool = True):
        self.tokens, self.judged, self.can_extend, self.proposes = list(tokens), [0, 0], extend, propose
        self.position, self.extended = 0, [0, 0]

    def begin(self, prompt_ids):
        pass

    def propose(self, request, rng):
        self.position = request.position
        if not self.proposes:
            return Draft.empty()
        t = np.asarray(self.tokens[request.position:request.position + request.max_tokens], dtype=np.int64)
        return Draft(t, None, np.full(len(t), 0.9))

    def extend(self, drafts, k):
        if not self.can_extend:
            return Draft.empty()
        start = self.position + len(drafts)
        t = np.asarray(self.tokens[start:start + k], dtype=np.int64)
        return Draft(t, None, np.full(len(t), 0.9))

    def feedback(self, drafted, accepted, committed):
        self.judged[0] += judged(drafted, accepted)
        self.judged[1] += accepted

    def feedback_extension(self, drafted, accepted):
        self.extended[0] += judged(drafted, accepted)
        self.extended[1] += accepted


def test_staged_rounds_stay_exact(plain, tiny_engine):
    prompt = "The quick brown fox The quick brown"
    spec = dspark_edge.load(tiny_engine, "fp32", scheduler=False, drafter="ngram+self")
    d = spec.drafter
    _flat_copy_costs(d)
    d.tried[:], d.accepted[:] = 1000, 1000  # the n-gram drafts are never used as they are
    for text in PROMPTS[:6]:
        want = plain.generate(text, max_new_tokens=24, ignore_eos=True).token_ids
        for guesses in (want, [t + 1 for t in want]):  # right and wrong guesses
            d.ngram = _Guesser(guesses)
            before = d.staged[0]
            assert spec.generate(text, max_new_tokens=24, ignore_eos=True, draft_tokens=3).token_ids == want
            assert d.staged[0] > before
    assert d.ngram.judged[0] > 0 and d.ngram.judged[1] == 0  # the wrong guesses were judged wrong
    # Sampled: four tokens, so that the first round may draft two and the copy checks a guess.
    d.ngram = _Guesser(plain.generate(prompt, max_new_tokens=4, ignore_eos=True).token_ids)
    exact = _exact_joint(spec, spec.encode_prompt(prompt), top_k=4, depth=4)
    before = list(d.staged)
    assert not _chi2_rejects(spec, prompt, exact, 3000, 4, depth=4, draft_tokens=2)
    passes, guesses, agreed = (a - b for a, b in zip(d.staged, before))
    assert passes >= 3000 and 0 < agreed < guesses  # staged rounds, with guesses drawn and not drawn


def _dear_passes(pipe, ms: float = 1000.0):
    """The scheduler sees a device whose target pass costs ``ms`` at every width (the tiny
    model's cost a fraction of a millisecond, less than a drafting step: nothing would be
    worth drafting). Far dearer than a drafting step on any machine, however busy, so the
    copy drafts every round whatever its measured step time."""
    pipe.scheduler.costs.verify = lambda width: ms
    return pipe


def test_the_copy_stops_where_ngram_drafts_continue_it(tiny_engine):
    """With the scheduler, drafting with the copy stops early where n-gram drafts continuing
    it promise more tokens per ms than further steps of the copy; they follow its drafts."""
    pipe = dspark_edge.load(tiny_engine, "fp32", scheduler=False, drafter="ngram+self")
    d, _, ids = _bound(pipe, PROMPTS[9])
    # A pass far dearer than a drafting step (however busy the machine): the choices turn on
    # the drafts' survivals alone.
    flat = {w: 1000.0 for w in pipe.target.widths}.__getitem__
    request = DraftRequest(ids, 3, 0.0, 0, 1.0, yardstick=Yardstick(flat, pipe.target.widths))
    d.tried[:], d.accepted[:] = 1000, 900  # the copy: 90 % of its drafts accepted
    d.ngram = _Guesser([], extend=False, propose=False)
    d.step_ms = 1.0
    own = d.propose(request, np.random.default_rng(0))
    assert len(own) == 3 and d._copied == 3  # nothing continues it: the copy drafts all three
    assert own.record == {"source": "self", "copied": 3, "continued": 0, "checked": 0, "agreed": 0,
                               "why": "every length asked for"}
    d.ngram = _Guesser([11, 12, 13, 14], extend=True, propose=False)  # the continuation of answer position i
    d.step_ms = 1.0
    ext = d.propose(request, np.random.default_rng(0))
    # After one draft the chain with the continuation already holds 3 drafts (1 + 0.9 + 0.81 +
    # 0.73 expected tokens): a second step of the copy would add time and no draft.
    assert d._copied == 1 and len(ext) == 3 and ext.tokens[0] == own.tokens[0]
    assert ext.tokens[1:].tolist() == [12, 13]  # request.position is 0: positions 1 and 2
    np.testing.assert_allclose(ext.confidence[1:], [0.9, 0.9])
    assert ext.q is None and d.extended == [1, 2]
    assert ext.record["copied"] == 1 and ext.record["continued"] == 2
    assert ext.record["why"] == "the n-gram continuation promises more than further drafts"


def test_each_round_records_what_the_drafter_did(tiny_engine):
    """The trace says, round by round, which source drafted, how many drafts the copy and the
    continuation gave, and why drafting stopped."""
    import io

    from dspark_edge.metrics import TraceWriter

    pipe = _dear_passes(dspark_edge.load(tiny_engine, "fp32", drafter="ngram+self", telemetry=FakeReader()))
    d = pipe.drafter
    d.tried[:], d.accepted[:] = 1000, 400
    text = PROMPTS[2]
    want = dspark_edge.load(tiny_engine, "fp32").generate(text, max_new_tokens=24, ignore_eos=True).token_ids
    d.ngram = _Guesser(want, extend=True, propose=False)
    out = io.StringIO()
    trace = TraceWriter(out)
    pipe.add_observer(trace)
    r = pipe.generate(text, max_new_tokens=24, ignore_eos=True)
    rounds = [json.loads(line) for line in out.getvalue().splitlines() if '"round"' in line]
    assert len(rounds) == r.stats.rounds
    said = [x["drafting"] for x in rounds if x["drafting"] is not None]
    assert said and all(x["source"] == "self" and x["why"] for x in said)
    assert any(x["continued"] > 0 for x in said)
    for x in rounds:
        if x["drafting"] is not None:  # the verified drafts are a prefix of what was proposed
            assert x["drafted"] <= x["drafting"]["copied"] + x["drafting"]["continued"]


def test_ngram_drafts_continue_the_copys(plain, tiny_engine):
    """After the copy's drafts, n-gram drafts that continue them (right or wrong ones) keep the
    greedy output exact: with a fixed length, where they complete it (they promise more than the
    copy drafting the rest), and with the scheduler, which verifies as many as pay."""
    fixed = dspark_edge.load(tiny_engine, "fp32", scheduler=False, drafter="ngram+self")
    auto = _dear_passes(dspark_edge.load(tiny_engine, "fp32", drafter="ngram+self", telemetry=FakeReader()))
    for pipe, extra in ((fixed, {"draft_tokens": 3}), (auto, {})):
        d = pipe.drafter
        d.tried[:], d.accepted[:] = 1000, 400  # the copy: 40 % of its drafts accepted
        d.step_ms = 1e-3  # drafting with it is cheap: it drafts every round
        for text in PROMPTS[:4]:
            want = plain.generate(text, max_new_tokens=24, ignore_eos=True).token_ids
            for right in (True, False):
                d.ngram = _Guesser(want if right else [t + 1 for t in want], extend=True, propose=False)
                before = list(d.extended)
                r = pipe.generate(text, max_new_tokens=24, ignore_eos=True, **extra)
                assert r.token_ids == want, (text, right, extra)
                assert d.extended[0] > before[0] and d.ngram.extended[0] > 0
                # The continuations were judged: the right ones accepted, the wrong ones never.
                assert (d.ngram.extended[1] > 0) == right


def test_sampled_rounds_with_ngram_continuations_follow_the_target(tiny_engine):
    """Under rejection sampling an n-gram draft after the copy's is drawn from a point mass at
    itself; output still follows the target's distribution, with a fixed length and with the
    scheduler choosing the width."""
    prompt = "The quick brown fox The quick brown"
    plain = dspark_edge.load(tiny_engine, "fp32")
    # The greedy answer by position: likely tokens under the target (a continuation the target
    # never samples would be rejected whatever its distribution were taken to be).
    guesses = plain.generate(prompt, max_new_tokens=6, ignore_eos=True).token_ids
    for pipe, extra in ((dspark_edge.load(tiny_engine, "fp32", scheduler=False, drafter="ngram+self"),
                         {"draft_tokens": 2}),
                        (_dear_passes(dspark_edge.load(tiny_engine, "fp32", drafter="ngram+self",
                                                       telemetry=FakeReader())), {})):
        d = pipe.drafter
        d.tried[:], d.accepted[:] = 1000, 400
        d.step_ms = 1e-3
        d.ngram = _Guesser(guesses, extend=True, propose=False)
        exact = _exact_joint(pipe, pipe.encode_prompt(prompt), top_k=4, depth=4)
        before = list(d.extended)
        assert not _chi2_rejects(pipe, prompt, exact, 3000, 4, depth=4, **extra)
        assert d.extended[0] - before[0] >= 1000, d.extended
