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
from torch import nn

from .model import DSparkDraft, rope


HEAD_TABLE = "head_table"


def io_names(num_layers: int, shared_head: bool = False) -> tuple[list[str], list[str]]:
    ins = ["features", "anchor_embedding", "block_positions"]
    outs = ["logits", "hidden"]
    for i in range(num_layers):
        ins += [f"past_key.{i}", f"past_value.{i}"]
        outs += [f"present_key.{i}", f"present_value.{i}"]
    return ins + ([HEAD_TABLE] if shared_head else []), outs


class RoundGraph(nn.Module):
    def __init__(self, model: DSparkDraft, shared_head: bool = False) -> None:
        super().__init__()
        self.m, self.shared_head = model, shared_head
        # The LM head rows as a parameter, so the graph holds them as an initializer that the
        # INT8 quantizer quantizes (the model keeps them in a non-persistent buffer, which
        # tracing would bake in as an FP32 Constant node: a full-vocabulary head of 113 MB
        # left FP32 in the INT8 graph). A shared head reads the ``head_table`` input instead.
        self.head_t = None if shared_head else nn.Parameter(model.head.T.contiguous(), requires_grad=False)

    def forward(self, features, anchor_embedding, block_positions, *rest):
        m = self.m
        past = rest[:2 * len(m.layers)]
        n_new = features.shape[0]
        ctx = m.context(features)[None]  # [1, m, H]
        ctx_pos = (block_positions[0] - n_new + torch.arange(n_new, dtype=torch.int64))[None]
        g = block_positions.shape[0]
        x = torch.cat([anchor_embedding, m.mask_embed[None].expand(g - 1, -1)], 0)[None]
        pos = block_positions[None]
        presents = []
        for i, layer in enumerate(m.layers):
            k_new, v_new = layer.context_kv(ctx, ctx_pos)
            k = torch.cat([past[2 * i][None], k_new], 2)
            v = torch.cat([past[2 * i + 1][None], v_new], 2)
            presents += [k[0], v[0]]
            x = layer(x, pos, k, v, None)
        h = m.norm(x)[0]
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
