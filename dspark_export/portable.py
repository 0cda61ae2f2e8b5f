"""The portable decoder graph: standard ONNX operators only, for TensorRT and GPU providers
(Llama, Mistral, Qwen2 and Qwen3 decoders).

onnxruntime-genai's fused graph (the default ``--graph fused``) uses ONNX Runtime contrib
operators (GroupQueryAttention, SkipSimplifiedLayerNormalization, MatMulNBits) that TensorRT
cannot parse. This graph is the same Llama-family decoder traced from PyTorch with opset-17
operators only, so one file runs on ONNX Runtime (CPU, CUDA) and builds into a TensorRT engine.

KV layout "append" (sequence-major, one buffer of ``capacity`` positions per layer and K/V):

    inputs   input_ids [1, S]                    int64
             past_key.{l}, past_value.{l}       [1, L, kv_heads, head_dim]  the committed positions
    outputs  logits [1, S, V]                    float32
             hidden_states [1, S, H * k]         float32 (residual streams entering the exposed layers)
             new_key.{l}, new_value.{l}         [1, S, kv_heads, head_dim]  K/V of the S new tokens

Positions are L .. L+S-1 (L read from the past's shape). With a sequence-major buffer the
committed prefix is contiguous, so a runtime binds ``past`` to the buffer's start and ``new``
to the address right after the committed positions: the graph appends in place, no copy, and
rolling back is forgetting a length (``dspark_edge.backends.layout``).

FP16 comes from ONNX Runtime's float16 converter (KV in float16, logits/hidden kept float32);
INT8 is explicit QDQ quantization (``onnxruntime.quantization.quantize_static``) calibrated on
real prompts, which ONNX Runtime CPU runs and TensorRT builds as an INT8 engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np

from dspark_edge.errors import ExportError
from dspark_edge.manifest import GraphIO, ModelInfo

log = logging.getLogger(__name__)

PORTABLE_IO = GraphIO(input_ids="input_ids", attention_mask=None,
                      past_key="past_key.{layer}", past_value="past_value.{layer}",
                      present_key="new_key.{layer}", present_value="new_value.{layer}",
                      logits="logits", hidden_states="hidden_states", kv_layout="append")
PORTABLE_PRECISIONS = ("fp32", "fp16", "int8")
PORTABLE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # Hugging Face model_type
OPSET = 17
# A masked score: far below any real attention score, still finite in float16.
MASKED = -30000.0


def _decoder_module(model, info: ModelInfo, hidden_layers: tuple[int, ...]):
    import torch
    from torch import nn

    heads, kv_heads, head_dim = info.num_heads, info.num_kv_heads, info.head_dim
    rep = heads // kv_heads
    exposed = set(hidden_layers)
    qk_norm = hasattr(model.model.layers[0].self_attn, "q_norm")

    def rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat([-x[..., half:], x[..., :half]], dim=-1)

    class Decoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = model.model
            self.lm_head = model.lm_head

        def forward(self, input_ids, *past):
            body = self.body
            s = input_ids.shape[1]
            past_len = past[0].shape[1]
            pos = (torch.arange(s, dtype=torch.int64) + past_len)[None]  # [1, S]
            x = body.embed_tokens(input_ids)
            cos, sin = body.rotary_emb(x, pos)  # [1, S, D]
            cos, sin = cos[:, :, None, :], sin[:, :, None, :]
            total = torch.arange(past_len + s, dtype=torch.int64)[None, :]  # [1, T]
            mask = torch.where(total <= pos[0][:, None], 0.0, MASKED).to(x.dtype)  # [S, T]
            hidden, new_kv = [], []
            for i, layer in enumerate(body.layers):
                if i in exposed:
                    hidden.append(x)
                att = layer.self_attn
                h = layer.input_layernorm(x)
                q = att.q_proj(h).reshape(1, s, heads, head_dim)
                k = att.k_proj(h).reshape(1, s, kv_heads, head_dim)
                v = att.v_proj(h).reshape(1, s, kv_heads, head_dim)
                if qk_norm:  # Qwen3: each head's queries and keys RMS-normed before RoPE
                    q, k = att.q_norm(q), att.k_norm(k)
                q = q * cos + rotate_half(q) * sin
                k = k * cos + rotate_half(k) * sin
                new_kv += [k, v]
                keys = torch.cat([past[2 * i], k], dim=1)  # [1, T, kv, D]
                values = torch.cat([past[2 * i + 1], v], dim=1)
                t = keys.shape[1]
                keys = keys[:, :, :, None, :].expand(1, t, kv_heads, rep, head_dim).reshape(1, t, heads, head_dim)
                values = values[:, :, :, None, :].expand(1, t, kv_heads, rep, head_dim).reshape(1, t, heads, head_dim)
                scores = torch.matmul(q.transpose(1, 2), keys.permute(0, 2, 3, 1)) * (head_dim ** -0.5) + mask
                probs = torch.softmax(scores, dim=-1)
                ctx = torch.matmul(probs, values.transpose(1, 2)).transpose(1, 2).reshape(1, s, heads * head_dim)
                x = x + att.o_proj(ctx)
                x = x + layer.mlp(layer.post_attention_layernorm(x))
            logits = self.lm_head(body.norm(x))
            if not hidden:  # a draft model exposes nothing
                return (logits.float(), *new_kv)
            return (logits.float(), torch.cat(hidden, dim=-1).float(), *new_kv)

    return Decoder().eval()


def io_names(num_layers: int, hidden: bool = True) -> tuple[list[str], list[str]]:
    io = PORTABLE_IO
    kv = io.kv_names(num_layers)
    ins = [io.input_ids] + [past for past, _ in kv]
    outs = [io.logits] + ([io.hidden_states] if hidden else []) + [new for _, new in kv]
    return ins, outs


def check_supported(model) -> None:
    """The portable graph re-implements the Llama-family decoder (and Qwen3's per-head q/k
    norms); refuse anything else early."""
    cfg = model.config
    if cfg.model_type not in PORTABLE_FAMILIES:
        raise ExportError(f"--graph portable supports the decoders {', '.join(PORTABLE_FAMILIES)}, not "
                          f"{cfg.model_type!r}; export with --graph fused (onnxruntime-genai's builder) where "
                          "it has a builder for it")
    if getattr(cfg, "sliding_window", None) and cfg.model_type != "llama" and getattr(cfg, "use_sliding_window", True):
        raise ExportError("--graph portable has no sliding-window attention; export with --graph fused")
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        if not hasattr(model.model.layers[0].self_attn, name):
            raise ExportError(f"the model's attention has no {name}; --graph portable cannot trace it")


def export_fp32(model, info: ModelInfo, hidden_layers: tuple[int, ...], path: Path) -> None:
    """Trace ``model`` (FP32 PyTorch, shaped as ``info``) into the portable graph at ``path``
    (+ ``path``.data)."""
    import torch

    check_supported(model)
    module = _decoder_module(model, info, hidden_layers)
    n = info.num_layers
    ins, outs = io_names(n, bool(hidden_layers))
    s, past_len = 3, 5
    args = [torch.randint(0, info.vocab_size, (1, s), dtype=torch.int64)]
    args += [torch.randn(1, past_len, info.num_kv_heads, info.head_dim)] * (2 * n)
    dyn = {name: {1: "new_tokens"} for name in [ins[0], *outs]}
    for name in ins[1:]:
        dyn[name] = {1: "past_length"}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / "traced.onnx"
    with torch.no_grad():
        torch.onnx.export(module, tuple(args), str(tmp), input_names=ins, output_names=outs,
                          dynamic_axes=dyn, opset_version=OPSET, dynamo=False)
    _save_external(tmp, path)
    for f in path.parent.iterdir():
        if f.name.startswith("traced.onnx"):
            f.unlink()


def _save_external(src: Path, dst: Path) -> None:
    """Re-save with every weight in one ``<name>.data`` file next to the graph."""
    import onnx

    m = onnx.load(str(src))
    onnx.save_model(m, str(dst), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=dst.name + ".data", size_threshold=1024)


def convert_fp16(src: Path, dst: Path) -> None:
    """FP16 copy of the FP32 portable graph with ONNX Runtime's converter: weights, activations
    and the KV cache in float16, logits and hidden states kept float32."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    m = onnx.load(str(src))
    keep = [o.name for o in m.graph.output if o.name in (PORTABLE_IO.logits, PORTABLE_IO.hidden_states)]
    m16 = convert_float_to_float16(m, keep_io_types=keep, disable_shape_infer=True)
    dst.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(m16, str(dst), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=dst.name + ".data", size_threshold=1024)


