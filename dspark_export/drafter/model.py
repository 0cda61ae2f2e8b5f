"""The DSpark block drafter in PyTorch (training and ONNX export; the runtime never imports it).

Shapes (H hidden, F = H * feature layers, γ slots, Vd draft vocabulary, r Markov rank):

- context:  target features [n, F] → fc → RMSNorm → C [n, H]; each layer projects C to its
  context keys/values (RoPE at the true positions 0..n-1). Computed once per committed position.
- block:    [anchor, mask × (γ-1)] embeddings at positions n..n+γ-1 → ``layers`` transformer
  layers (queries attend to every context position and, non-causally, to every slot; with
  ``qk_norm``, as in Qwen3 layers and DeepSpec checkpoints, each head's queries and keys are
  RMS-normed before RoPE) → final norm → h [γ, H] → base logits U = h · head^T [γ, Vd] (the target's frozen LM head rows).
- Markov:   B_k = W2 · W1[x_{k-1}] ([Vd]); x_0 is the anchor. p_k = softmax(U_k + B_k).
- confidence: c_k = sigmoid(w · [h_k ; W1[x_{k-1}]] + b).

Slot k (0-based) predicts the token at position n+k+1, so γ slots give γ drafts and a block
of γ drafts is verified at width γ+1. The draft vocabulary is the Vd tokens the target
emits most often (``vocab_ids``); a token outside it maps to the extra Markov row Vd.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class DraftConfig:
    hidden_size: int = 576
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    intermediate_size: int = 1536
    num_layers: int = 2
    feature_layers: tuple[int, ...] = (8, 15, 22)
    rms_eps: float = 1e-5
    rope_theta: float = 100000.0
    slots: int = 7
    draft_vocab: int = 8192
    markov_rank: int = 128
    qk_norm: bool = False  # per-head RMSNorm of queries and keys before RoPE (Qwen3 layers, DeepSpec's format)
    attention_bias: bool = False  # biases on the q/k/v/o projections

    @property
    def feature_dim(self) -> int:
        return self.hidden_size * len(self.feature_layers)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["feature_layers"] = list(self.feature_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "DraftConfig":
        d = dict(d)  # a drafter saved before qk_norm / attention_bias existed has neither
        d["feature_layers"] = tuple(d["feature_layers"])
        return cls(**d)


def rope_tables(pos: torch.Tensor, d: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary (cos, sin) tables of positions ``pos`` [...] → [..., D] each (the half-split
    form llama uses: each angle twice)."""
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=pos.device) / d))
    ang = pos.to(torch.float32).unsqueeze(-1) * inv  # [.., S, D/2]
    return torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (the half-split form llama uses). x [..., S, D], pos [S] or [B, S]."""
    d = x.shape[-1]
    cos, sin = rope_tables(pos, d, theta)
    if cos.dim() == 3:  # [B, S, D] → [B, 1, S, D] for head broadcasting
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.in_norm = RMSNorm(h, cfg.rms_eps)
        bias = cfg.attention_bias
        self.q = nn.Linear(h, cfg.num_heads * d, bias=bias)
        self.k = nn.Linear(h, cfg.num_kv_heads * d, bias=bias)
        self.v = nn.Linear(h, cfg.num_kv_heads * d, bias=bias)
        self.o = nn.Linear(cfg.num_heads * d, h, bias=bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_eps)
            self.k_norm = RMSNorm(d, cfg.rms_eps)
        self.post_norm = RMSNorm(h, cfg.rms_eps)
        self.gate = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, h, bias=False)

    def context_kv(self, ctx: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ctx [B, n, H] (already normed), pos [B, n] → K, V [B, kv_heads, n, D] (K roped)."""
        b, n, _ = ctx.shape
        k = self._norm_k(self.k(ctx).view(b, n, self.cfg.num_kv_heads, self.cfg.head_dim)).transpose(1, 2)
        v = self.v(ctx).view(b, n, self.cfg.num_kv_heads, self.cfg.head_dim).transpose(1, 2)
        return rope(k, pos, self.cfg.rope_theta), v

    def _norm_q(self, q: torch.Tensor) -> torch.Tensor:
        return self.q_norm(q) if self.cfg.qk_norm else q

    def _norm_k(self, k: torch.Tensor) -> torch.Tensor:
        return self.k_norm(k) if self.cfg.qk_norm else k

    def forward(self, x: torch.Tensor, pos: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        """x [B, S, H] block slots at ``pos`` [B, S]; mask [B, 1, S, n + S] bool (True = attend)."""
        cfg, (b, s, _) = self.cfg, x.shape
        y = self.in_norm(x)
        q = rope(self._norm_q(self.q(y).view(b, s, cfg.num_heads, cfg.head_dim)).transpose(1, 2), pos, cfg.rope_theta)
        k = rope(self._norm_k(self.k(y).view(b, s, cfg.num_kv_heads, cfg.head_dim)).transpose(1, 2), pos,
                 cfg.rope_theta)
        v = self.v(y).view(b, s, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        k, v = torch.cat([ctx_k, k], 2), torch.cat([ctx_v, v], 2)
        rep = cfg.num_heads // cfg.num_kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.o(att.transpose(1, 2).reshape(b, s, cfg.num_heads * cfg.head_dim))
        y = self.post_norm(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


class DSparkDraft(nn.Module):
    def __init__(self, cfg: DraftConfig, embed: torch.Tensor, head: torch.Tensor, vocab_ids: torch.Tensor,
                 final_norm: torch.Tensor | None = None) -> None:
        """``embed`` [V, H] and ``head`` [V, H]: the target's (frozen, not trained, not saved with
        the drafter); ``vocab_ids`` [Vd]: target ids of the draft vocabulary."""
        super().__init__()
        self.cfg = cfg
        h, r, vd = cfg.hidden_size, cfg.markov_rank, cfg.draft_vocab
        self.fc = nn.Linear(cfg.feature_dim, h, bias=False)
        self.ctx_norm = RMSNorm(h, cfg.rms_eps)
        self.mask_embed = nn.Parameter(embed.float().std() * torch.randn(h))
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(h, cfg.rms_eps)
        if final_norm is not None:
            with torch.no_grad():
                self.norm.weight.copy_(final_norm)
        self.markov_in = nn.Embedding(vd + 1, r)
        self.markov_out = nn.Linear(r, vd, bias=False)
        nn.init.normal_(self.markov_in.weight, std=1.0 / math.sqrt(r))
        nn.init.zeros_(self.markov_out.weight)  # starts as "no bias": U alone
        self.conf = nn.Linear(h + r, 1)
        self.register_buffer("embed", embed.float(), persistent=False)
        self.register_buffer("head", head.float()[vocab_ids], persistent=False)
        self.register_buffer("vocab_ids", vocab_ids.long())
        to_draft = torch.full((embed.shape[0],), vd, dtype=torch.long)
        to_draft[vocab_ids] = torch.arange(vd)
        self.register_buffer("to_draft", to_draft, persistent=False)

    def grow(self, extra: int) -> None:
        """Append ``extra`` layers after the last one, each starting as the identity: a copy of
        the last layer with its attention output and MLP down projections zeroed, so both
        residual branches add nothing and the grown drafter computes exactly what it computed
        before. Training then has the new layers' capacity to fill, from that point on, instead
        of from a random start."""
        if extra < 0:
            raise ValueError(f"cannot grow by {extra} layers")
        cfg = replace(self.cfg, num_layers=self.cfg.num_layers + extra)
        for _ in range(extra):
            layer = DraftLayer(cfg).to(self.fc.weight.device)
            layer.load_state_dict(self.layers[-1].state_dict())
            with torch.no_grad():
                for proj in (layer.o, layer.down):
                    proj.weight.zero_()
                    if proj.bias is not None:
                        proj.bias.zero_()
            self.layers.append(layer)
        self._reconfigure(cfg)

    def widen(self, feature_layers: tuple[int, ...]) -> None:
        """Read the target streams ``feature_layers``, a superset of the ones read now: the
        context projection gains zero columns for the new streams (the old streams' columns move
        to their places in the new order), so the widened drafter computes exactly what it
        computed before and training decides what the new streams are worth."""
        old, new = tuple(self.cfg.feature_layers), tuple(feature_layers)
        lost = [s for s in old if s not in new]
        if lost or len(set(new)) != len(new):
            raise ValueError(f"cannot widen streams {list(old)} to {list(new)}: "
                             + (f"{lost} would be dropped" if lost else "a stream is named twice"))
        h, w = self.cfg.hidden_size, self.fc.weight.detach()
        fc = nn.Linear(h * len(new), h, bias=False).to(w.device)
        with torch.no_grad():
            fc.weight.zero_()
            for i, s in enumerate(old):
                j = new.index(s)
                fc.weight[:, j * h:(j + 1) * h] = w[:, i * h:(i + 1) * h]
        self.fc = fc
        self._reconfigure(replace(self.cfg, feature_layers=new))

    def _reconfigure(self, cfg: DraftConfig) -> None:
        """The drafter and each of its layers now describe themselves by ``cfg``."""
        self.cfg = cfg
        for layer in self.layers:
            layer.cfg = cfg

    def trainable_state(self) -> dict:
        """What a checkpoint stores: everything but the target's frozen tables."""
        return {k: v for k, v in self.state_dict().items()}

    # --- the parallel stage -------------------------------------------------------------------
    def context(self, features: torch.Tensor) -> torch.Tensor:
        """[.., n, F] target features → [.., n, H] context states."""
        return self.ctx_norm(self.fc(features))

    def block_hidden(self, anchors: torch.Tensor, pos: torch.Tensor, ctx_kv: list, mask) -> torch.Tensor:
        """anchors [B, A] target ids; pos [B, A*γ] positions of the slots; ctx_kv per layer
        (K, V) [B, kv, n, D]; mask [B, 1, A*γ, n + A*γ] → h [B, A*γ, H] after the final norm."""
        b, a = anchors.shape
        g = pos.shape[1] // a
        x = self.mask_embed.expand(b, a, g, -1).clone()
        x[:, :, 0] = self.embed[anchors]
        x = x.reshape(b, a * g, -1)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            x = layer(x, pos, k, v, mask)
        return self.norm(x)

    def base_logits(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.head.T

    # --- the sequential stage -----------------------------------------------------------------
    def markov(self, prev_draft_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """prev [..] draft-vocabulary indices (Vd = outside) → (bias [.., Vd], W1 row [.., r])."""
        e = self.markov_in(prev_draft_idx)
        return self.markov_out(e), e

    def confidence_logit(self, h: torch.Tensor, markov_row: torch.Tensor) -> torch.Tensor:
        return self.conf(torch.cat([h, markov_row], -1)).squeeze(-1)
