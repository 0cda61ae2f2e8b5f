"""The whole path on a tiny random Llama: export → load → generate, against PyTorch."""

from __future__ import annotations

import numpy as np
import pytest

import dspark_edge
from dspark_edge import ConfigError, PromptError
from dspark_edge.manifest import read_manifest

PROMPTS = ["The quick brown fox", "def add(a, b):", "Une phrase", "数字 123"]


def torch_greedy(model, ids: list[int], n: int) -> list[int]:
    import torch

    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def pipe(tiny_engine):
    return dspark_edge.load(tiny_engine)


def test_manifest_records_validation_and_variants(tiny_engine):
    m = read_manifest(tiny_engine)
    assert m.precisions("target") == ["fp32", "int8"]
    assert m.widths("target", "fp32") == (1, 2, 3, 4)
    assert m.hidden_state_layers and all(1 <= i < m.model.num_layers for i in m.hidden_state_layers)
    fp32 = next(r for r in m.validation if r.precision == "fp32")
    assert fp32.passed and fp32.greedy_tokens_matched == fp32.greedy_tokens_compared
    assert fp32.max_abs_logit_diff < 1e-2
    # all widths of one precision share one graph file (weights shared)
    assert len({v.file for v in m.variants_for("target", "fp32")}) == 1


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_matches_pytorch(pipe, tiny_torch, prompt):
    ids = pipe.encode_prompt(prompt)
    expected = torch_greedy(tiny_torch, ids, 24)
    result = pipe.generate(prompt, max_new_tokens=24, stop_token_ids=())
    # the tiny model may emit its EOS; compare up to where generation stopped
    got = list(result.token_ids)
    assert got == expected[:len(got)]
    if result.stop_reason == "max_new_tokens":
        assert len(got) == 24


def test_stream_pieces_join_to_text(pipe):
    stream = pipe.stream("The quick", max_new_tokens=20)
    pieces = list(stream)
    assert "".join(pieces) == stream.result.text
    assert stream.result.stats.new_tokens == len(stream.result.token_ids)


def test_max_new_tokens_respected_and_zero(pipe):
    r = pipe.generate("The quick", max_new_tokens=5, temperature=1.0, seed=3)
    assert len(r.token_ids) <= 5
    r0 = pipe.generate("The quick", max_new_tokens=0)
    assert r0.token_ids == () and r0.text == "" and r0.stop_reason == "max_new_tokens"


def test_same_seed_same_output_and_greedy_ignores_seed(pipe):
    a = pipe.generate("Une", max_new_tokens=16, temperature=1.0, top_k=50, seed=7)
    b = pipe.generate("Une", max_new_tokens=16, temperature=1.0, top_k=50, seed=7)
    assert a.token_ids == b.token_ids
    g1 = pipe.generate("Une", max_new_tokens=16, seed=1)
    g2 = pipe.generate("Une", max_new_tokens=16, seed=2)
    assert g1.token_ids == g2.token_ids


def test_stop_string_cuts_text(pipe):
    full = pipe.generate("The quick", max_new_tokens=24, stop_token_ids=())
    if len(full.text) < 4:
        pytest.skip("tiny model produced too little text to pick a stop string")
    stop = full.text[2:4]
    r = pipe.generate("The quick", max_new_tokens=24, stop=(stop,))
    assert r.stop_reason == "stop_string"
    assert r.text == full.text[:full.text.find(stop)]


def test_eos_stops(pipe, tiny_engine):
    eos = read_manifest(tiny_engine).tokenizer.eos_ids[0]
    full = pipe.generate("The quick", max_new_tokens=12)
    # declare the 3rd generated token an end-of-turn id: generation must end right there
    stop_id = full.token_ids[2]
    r = pipe.generate("The quick", max_new_tokens=12, stop_token_ids=(stop_id,))
    assert r.stop_reason == "eos"
    assert r.token_ids[-1] == stop_id and list(r.token_ids) == list(full.token_ids[:full.token_ids.index(stop_id) + 1])
    assert eos in pipe.eos_ids


