"""The trained drafter to ONNX: one graph with a dynamic number of slots, listed in the
manifest at fixed block sizes; FP32, INT8 by dynamic quantization of its weights, and FP16
(for GPUs) by ONNX Runtime's float16 converter.

Graph (per round; m new committed positions, n = anchor position, γ slots):
    inputs   features [m, F]         target features of the newly committed positions
             anchor_embedding [1, H] the anchor's (target's) input embedding
             block_positions [γ]     n, n+1, …, n+γ-1  (γ and n come from here)
             past_key.{l}, past_value.{l} [kv, n-m, D]   the context cache so far
             head_table [V, H]       only in a graph exported with ``shared_head``: the target's
                                     embedding table, which is this drafter's LM head (a tied
                                     target; the runtime feeds the target's own mapped table)
    outputs  logits [γ, Vd]          base logits U (the target's LM head rows)
             hidden [γ, H]           h, for the confidence head
             present_key.{l}, present_value.{l} [kv, n, D]  the cache with the m positions appended
Block keys/values never leave the graph. The embedding table, the Markov head and the
confidence head live outside it (``tables.npz`` / ``embedding.npy``): the runtime does the
sequential step in numpy and reads one embedding row per round.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .model import DraftLayer, DSparkDraft, rope, rope_tables

HEAD_TABLE = "head_table"


def io_names(num_layers: int, shared_head: bool = False) -> tuple[list[str], list[str]]:
    ins = ["features", "anchor_embedding", "block_positions"]
    outs = ["logits", "hidden"]
    for i in range(num_layers):
        ins += [f"past_key.{i}", f"past_value.{i}"]
        outs += [f"present_key.{i}", f"present_value.{i}"]
    return ins + ([HEAD_TABLE] if shared_head else []), outs


def _rotation(d: int) -> torch.Tensor:
    """R [d, d] with x @ R = rotate_half(x) = [-x2, x1]: one MatMul node where slicing takes four,
    and exact (each output is one input times ±1 plus zeros)."""
    r = torch.zeros(d, d)
    half = d // 2
    r[torch.arange(half) + half, torch.arange(half)] = -1.0
    r[torch.arange(half), torch.arange(half) + half] = 1.0
    return r


class _Rope(nn.Module):
    """Rotary tables for a run of positions, computed once per round and shared by every layer
    (``model.rope`` recomputes them at each call: dozens of nodes a graph runs every round)."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.head_dim, self.theta = cfg.head_dim, cfg.rope_theta
        self.register_buffer("rot", _rotation(cfg.head_dim), persistent=False)

    def tables(self, pos: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """pos [S] → (cos, sin) [S, D], times ``scale`` (the queries' tables carry the attention's 1/√D)."""
        cos, sin = rope_tables(pos, self.head_dim, self.theta)
        return (cos * scale, sin * scale) if scale != 1.0 else (cos, sin)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [heads, S, D]: ``model.rope`` with the tables of x's positions."""
        return x * cos + (x @ self.rot) * sin


class _RoundLayer(nn.Module):
    """One ``DraftLayer`` over a round, written for few graph nodes (a round of the 2-layer
    drafter runs a few hundred small nodes otherwise, and on a CPU each costs microseconds
    whatever its size): 2-D activations reshaped with -1 (no shape arithmetic), the rotary
    tables of ``_Rope``, the attention scale folded into the queries' tables, and grouped-query
    attention by grouping the queries ([kv, rep·S, D]) instead of repeating keys and values.
    The same function as ``DraftLayer.forward`` with the context keys of ``context_kv``; the
    submodules keep their names, so the graph's node names (``/layers.N/q/MatMul``…) are those
    ``quantize_int8`` selects by."""

    def __init__(self, layer: DraftLayer) -> None:
        super().__init__()
        self.cfg = cfg = layer.cfg
        for name in ("in_norm", "q", "k", "v", "o", "post_norm", "gate", "up", "down"):
            setattr(self, name, getattr(layer, name))
        self.q_norm = layer.q_norm if cfg.qk_norm else None
        self.k_norm = layer.k_norm if cfg.qk_norm else None

    def _heads(self, x: torch.Tensor, proj: nn.Module, heads: int, norm: nn.Module | None) -> torch.Tensor:
        """[S, H] → [heads, S, D]"""
        y = proj(x).reshape(-1, heads, self.cfg.head_dim)
        return (y if norm is None else norm(y)).transpose(0, 1)

    def forward(self, x, ctx, past_k, past_v, rope: _Rope, ctx_rope, block_rope, query_rope):
        cfg = self.cfg
        k_ctx = rope.apply(self._heads(ctx, self.k, cfg.num_kv_heads, self.k_norm), *ctx_rope)
        present_k = torch.cat([past_k, k_ctx], 1)
        present_v = torch.cat([past_v, self._heads(ctx, self.v, cfg.num_kv_heads, None)], 1)
        y = self.in_norm(x)
        q = rope.apply(self._heads(y, self.q, cfg.num_heads, self.q_norm), *query_rope)  # scaled by 1/√D
        k = torch.cat([present_k, rope.apply(self._heads(y, self.k, cfg.num_kv_heads, self.k_norm), *block_rope)], 1)
        v = torch.cat([present_v, self._heads(y, self.v, cfg.num_kv_heads, None)], 1)
        # head h reads kv head h // rep (repeat_interleave): its queries are group h // rep's rows
        grouped = q.reshape(cfg.num_kv_heads, -1, cfg.head_dim)
        att = torch.softmax(grouped @ k.transpose(1, 2), -1) @ v
        att = att.reshape(cfg.num_heads, -1, cfg.head_dim).transpose(0, 1).reshape(-1, cfg.num_heads * cfg.head_dim)
        x = x + self.o(att)
        y = self.post_norm(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y)), present_k, present_v


