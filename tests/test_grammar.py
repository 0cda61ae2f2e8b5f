"""Structured output on the tiny model: answers follow their grammar, and speculation keeps them
the answers plain decoding gives under it (greedy, coupled and rejection sampling)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

import dspark_edge
from dspark_edge import ConfigError, GenerationConfig, Grammar
from dspark_edge.drafters import Draft

pytest.importorskip("llguidance")

PROMPTS = ["The quick brown fox", "def add(a, b):", "Speculative decoding verifies", "数字 123 symbols"]
SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                           "size": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["colour", "size", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def plain(tiny_engine):
    return dspark_edge.load(tiny_engine)


@pytest.fixture(scope="module")
def spec(tiny_engine, tiny_draft_self):
    return dspark_edge.load(tiny_engine, scheduler=False, drafter=tiny_draft_self)


class ReplayDrafter:
    """Drafts the continuation of ``answer`` (token ids after the prompt) with every third draft
    replaced by ``wrong``: drafts the grammar allows, some accepted and some not."""

    name = "replay"

    def __init__(self, prompt_len: int, answer, wrong: int) -> None:
        self.start, self.answer, self.wrong = prompt_len, list(answer), wrong

    def begin(self, context) -> None:
        pass

    def propose(self, req, rng) -> Draft:
        at = len(req.context) - self.start  # answer tokens already decided, the pending one included
        ids = self.answer[at:at + req.max_tokens]
        ids = [self.wrong if (at + i) % 3 == 2 else t for i, t in enumerate(ids)]
        return Draft(np.asarray(ids, dtype=np.int64), None, np.ones(len(ids)))

    def feedback(self, drafted, accepted, context) -> None:
        pass


def test_answers_follow_a_json_schema_and_drafts_keep_them_plain(plain, tiny_engine):
    grammar = Grammar.json(SCHEMA, whitespace=False)
    accepted = 0
    for prompt in PROMPTS:
        want = plain.generate(prompt, max_new_tokens=60, grammar=grammar)
        ids = plain.encode_prompt(prompt)
        wrong = plain.encode_prompt('"')[0]  # allowed inside the JSON strings, rarely the answer's token
        spec = dspark_edge.load(tiny_engine, scheduler=False, drafter=ReplayDrafter(len(ids), want.token_ids, wrong))
        got = spec.generate(prompt, max_new_tokens=60, grammar=grammar, draft_tokens=3)
        assert got.token_ids == want.token_ids, prompt
        assert want.stop_reason == "eos", want  # the grammar completed and ended the answer
        value = json.loads(want.text)
        assert set(value) == {"colour", "size", "ok"} and value["colour"] in ("red", "green", "blue")
        assert isinstance(value["size"], int) and 0 <= value["size"] <= 99 and isinstance(value["ok"], bool)
        accepted += got.stats.draft_n_accepted
    assert accepted > 0  # drafts were verified under the grammar's masks, not only cut


def test_drafts_the_grammar_allows_are_judged_by_the_masked_target(plain, tiny_engine):
    grammar = Grammar.regex(r"[a-z]{12}")
    wrong = plain.encode_prompt("z")[0]
    accepted = rejected = 0
    for prompt in PROMPTS:
        want = plain.generate(prompt, max_new_tokens=16, grammar=grammar)
        assert re.fullmatch(r"[a-z]{12}", want.text)
        drafter = ReplayDrafter(len(plain.encode_prompt(prompt)), want.token_ids, wrong)
        got = dspark_edge.load(tiny_engine, scheduler=False, drafter=drafter).generate(
            prompt, max_new_tokens=16, grammar=grammar, draft_tokens=3)
        assert got.token_ids == want.token_ids, prompt
        accepted += got.stats.draft_n_accepted
        rejected += got.stats.draft_n - got.stats.draft_n_accepted
    assert accepted > 0 and rejected > 0  # "z" is in the grammar and rarely the target's letter


def test_the_text_a_grammar_forces_is_drafted_and_verified(plain, tiny_engine):
    """With no drafter, the tokens a grammar forces (a schema's keys, its punctuation) are drafted
    and verified in one pass: fewer passes, the same answer as decoding them one at a time."""
    schema = {"type": "object", "properties": {"temperature_celsius": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "description_of_the_weather": {"enum": ["sunny", "rainy"]}},
              "required": ["temperature_celsius", "description_of_the_weather"], "additionalProperties": False}
    grammar = Grammar.json(schema, whitespace=False)
    traced = []

    class Rounds:
        def on_round(self, info):
            traced.append(info)

    observer = Rounds()
    plain.add_observer(observer)
    try:
        for prompt in PROMPTS:
            traced.clear()
            one_by_one = plain.generate(prompt, max_new_tokens=60, grammar=grammar, speculative=False)
            assert all(r.drafted == 0 for r in traced)
            traced.clear()
            forced = plain.generate(prompt, max_new_tokens=60, grammar=grammar)
            assert forced.token_ids == one_by_one.token_ids and json.loads(forced.text)
            assert forced.stats.rounds < one_by_one.stats.rounds, prompt
            assert forced.stats.draft_n_accepted > 0
            assert sum((r.drafting or {}).get("grammar_forced", 0) for r in traced) == forced.stats.draft_n
    finally:
        plain.remove_observer(observer)


def test_a_regex_binds_every_token_and_ignore_eos_still_ends_a_complete_answer(plain, spec):
    grammar = Grammar.regex(r"(yes|no|maybe)\.")
    for prompt in PROMPTS:
        r = spec.generate(prompt, max_new_tokens=12, grammar=grammar, ignore_eos=True)
        assert re.fullmatch(r"(yes|no|maybe)\.", r.text), r.text
        assert r.stop_reason == "eos"
        assert r.token_ids == plain.generate(prompt, max_new_tokens=12, grammar=grammar, ignore_eos=True).token_ids
    free = plain.generate(PROMPTS[0], max_new_tokens=12, ignore_eos=True)
    assert not re.fullmatch(r"(yes|no|maybe)\.", free.text)  # the tiny model does not say it unasked


def test_a_max_new_tokens_reached_first_leaves_the_answer_incomplete(plain):
    r = plain.generate(PROMPTS[0], max_new_tokens=3, grammar=Grammar.regex(r"a{10}"))
    assert r.text == "a" * len(r.text) and r.stop_reason == "max_new_tokens" and len(r.token_ids) == 3


def test_gbnf_and_lark_grammars(plain):
    for grammar in (Grammar.gbnf('root ::= "on" | "off"'), Grammar.lark('start: "on" | "off"')):
        assert plain.generate(PROMPTS[1], max_new_tokens=8, grammar=grammar).text in ("on", "off")


class RefusedDrafter:
    """Drafts tokens the grammar never allows (and the target's own next token after them)."""

    name = "refused"

    def __init__(self, refused: int) -> None:
        self.refused = refused
        self.asked = 0

    def begin(self, context) -> None:
        pass

    def propose(self, req, rng) -> Draft:
        self.asked += 1
        k = req.max_tokens
        return Draft(np.full(k, self.refused, dtype=np.int64), None, np.ones(k))

    def feedback(self, drafted, accepted, context) -> None:
        pass


def test_drafts_the_grammar_refuses_never_reach_the_target(plain, tiny_engine):
    grammar = Grammar.regex(r"[0-9]{6}")
    digits = {i for i in range(plain.manifest.model.vocab_size)
              if re.fullmatch(r"[0-9]+", plain.tokenizer.decode([i]))}
    letter = next(i for i in range(plain.manifest.model.vocab_size) if plain.tokenizer.decode([i]) == "x")
    drafter = RefusedDrafter(letter)
    pipe = dspark_edge.load(tiny_engine, scheduler=False, drafter=drafter)
    r = pipe.generate(PROMPTS[2], max_new_tokens=10, grammar=grammar, draft_tokens=3)
    assert drafter.asked > 0 and r.stats.draft_n == 0 and set(r.stats.widths) == {"1"}
    assert set(r.token_ids[:-1]) <= digits and re.fullmatch(r"[0-9]{6}", r.text)
    assert r.token_ids == plain.generate(PROMPTS[2], max_new_tokens=10, grammar=grammar).token_ids


def test_coupled_sampling_under_a_grammar_depends_on_the_seed_alone(plain, spec):
    grammar = Grammar.json(SCHEMA, whitespace=False)
    kw = dict(max_new_tokens=60, temperature=1.0, sampling="coupled", grammar=grammar)
    for seed in range(3):
        want = plain.generate(PROMPTS[seed], seed=seed, **kw)
        assert spec.generate(PROMPTS[seed], seed=seed, **kw).token_ids == want.token_ids
        json.loads(want.text)


def _masked_joint(pipe, prompt_ids, grammar, depth, top_k):
    """Exact probabilities of the first ``depth`` sampled tokens under the grammar (T=1, top-k
    after the mask), walked with a fresh constraint per prefix."""
    from dspark_edge.grammar import Constraint
    from dspark_edge.sampling import probs

    t = pipe.target
    vocab = pipe.manifest.model.vocab_size
    tokens = pipe.tokenizer.grammar_tokens(vocab, pipe.eos_ids)
    out = {}

    def walk(prefix, prob):
        if len(prefix) == depth:
            out[tuple(prefix)] = prob
            return
        c = Constraint(grammar, tokens, vocab)
        c.take(prefix)
        _, _, masks = c.masks(())
        logits = t.prefill(t.new_cache(), np.asarray(prompt_ids + prefix, dtype=np.int64)).logits[-1:]
        p = probs(Constraint.apply(logits, masks)[0], 1.0, top_k, 1.0)
        for x in np.flatnonzero(p):
            walk(prefix + [int(x)], prob * p[x])

    walk([], 1.0)
    return out


@pytest.mark.parametrize("drafter", ["poor", "self", "dspark"])
def test_rejection_sampling_under_a_grammar_follows_the_masked_distribution(request, tiny_engine, drafter):
    """With a draft model, the INT8 copy and the DSpark drafter, each drawing under the grammar."""
    from test_speculative_tiny import _chi2_rejects

    engine, name = tiny_engine, drafter
    if drafter == "poor":
        name = request.getfixturevalue("tiny_draft_poor")
    elif drafter == "dspark":
        engine = request.getfixturevalue("tiny_with_drafter")[0]
    grammar = Grammar.regex(r"[a-z]+ [a-z]+ [a-z]+")
    prompt = "The quick brown fox The quick brown"
    pipe = dspark_edge.load(engine, scheduler=False, drafter=name)
    drafted = sum(pipe.generate(prompt, max_new_tokens=3, temperature=1.0, top_k=4, seed=s, grammar=grammar,
                                ignore_eos=True, draft_tokens=2).stats.draft_n for s in range(20))
    assert drafted > 0
    exact = _masked_joint(pipe, pipe.encode_prompt(prompt), grammar, 3, 4)
    assert all(re.fullmatch(r"[a-z ]+", pipe.tokenizer.decode(list(k))) for k in exact)
    assert not _chi2_rejects(pipe, prompt, exact, 2000, 4, grammar=grammar, draft_tokens=2)


def test_bad_grammars_are_config_errors_that_name_the_problem(monkeypatch):
    with pytest.raises(ConfigError, match="invalid regex grammar"):
        Grammar.regex("(unclosed")
    with pytest.raises(ConfigError, match="not JSON"):
        Grammar.json("{not json")
    with pytest.raises(ConfigError, match="invalid json grammar"):
        Grammar.json({"type": "no-such-type"})
    with pytest.raises(ConfigError, match="invalid gbnf grammar"):
        Grammar.gbnf("root ::= missing")
    with pytest.raises(ConfigError, match="grammar must be a dspark_edge.Grammar"):
        GenerationConfig(grammar=r"[0-9]+")
    import builtins

    real = builtins.__import__

    def no_llguidance(name, *args, **kw):
        if name == "llguidance":
            raise ImportError(name)
        return real(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_llguidance)
    with pytest.raises(ConfigError, match=r"pip install 'dspark-edge\[structured\]'"):
        Grammar.regex("[0-9]+")


def test_the_self_drafters_copy_drafts_under_the_grammar(plain, tiny_engine):
    """The INT8 copy draws its drafts from the tokens the grammar allows there: none is cut
    before the target pass, and the answer is plain decoding's under the grammar."""
    grammar = Grammar.regex(r"[a-z]+( [a-z]+){5}")
    pipe = dspark_edge.load(tiny_engine, scheduler=False, drafter="self")
    rounds = []
    pipe.add_observer(type("Obs", (), {"on_round": lambda self, info: rounds.append(info)})())
    want = plain.generate(PROMPTS[0], max_new_tokens=40, grammar=grammar)
    got = pipe.generate(PROMPTS[0], max_new_tokens=40, grammar=grammar, draft_tokens=3)
    assert got.token_ids == want.token_ids and re.fullmatch(r"[a-z]+( [a-z]+){5}", got.text)
    copied = [r for r in rounds if r.drafting and r.drafting.get("source") == "self" and r.drafting.get("copied")]
    assert copied and got.stats.draft_n > 0
    assert all(r.drafted == r.drafting["copied"] for r in copied)  # not one of the copy's drafts refused


class Checked:
    """A drafter whose every proposal is checked against the request's grammar rows."""

    def __init__(self, inner) -> None:
        self._inner, self.proposals = inner, 0

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def propose(self, request, rng):
        draft = self._inner.propose(request, rng)
        for i, t in enumerate(draft.tokens):
            row = request.allowed(draft.tokens[:i])
            assert row is not None and row[int(t)], f"draft {i} ({int(t)}) is refused by the grammar"
        self.proposals += len(draft) > 0
        return draft


@pytest.mark.parametrize("drafter", ["dspark", "draft model"])
def test_the_dspark_drafter_and_draft_models_draft_under_the_grammar(request, plain, tiny_engine, drafter):
    if drafter == "dspark":
        engine, name = request.getfixturevalue("tiny_with_drafter")[0], "dspark"
    else:
        engine, name = tiny_engine, request.getfixturevalue("tiny_draft_poor")
    grammar = Grammar.regex(r"[a-z]+( [a-z]+){5}")
    pipe = dspark_edge.load(engine, scheduler=False, drafter=name)
    pipe.drafter = checked = Checked(pipe.drafter)
    want = plain.generate(PROMPTS[0], max_new_tokens=40, grammar=grammar)
    got = pipe.generate(PROMPTS[0], max_new_tokens=40, grammar=grammar, draft_tokens=3)
    assert got.token_ids == want.token_ids and checked.proposals > 0
    sampled = pipe.generate(PROMPTS[0], max_new_tokens=40, grammar=grammar, draft_tokens=3, temperature=1.0, seed=3)
    assert re.fullmatch(r"[a-z]+( [a-z]+){5}", sampled.text) and checked.proposals > 1


def test_rows_after_drafts_refuse_what_follows_a_refused_or_final_draft(plain):
    """``Constraint.allowed_after``: the row after allowed drafts, None after a draft the grammar
    refuses or an end-of-turn draft (the matcher is never handed either), and the walk left where
    it was, so the pass's masks after it are the ones a fresh walk gives."""
    from dspark_edge.grammar import Constraint

    vocab = plain.manifest.model.vocab_size
    tokens = plain.tokenizer.grammar_tokens(vocab, plain.eos_ids)
    grammar = Grammar.regex(r"[0-9]{3}")
    digit = next(i for i in range(vocab) if plain.tokenizer.decode([i]) == "7")
    letter = next(i for i in range(vocab) if plain.tokenizer.decode([i]) == "x")
    eos = next(iter(plain.eos_ids))
    c = Constraint(grammar, tokens, vocab)
    first = c.allowed_after(())
    assert first[digit] and not first[letter]
    assert c.allowed_after([letter]) is None and c.allowed_after([letter, digit]) is None
    assert c.allowed_after([digit, digit, digit])[eos]  # complete: the end of turn is allowed
    assert c.allowed_after([digit, digit, digit, eos]) is None
    fresh = Constraint(grammar, tokens, vocab)
    assert np.array_equal(c.masks([digit, digit])[2], fresh.masks([digit, digit])[2])
    c.take([digit])  # the position moves: rows are computed afresh from there
    assert c.allowed_after([digit, digit])[eos] and not c.allowed_after([digit])[eos]
