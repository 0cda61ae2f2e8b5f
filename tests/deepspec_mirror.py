"""A PyTorch module with the parameter layout of DeepSpec's ``Qwen3DSparkModel`` (its
``__init__``: ``embed_tokens``, ``layers.N.self_attn.{q,k,v,o}_proj`` with per-head ``q_norm`` /
``k_norm``, ``layers.N.mlp.{gate,up,down}_proj``, the two layer norms, ``norm``, ``fc``,
``hidden_norm``, ``lm_head``, ``markov_head.markov_w1`` (an embedding) / ``markov_w2`` (a linear
map), ``confidence_head.proj``), built from a config.json alone. Loading a checkpoint into it with
``strict=True`` is what DeepSpec's ``from_pretrained`` needs: no missing and no unexpected keys,
every shape equal. Written from the layout, not from this project's exporter."""

from __future__ import annotations

from torch import nn


class _Norm(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(nn.init.ones_(nn.Parameter(__import__("torch").empty(n))))


class _Attention(nn.Module):
    def __init__(self, c: dict) -> None:
        super().__init__()
        h, d, bias = c["hidden_size"], c["head_dim"], c.get("attention_bias", False)
        self.q_proj = nn.Linear(h, c["num_attention_heads"] * d, bias=bias)
        self.k_proj = nn.Linear(h, c["num_key_value_heads"] * d, bias=bias)
        self.v_proj = nn.Linear(h, c["num_key_value_heads"] * d, bias=bias)
        self.o_proj = nn.Linear(c["num_attention_heads"] * d, h, bias=bias)
        self.q_norm, self.k_norm = _Norm(d), _Norm(d)


class _MLP(nn.Module):
    def __init__(self, c: dict) -> None:
        super().__init__()
        h, i = c["hidden_size"], c["intermediate_size"]
        self.gate_proj, self.up_proj = nn.Linear(h, i, bias=False), nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)


class _Layer(nn.Module):
    def __init__(self, c: dict) -> None:
        super().__init__()
        self.self_attn, self.mlp = _Attention(c), _MLP(c)
        self.input_layernorm, self.post_attention_layernorm = _Norm(c["hidden_size"]), _Norm(c["hidden_size"])


class _Markov(nn.Module):
    def __init__(self, vocab: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)


class _Confidence(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, 1)


class Qwen3DSparkLayout(nn.Module):
    def __init__(self, c: dict) -> None:
        super().__init__()
        h, v, r = c["hidden_size"], c["vocab_size"], c["markov_rank"]
        self.embed_tokens = nn.Embedding(v, h)
        self.layers = nn.ModuleList(_Layer(c) for _ in range(c["num_hidden_layers"]))
        self.norm = _Norm(h)
        self.fc = nn.Linear(h * len(c["target_layer_ids"]), h, bias=False)
        self.hidden_norm = _Norm(h)
        self.lm_head = nn.Linear(h, v, bias=False)
        if r > 0:
            self.markov_head = _Markov(v, r)
        if c["enable_confidence_head"]:
            self.confidence_head = _Confidence(h + (r if c.get("confidence_head_with_markov") else 0))
