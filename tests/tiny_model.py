"""A tiny random Llama-architecture model with a real byte-level BPE tokenizer, built by the
tests themselves (no hub): a Hugging Face folder the exporter accepts like any other."""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "Speculative decoding drafts tokens and verifies them in one pass.",
    "Une phrase en français, avec des accents: é, è, à, ç.",
    "数字 1234567890 and symbols !@#$%^&*()",
] * 20
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def make_tiny_hf(folder: Path, seed: int = 0, vocab_size: int = 384, layers: int = 3, arch: str = "llama",
                 chat_template: bool = True, tied: bool = False) -> Path:
    """``arch`` "llama", or "qwen3" (per-head q/k norms, an explicit head_dim). ``tied``: the LM
    head is the input embedding (tie_word_embeddings), as in the embedded default."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(CORPUS, trainer)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                     unk_token="<|endoftext|>", pad_token="<|im_end|>")
    if chat_template:
        hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(folder)
    torch.manual_seed(seed)
    shape = dict(vocab_size=tk.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
                 tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2, pad_token_id=2, initializer_range=0.2)
    if arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **shape)).eval()
    else:
        model = LlamaForCausalLM(LlamaConfig(**shape)).eval()
    model.save_pretrained(folder)
    return folder


def fake_answer_work(work: Path, sequences) -> Path:
    """A drafter work folder holding one answer shard of (prompt ids, answer ids) pairs, in the
    layout ``python -m export ngram-table --work`` counts (features zeroed)."""
    import numpy as np

    (work / "data").mkdir(parents=True)
    toks = [np.asarray(p + a, dtype=np.int32) for p, a in sequences]
    n = sum(t.size for t in toks)
    np.savez(work / "data" / "shard-00000.npz", tokens=np.concatenate(toks),
             offsets=np.cumsum([0] + [t.size for t in toks]).astype(np.int64),
             prompt_lens=np.asarray([len(p) for p, _ in sequences], dtype=np.int32),
             aux=np.zeros((n, 1), np.float16), top_ids=np.zeros((n, 1), np.int32), top_logp=np.zeros((n, 1), np.float16))
    return work