class RoundGraph(nn.Module):
    def __init__(self, model: DSparkDraft, shared_head: bool = False) -> None:
        super().__init__()
        self.cfg, self.shared_head = model.cfg, shared_head
        self.fc, self.ctx_norm, self.norm, self.mask_embed = model.fc, model.ctx_norm, model.norm, model.mask_embed
        self.layers = nn.ModuleList(_RoundLayer(layer) for layer in model.layers)
        self.rope = _Rope(model.cfg)
        # The LM head rows as a parameter, so the graph holds them as an initializer that the
        # INT8 quantizer quantizes (the model keeps them in a non-persistent buffer, which
        # tracing would bake in as an FP32 Constant node: a full-vocabulary head of 113 MB
        # left FP32 in the INT8 graph). A shared head reads the ``head_table`` input instead.
        self.head_t = None if shared_head else nn.Parameter(model.head.T.contiguous(), requires_grad=False)

    def forward(self, features, anchor_embedding, block_positions, *rest):
        cfg = self.cfg
        past = rest[:2 * cfg.num_layers]
        ctx = self.ctx_norm(self.fc(features))  # [m, H]
        ctx_pos = block_positions[0] - features.shape[0] + torch.arange(features.shape[0], dtype=torch.int64)
        ctx_rope, block_rope = self.rope.tables(ctx_pos), self.rope.tables(block_positions)
        query_rope = self.rope.tables(block_positions, cfg.head_dim ** -0.5)
        x = torch.cat([anchor_embedding, self.mask_embed[None].expand(block_positions.shape[0] - 1, -1)], 0)
        presents = []
        for i, layer in enumerate(self.layers):
            x, k, v = layer(x, ctx, past[2 * i], past[2 * i + 1], self.rope, ctx_rope, block_rope, query_rope)
            presents += [k, v]
        h = self.norm(x)
        if self.shared_head:
            # [V, H] · [H, γ], then transposed: the table is read row-major as it lies, never
            # transposed itself (a Transpose of a 100 MB input would be a copy every round).
            return ((rest[-1] @ h.transpose(0, 1)).transpose(0, 1), h, *presents)
        return (h @ self.head_t, h, *presents)


