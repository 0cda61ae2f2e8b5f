"""A tiny random DSpark drafter in DeepSpec's checkpoint format (``Qwen3DSparkModel``: config.json
and model.safetensors, DeepSpec's state-dict keys), made for the tests' tiny target: its
embeddings and LM head are the target's, as DeepSpec trains them (frozen copies)."""

from __future__ import annotations

import json
from pathlib import Path


def write_deepspec_checkpoint(folder: Path, target_hf: Path, *, layers: int = 1, block_size: int = 3,
                              markov_rank: int = 8, with_markov: bool = True, target_layer_ids=(0, 1),
                              seed: int = 0, confidence_head: bool = True, draft_vocab: int = 0,
                              **config) -> Path:
    """``confidence_head`` False: no confidence head (enable_confidence_head false, no tensors);
    ``draft_vocab`` > 0: a reduced draft vocabulary of that many tokens (the lowest ids, which the
    tiny target's specials and frequent tokens sit among, plus a random rest), written with the
    speculators / llama.cpp convention: ``lm_head`` and ``markov_w2`` over those rows, ``d2t``
    offsets and a ``t2d`` mask."""
    import torch
    from safetensors.torch import load_file, save_file

    folder.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((target_hf / "config.json").read_text())
    target = load_file(str(target_hf / "model.safetensors"))
    h, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // heads
    v, inter = cfg["vocab_size"], cfg["intermediate_size"]
    num_target = cfg["num_hidden_layers"]
    cfg.update(architectures=["Qwen3DSparkModel"], model_type="qwen3", num_hidden_layers=layers,
               num_target_layers=num_target, block_size=block_size, mask_token_id=v - 1,
               target_layer_ids=list(target_layer_ids), num_anchors=16, markov_rank=markov_rank,
               enable_confidence_head=confidence_head, tie_word_embeddings=False,
               head_dim=d, layer_types=["full_attention"] * layers, rope_theta=cfg.get("rope_theta", 10000.0))
    if markov_rank:
        cfg["markov_head_type"] = "vanilla"
    if confidence_head:
        cfg["confidence_head_with_markov"] = with_markov
    if draft_vocab:
        cfg["draft_vocab_size"] = draft_vocab
    cfg.update(config)
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.2):
        return (torch.randn(*shape, generator=g) * scale).contiguous()

    def norm(n):
        return (1.0 + 0.1 * torch.randn(n, generator=g)).contiguous()

    ids = torch.arange(v)
    if draft_vocab:
        rest = torch.randperm(v - draft_vocab // 2, generator=g)[: draft_vocab - draft_vocab // 2] + draft_vocab // 2
        ids = torch.cat([torch.arange(draft_vocab // 2), rest]).sort().values
    vd = ids.numel()
    w = {"embed_tokens.weight": target["model.embed_tokens.weight"].float().clone(),
         # a tied target stores its head once, as the embedding
         "lm_head.weight": target.get("lm_head.weight", target["model.embed_tokens.weight"]).float()[ids].clone(),
         "fc.weight": rand(h, h * len(target_layer_ids), scale=0.05), "hidden_norm.weight": norm(h),
         "norm.weight": norm(h)}
    if confidence_head:
        w["confidence_head.proj.weight"] = rand(1, h + (markov_rank if with_markov else 0))
        w["confidence_head.proj.bias"] = rand(1)
    if draft_vocab:
        w["d2t"] = (ids - torch.arange(vd)).to(torch.int64)
        w["t2d"] = torch.zeros(v, dtype=torch.bool).index_fill_(0, ids, True)
    if markov_rank:
        w["markov_head.markov_w1.weight"] = rand(v, markov_rank, scale=1.0)
        w["markov_head.markov_w2.weight"] = rand(vd, markov_rank, scale=0.5)
    for i in range(layers):
        p = f"layers.{i}."
        w |= {p + "self_attn.q_proj.weight": rand(heads * d, h), p + "self_attn.k_proj.weight": rand(kv * d, h),
              p + "self_attn.v_proj.weight": rand(kv * d, h), p + "self_attn.o_proj.weight": rand(h, heads * d),
              p + "self_attn.q_norm.weight": norm(d), p + "self_attn.k_norm.weight": norm(d),
              p + "input_layernorm.weight": norm(h), p + "post_attention_layernorm.weight": norm(h),
              p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
              p + "mlp.down_proj.weight": rand(h, inter)}
    save_file({k: t.to(torch.bfloat16) if k.startswith("layers.0.mlp") else t.contiguous() for k, t in w.items()},
              str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    return folder