def weight_matmuls(path: Path) -> list[str]:
    """The MatMul nodes INT8 quantizes: those with a weight, except the MLP down-projections
    and the LM head. Their inputs carry the few huge activation channels small LLMs have, and a
    per-tensor int8 scale for those destroys the rest: on the embedded default, quantizing every
    weight MatMul kept the FP32 argmax at 38% of positions, all but the down-projections 81%,
    all but those and the LM head 84% (bench/experiments/int8_sensitivity.py)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    weights = {i.name for i in model.graph.initializer}
    return [n.name for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in weights
            and "down_proj" not in n.name and "lm_head" not in n.name]


def quantize_int8(src: Path, dst: Path, sequences: list[list[int]], info: ModelInfo,
                  say: Callable[[str], None] = lambda m: None, nodes: list[str] | None = None) -> None:
    """Explicit INT8 (QDQ) copy of the FP32 portable graph: the weights of ``weight_matmuls``
    per channel and their input activations per tensor, symmetric int8 (what TensorRT's
    explicit quantization expects), calibrated on ``sequences`` (token ids of real prompts).
    ``nodes`` overrides which MatMuls are quantized (bench/experiments/int8_sensitivity.py compares choices)."""
    from onnxruntime.quantization import (CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType,
                                          quantize_static)

    if not sequences:
        raise ExportError("INT8 calibration needs at least one prompt")

    names = io_names(info.num_layers)[0]
    empty = np.zeros((1, 0, info.num_kv_heads, info.head_dim), dtype=np.float32)

    class Prompts(CalibrationDataReader):
        """Each prompt as one prefill from an empty cache."""

        def __init__(self) -> None:
            self.left = iter(sequences)

        def get_next(self) -> dict | None:
            seq = next(self.left, None)
            if seq is None:
                return None
            return {names[0]: np.asarray([seq], dtype=np.int64), **{n: empty for n in names[1:]}}

    dst.parent.mkdir(parents=True, exist_ok=True)
    say(f"      calibrating INT8 on {len(sequences)} prompts ({sum(map(len, sequences))} tokens)")
    quantize_static(str(src), str(dst), Prompts(), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QInt8, weight_type=QuantType.QInt8, per_channel=True,
                    nodes_to_quantize=weight_matmuls(src) if nodes is None else nodes, calibrate_method=CalibrationMethod.MinMax,
                    use_external_data_format=True,
                    extra_options={"ActivationSymmetric": True, "WeightSymmetric": True})
    _save_external(dst, dst)  # one weights file with a predictable name
    for f in dst.parent.iterdir():
        if f.is_file() and f.name not in (dst.name, dst.name + ".data"):
            f.unlink()