def export_onnx(model: DSparkDraft, path: Path, shared_head: bool = False) -> None:
    """``shared_head``: the graph takes its LM head rows as the input ``head_table`` [V, H]
    (the target's embedding table, equal to them) instead of holding them."""
    cfg = model.cfg
    model.eval()
    graph = RoundGraph(model, shared_head)
    ins, outs = io_names(cfg.num_layers, shared_head)
    m, past_n, g = 5, 11, cfg.slots
    args = [torch.randn(m, cfg.feature_dim), torch.randn(1, cfg.hidden_size),
            torch.arange(past_n + m, past_n + m + g, dtype=torch.int64)]
    for _ in range(cfg.num_layers):
        args += [torch.randn(cfg.num_kv_heads, past_n, cfg.head_dim)] * 2
    if shared_head:
        args.append(model.head.detach().clone())
    dyn = {"features": {0: "new_positions"}, "block_positions": {0: "slots"},
           "logits": {0: "slots"}, "hidden": {0: "slots"}}
    for i in range(cfg.num_layers):
        dyn[f"past_key.{i}"] = dyn[f"past_value.{i}"] = {1: "past_length"}
        dyn[f"present_key.{i}"] = dyn[f"present_value.{i}"] = {1: "length"}
    with torch.no_grad():
        torch.onnx.export(graph, tuple(args), str(path), input_names=ins, output_names=outs, dynamic_axes=dyn,
                          opset_version=17, dynamo=False)


def quantize_int8(src: Path, dst: Path) -> list[str]:
    """Dynamic INT8 (weights per channel, activations per tensor at run time), except where
    that was measured to break the drafter (real features of the embedded default, top-1 vs the
    FP32 graph): the feature projection ``fc`` reads the target's hidden states, whose outlier
    channels (|x| up to ~25,000 against a std of ~100) leave every other channel at zero after
    per-tensor quantization (top-1 23 % with it quantized, 77 % without), and the last backbone
    layer, which writes the hidden state the LM head reads (77 % → 88 % kept in FP32). Returns
    the MatMuls kept in FP32."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from dspark_edge.errors import ExportError

    graph = onnx.load(str(src), load_external_data=False).graph
    matmuls = [n.name for n in graph.node if n.op_type == "MatMul"]
    layers = sorted({int(name.split("/")[1].split(".")[1]) for name in matmuls if name.startswith("/layers.")})
    keep = [name for name in matmuls if name.startswith("/fc/") or (layers and name.startswith(f"/layers.{layers[-1]}/"))]
    if not any(name.startswith("/fc/") for name in keep):
        raise ExportError(f"the drafter graph {src} has no /fc/ MatMul: its node names changed, so the "
                           "layers that must stay FP32 cannot be found")
    quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8, per_channel=True, nodes_to_exclude=keep)
    return keep


def convert_fp16(src: Path, dst: Path) -> None:
    """FP16 weights and arithmetic (ONNX Runtime's converter) for GPUs; inputs and outputs stay
    float32, so the runtime feeds it exactly like the FP32 graph."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    onnx.save_model(convert_float_to_float16(onnx.load(str(src)), keep_io_types=True), str(dst))


def tables(model: DSparkDraft) -> dict[str, np.ndarray]:
    """What the runtime's sequential step needs, as FP32 arrays."""
    f = lambda t: t.detach().cpu().numpy().astype(np.float32)  # noqa: E731
    return {"vocab_ids": model.vocab_ids.cpu().numpy().astype(np.int64),
            "markov_in": f(model.markov_in.weight), "markov_out": f(model.markov_out.weight.T),
            "conf_w": f(model.conf.weight[0]), "conf_b": f(model.conf.bias)}


def reference_round(model: DSparkDraft, features: torch.Tensor, anchor: int, n: int, slots: int):
    """PyTorch (logits, hidden) for one round from scratch: context = features [n, F]."""
    with torch.no_grad():
        ctx = model.context(features[None])
        kv = [layer.context_kv(ctx, torch.arange(n)[None]) for layer in model.layers]
        pos = torch.arange(n, n + slots)[None]
        h = model.block_hidden(torch.tensor([[anchor]]), pos, kv, None)[0]
        return model.base_logits(h).numpy(), h.numpy()


__all__ = ["HEAD_TABLE", "RoundGraph", "export_onnx", "quantize_int8", "convert_fp16", "tables", "reference_round", "io_names", "rope"]