def test_chat_prompt_uses_template(pipe):
    ids = pipe.encode_prompt([{"role": "user", "content": "hi"}])
    text = pipe.tokenizer.decode(ids, skip_special_tokens=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("bad, match", [
    ("", "empty"), ("   \n", "whitespace"), ([], "non-empty list"),
    ([{"role": "wizard", "content": "x"}], "role 'wizard'"), ([{"content": "x"}], "exactly 'role' and 'content'"),
    ([{"role": "user", "content": 3}], "content must be a string"),
    (b"\xff\xfe bytes", "decode it to str"), ("ab\udcffc", "not valid Unicode"),
])
def test_bad_prompts_rejected(pipe, bad, match):
    with pytest.raises(PromptError, match=match):
        pipe.generate(bad)
    assert pipe.generate("The quick", max_new_tokens=2).token_ids  # still usable


@pytest.mark.parametrize("kw", [dict(max_new_tokens=-1), dict(temperature=-0.5), dict(top_p=0.0),
                                dict(top_p=1.5), dict(top_k=-1), dict(seed=-3)])
def test_bad_config_rejected(pipe, kw):
    with pytest.raises(ConfigError):
        pipe.generate("hello", **kw)


def test_context_overflow_policy(tiny_engine):
    small = dspark_edge.load(tiny_engine, options=dspark_edge.BackendOptions(max_context=16))
    long_prompt = "The quick brown fox jumps over the lazy dog. " * 4
    with pytest.raises(PromptError, match="context"):
        small.generate(long_prompt, max_new_tokens=4)
    r = small.generate(long_prompt, max_new_tokens=4, context_policy="truncate")
    assert r.stats.prompt_truncated > 0 and r.stats.prompt_tokens + r.stats.prompt_truncated > 16
    r2 = small.generate("The quick", max_new_tokens=100, stop_token_ids=())
    assert r2.stop_reason in ("context_full", "eos")


def test_unlisted_width_is_an_error(pipe):
    cache = pipe.target.new_cache()
    with pytest.raises(ConfigError, match="width 5"):
        pipe.target.step(cache, np.arange(5, dtype=np.int64))


def test_kv_rollback_reproduces_logits(pipe):
    """Writing drafts past the committed length and rolling back leaves no trace."""
    t = pipe.target
    cache = t.new_cache()
    prompt = np.asarray(pipe.encode_prompt("The quick brown"), dtype=np.int64)
    t.prefill(cache, prompt)
    base = cache.length
    clean = t.step(cache, np.array([5, 6], dtype=np.int64)).logits.copy()
    # pretend a width-4 verify wrote 4 positions, of which we keep 1
    t.step(cache, np.array([9, 10, 11, 12], dtype=np.int64))
    cache.commit(1)
    cache.rollback(base)
    again = t.step(cache, np.array([5, 6], dtype=np.int64)).logits
    np.testing.assert_array_equal(clean, again)


def test_width_k_equals_k_single_steps(pipe):
    """Verifying k tokens in one pass gives the logits of k single steps (FP32)."""
    t = pipe.target
    prompt = np.asarray(pipe.encode_prompt("def add(a, b):"), dtype=np.int64)
    new = np.array([7, 8, 9, 10], dtype=np.int64)
    c1 = t.new_cache()
    t.prefill(c1, prompt)
    wide = t.step(c1, new).logits.copy()
    c2 = t.new_cache()
    t.prefill(c2, prompt)
    singles = []
    for tok in new:
        singles.append(t.step(c2, np.array([tok])).logits[0].copy())
        c2.commit(1)
    np.testing.assert_allclose(wide, np.stack(singles), atol=1e-4)


def test_int8_variant_loads_and_generates(tiny_engine):
    p = dspark_edge.load(tiny_engine, precision="int8")
    assert p.target.precision == "int8"
    r = p.generate("The quick", max_new_tokens=8)
    assert 1 <= len(r.token_ids) <= 8


def test_unknown_precision_rejected(tiny_engine):
    with pytest.raises(ConfigError, match="int4"):
        dspark_edge.load(tiny_engine, precision="int4")


def test_failed_round_keeps_pipeline_usable(pipe, monkeypatch):
    from dspark_edge import GenerationError

    good = pipe.generate("The quick", max_new_tokens=8)
    calls = {"n": 0}
    real = pipe.target.step

    def flaky(cache, ids):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected fault")
        return real(cache, ids)

    monkeypatch.setattr(pipe.target, "step", flaky)
    with pytest.raises(GenerationError) as info:
        pipe.generate("The quick", max_new_tokens=8, stop_token_ids=())
    partial = info.value.partial
    assert partial.stop_reason == "error" and "injected fault" in partial.error
    assert list(partial.token_ids) == list(good.token_ids[:len(partial.token_ids)])
    monkeypatch.undo()
    assert pipe.generate("The quick", max_new_tokens=8).token_ids == good.token_ids


def test_concurrent_use_is_refused(pipe):
    from dspark_edge import DSparkError

    s1 = pipe.stream("The quick", max_new_tokens=30, stop_token_ids=())
    next(iter(s1), None)
    with pytest.raises(DSparkError, match="already generating"):
        pipe.generate("The quick", max_new_tokens=2)
    s1.cancel()
    list(s1)
    assert s1.result.stop_reason in ("cancelled", "eos", "max_new_tokens")
    pipe.generate("The quick", max_new_tokens=2)
