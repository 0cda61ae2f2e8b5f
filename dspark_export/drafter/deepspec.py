"""DSpark drafters in DeepSpec's checkpoint format (``deepseek-ai/DeepSpec``), the format the
DSpark serving engines load: read, checked against the target, converted into this project's
drafter, and a PyTorch reference of the format's own forward to validate the conversion.

A checkpoint folder holds ``config.json`` (the target's text config with ``architectures:
["Qwen3DSparkModel"]``, ``num_hidden_layers`` = drafter layers, ``block_size``, ``mask_token_id``,
``target_layer_ids``, ``num_target_layers``, ``markov_rank``, ``markov_head_type``,
``enable_confidence_head``, ``confidence_head_with_markov``; optionally ``draft_vocab_size``) and
safetensors weights (``model.safetensors``, or shards listed by ``model.safetensors.index.json``).

The forward, per round (n committed positions, anchor x_0 at position n, b = ``block_size``):

- context: C = hidden_norm(fc(concat of the target's layer outputs)) for positions 0..n-1
  (DeepSpec's id i is the output of target layer i: this project's stream entering layer i+1);
- block: embed_tokens([x_0, mask × (b-1)]) at positions n..n+b-1 through Qwen3 layers whose
  queries attend to every context position (keys and values from the layer's own k/v
  projections of C, per-head RMSNorm on q and k, RoPE at the true positions) and, without a
  causal mask, to every slot; final norm → h [b, H] → base logits lm_head(h);
- slot k predicts the token at n+k+1: logits_k + markov_w2(markov_w1[x_{k-1}]) (greedy x_k),
  confidence logit proj([h_k ; markov_w1[x_{k-1}]]) (or proj(h_k) without the Markov input).
- without a confidence head (``enable_confidence_head`` false), slot k's confidence is the draft
  distribution's largest probability, softmax(logits_k + bias_k).max(), as a logit: like the
  head's it is known before x_k is drawn, and the scheduler's online offset calibrates it.
- a reduced draft vocabulary (``draft_vocab_size`` < ``vocab_size``, the speculators / EAGLE-3
  convention llama.cpp's converter accepts): ``lm_head`` and ``markov_w2`` have ``draft_vocab_size``
  rows, an int64 tensor ``d2t`` maps draft index i to target id i + d2t[i] (``t2d``, if present,
  is ignored), and ``markov_w1`` stays indexed by target id (the anchor may lie outside the draft
  vocabulary).

Supported: Qwen3 layers, the vanilla Markov head or none, a confidence head or none, the full or
a ``d2t`` draft vocabulary. Refused by name (nothing written): the gated and rnn Markov heads,
RoPE scaling, sliding-window layers, other architectures.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from dspark_edge.errors import ExportError

ARCHITECTURE = "Qwen3DSparkModel"
CONFIG = "config.json"
CALIBRATION = "dspark_calibration.json"  # this project's side file: per-position temperatures and biases
MAX_CONFIG_BYTES = 1 << 20


def is_deepspec(folder: Path) -> bool:
    """Whether ``folder`` looks like a DeepSpec DSpark checkpoint (its config names a DSpark
    architecture); the checks that it is a usable one come in ``read_config``."""
    path = Path(folder) / CONFIG
    try:
        if not path.is_file() or path.stat().st_size > MAX_CONFIG_BYTES:
            return False
        arch = json.loads(path.read_text(encoding="utf-8")).get("architectures")
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(arch, list) and any(isinstance(a, str) and a.endswith("DSparkModel") for a in arch)


@dataclass(frozen=True)
class DeepSpecConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_eps: float
    rope_theta: float
    attention_bias: bool
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    markov_rank: int  # 0: no Markov head
    confidence_with_markov: bool
    confidence_head: bool = True  # False: the draft distribution's largest probability stands in
    draft_vocab_size: int = 0  # 0: the full vocabulary; else rows of lm_head / markov_w2, mapped by d2t

    @property
    def draft_rows(self) -> int:
        return self.draft_vocab_size or self.vocab_size

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target streams this project's engines expose for these ids (stream i+1 enters
        layer i+1, i.e. leaves layer i; -1, the embedding output, is stream 0)."""
        return tuple(i + 1 for i in self.target_layer_ids)


def _field(raw: dict, name: str, kind, path: Path, *, low=None, default=None):
    value = raw.get(name, default)
    if value is None:
        raise ExportError(f"{path} lacks {name!r}, which a DeepSpec DSpark config carries; it is not a complete "
                          "DeepSpec checkpoint")
    ok = isinstance(value, bool) if kind is bool else (
        isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float else
        isinstance(value, int) and not isinstance(value, bool))
    if not ok or (kind is float and not math.isfinite(value)) or (low is not None and value < low):
        need = {bool: "true or false", float: "a finite number", int: "an integer"}[kind]
        raise ExportError(f"{path}: {name} must be {need}" + (f" of at least {low}" if low is not None else "")
                          + f", got {value!r}")
    return kind(value)


def read_config(folder: Path) -> DeepSpecConfig:
    """The checkpoint's config, every field this importer uses checked (an untrusted file)."""
    path = Path(folder) / CONFIG
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ExportError(f"{path} is {path.stat().st_size} bytes, more than a config holds; not reading it")
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ExportError(f"{path} cannot be read as JSON ({exc}); point --weights at a DeepSpec checkpoint "
                          "folder") from exc
    if not isinstance(raw, dict):
        raise ExportError(f"{path} is not a JSON object")
    arch = [a for a in raw.get("architectures") or [] if isinstance(a, str)]
    if ARCHITECTURE not in arch:
        raise ExportError(f"{path} describes {arch or 'no architecture'}; only {ARCHITECTURE} DSpark drafters "
                          "import (Qwen3 layers; other DSpark families are not supported yet)")
    mtype = str(raw.get("markov_head_type", "vanilla")).lower()
    rank = _field(raw, "markov_rank", int, path, low=0)
    if rank > 0 and mtype != "vanilla":
        raise ExportError(f"{path}: markov_head_type {mtype!r} is not supported (the vanilla Markov head is: "
                          "its step is a table lookup the runtime does outside the graph; the gated and rnn "
                          "heads read the backbone state)")
    with_head = _field(raw, "enable_confidence_head", bool, path)
    vocab = _field(raw, "vocab_size", int, path, low=2)
    draft_vocab = _field({"draft_vocab_size": raw.get("draft_vocab_size") or vocab}, "draft_vocab_size", int, path,
                         low=1)
    if draft_vocab > vocab:
        raise ExportError(f"{path}: draft_vocab_size {draft_vocab} exceeds vocab_size {vocab}")
    scaling = raw.get("rope_scaling") or (raw.get("rope_parameters") or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if isinstance(scaling, dict) else scaling
    if rope_type not in (None, "default"):
        raise ExportError(f"{path}: RoPE scaling {rope_type!r} is not supported (plain RoPE is)")
    if raw.get("use_sliding_window") or any(t != "full_attention" for t in raw.get("layer_types") or []):
        raise ExportError(f"{path}: sliding-window layers are not supported (DeepSpec drafters use full attention)")
    theta = raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta")
                    if isinstance(raw.get("rope_parameters"), dict) else None)
    hidden = _field(raw, "hidden_size", int, path, low=1)
    heads = _field(raw, "num_attention_heads", int, path, low=1)
    kv = _field(raw, "num_key_value_heads", int, path, low=1, default=heads)
    if heads % kv:
        raise ExportError(f"{path}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    ids = raw.get("target_layer_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ExportError(f"{path}: target_layer_ids must be a non-empty list of integers, got {ids!r}")
    n_target = _field(raw, "num_target_layers", int, path, low=1)
    if any(not -1 <= i < n_target for i in ids) or any(a >= b for a, b in zip(ids, ids[1:])):
        raise ExportError(f"{path}: target_layer_ids {ids} must increase strictly within [-1, {n_target - 1}]")
    cfg = DeepSpecConfig(
        hidden_size=hidden, num_layers=_field(raw, "num_hidden_layers", int, path, low=1), num_heads=heads,
        num_kv_heads=kv, head_dim=_field(raw, "head_dim", int, path, low=2, default=hidden // heads),
        intermediate_size=_field(raw, "intermediate_size", int, path, low=1),
        vocab_size=vocab,
        rms_eps=_field(raw, "rms_norm_eps", float, path, low=0),
        rope_theta=_field({"rope_theta": theta}, "rope_theta", float, path, low=1),
        attention_bias=_field(raw, "attention_bias", bool, path, default=False),
        block_size=_field(raw, "block_size", int, path, low=1),
        mask_token_id=_field(raw, "mask_token_id", int, path, low=0),
        target_layer_ids=tuple(ids), num_target_layers=n_target, markov_rank=rank,
        confidence_with_markov=with_head and rank > 0 and _field(raw, "confidence_head_with_markov", bool, path),
        confidence_head=with_head, draft_vocab_size=0 if draft_vocab == vocab else draft_vocab)
    if cfg.head_dim % 2:
        raise ExportError(f"{path}: head_dim {cfg.head_dim} is odd; RoPE needs an even head size")
    if cfg.mask_token_id >= cfg.vocab_size:
        raise ExportError(f"{path}: mask_token_id {cfg.mask_token_id} is outside the vocabulary "
                          f"({cfg.vocab_size} tokens)")
    return cfg


def check_against_target(cfg: DeepSpecConfig, manifest, engine: Path, folder: Path) -> None:
    """Refuse a drafter made for another target before any work, naming the fix."""
    m = manifest.model
    for what, mine, theirs in (("hidden size", cfg.hidden_size, m.hidden_size),
                               ("vocabulary", cfg.vocab_size, m.vocab_size),
                               ("target layers (num_target_layers)", cfg.num_target_layers, m.num_layers)):
        if mine != theirs:
            raise ExportError(f"{folder} was made for a target with {what} {mine}, but {engine} holds {m.name} "
                              f"with {theirs}; import a drafter made for this target")
    streams = cfg.feature_layers
    bad = [i for i, s in zip(cfg.target_layer_ids, streams) if not 1 <= s < m.num_layers]
    if bad:
        raise ExportError(f"{folder} reads target_layer_ids {bad}, which this project's engines cannot expose "
                          f"(the embedding output and the last layer's output are not exported: streams 1.."
                          f"{m.num_layers - 1}, i.e. DeepSpec ids 0..{m.num_layers - 2})")
    if tuple(manifest.hidden_state_layers) != streams:
        kind, _, path = m.source.partition(":")
        precisions = manifest.precisions("target")
        widths = manifest.widths("target", precisions[0])
        raise ExportError(
            f"{folder} reads the outputs of target layers {list(cfg.target_layer_ids)} (DeepSpec ids), the streams "
            f"{list(streams)} here, but {engine} exposes {list(manifest.hidden_state_layers) or 'none'}; re-export "
            f"the target with them: python -m export target --source {'default' if kind == 'default' else path} "
            f"--output {engine} --overwrite --precisions {','.join(precisions)} "
            f"--widths {','.join(map(str, widths))} --hidden-layers {','.join(map(str, streams))}")


def expected_shapes(cfg: DeepSpecConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this config holds, by DeepSpec's state-dict key."""
    h, d, v, r, vd = cfg.hidden_size, cfg.head_dim, cfg.vocab_size, cfg.markov_rank, cfg.draft_rows
    shapes = {"embed_tokens.weight": (v, h), "fc.weight": (h, h * len(cfg.target_layer_ids)),
              "hidden_norm.weight": (h,), "norm.weight": (h,), "lm_head.weight": (vd, h)}
    if cfg.confidence_head:
        shapes |= {"confidence_head.proj.weight": (1, h + (r if cfg.confidence_with_markov else 0)),
                   "confidence_head.proj.bias": (1,)}
    if cfg.draft_vocab_size:
        shapes["d2t"] = (vd,)
    if r:
        shapes |= {"markov_head.markov_w1.weight": (v, r), "markov_head.markov_w2.weight": (vd, r)}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        proj = {"q_proj": (cfg.num_heads * d, h), "k_proj": (cfg.num_kv_heads * d, h),
                "v_proj": (cfg.num_kv_heads * d, h), "o_proj": (h, cfg.num_heads * d)}
        for name, shape in proj.items():
            shapes[f"{p}self_attn.{name}.weight"] = shape
            if cfg.attention_bias:
                shapes[f"{p}self_attn.{name}.bias"] = (shape[0],)
        shapes |= {f"{p}self_attn.q_norm.weight": (d,), f"{p}self_attn.k_norm.weight": (d,),
                   f"{p}input_layernorm.weight": (h,), f"{p}post_attention_layernorm.weight": (h,),
                   f"{p}mlp.gate_proj.weight": (cfg.intermediate_size, h),
                   f"{p}mlp.up_proj.weight": (cfg.intermediate_size, h),
                   f"{p}mlp.down_proj.weight": (h, cfg.intermediate_size)}
    return shapes


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint: one file, or the shards its index lists (names
    inside the folder only)."""
    folder = Path(folder)
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if not index.is_file():
        raise ExportError(f"{folder} holds no model.safetensors (nor an index of shards); a DeepSpec checkpoint "
                          "keeps its weights there")
    try:
        names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ExportError(f"{index} is not a safetensors index ({exc})") from exc
    files = []
    for name in names:
        if not isinstance(name, str) or Path(name).name != name or not name.endswith(".safetensors"):
            raise ExportError(f"{index} lists {name!r}, not a .safetensors file in the checkpoint folder")
        if not (folder / name).is_file():
            raise ExportError(f"{index} lists {name}, which is missing from {folder}")
        files.append(folder / name)
    return files


def read_weights(folder: Path, cfg: DeepSpecConfig) -> dict:
    """Every tensor, as FP32 torch tensors, after checking names and shapes against the config."""
    import torch
    from safetensors import SafetensorError, safe_open

    want = expected_shapes(cfg)
    tensors: dict = {}
    for path in weight_files(folder):
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    name = key.removeprefix("model.") if key.startswith("model.") and key not in want else key
                    if name.endswith("rotary_emb.inv_freq") or name == "t2d":
                        continue  # derived from the config or from d2t; never read
                    tensors[name] = f.get_tensor(key)
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
            raise ExportError(f"{path} cannot be read as safetensors ({exc}); it is damaged or truncated: "
                              "copy it again") from exc
    missing = sorted(set(want) - set(tensors))
    extra = sorted(set(tensors) - set(want))
    if missing or extra:
        raise ExportError(f"{folder}'s weights do not match its config: "
                          + (f"missing {missing[:6]}{' …' if len(missing) > 6 else ''}" if missing else "")
                          + ("; " if missing and extra else "")
                          + (f"unexpected {extra[:6]}{' …' if len(extra) > 6 else ''}" if extra else ""))
    for name, shape in want.items():
        if tuple(tensors[name].shape) != shape:
            raise ExportError(f"{folder}: {name} has shape {tuple(tensors[name].shape)}, the config implies {shape}")
        if name == "d2t":
            tensors[name] = draft_ids(folder, tensors[name], cfg)
            continue
        if not tensors[name].is_floating_point():
            raise ExportError(f"{folder}: {name} holds {tensors[name].dtype}, not floating-point weights")
        tensors[name] = tensors[name].to(torch.float32)
        if not bool(torch.isfinite(tensors[name]).all()):
            raise ExportError(f"{folder}: {name} holds NaN or infinite values")
    return tensors


def draft_ids(folder: Path, d2t, cfg: DeepSpecConfig):
    """The target ids of the draft vocabulary (i + d2t[i]), checked: integers, inside the
    vocabulary, no id twice."""
    import torch

    if d2t.is_floating_point() or d2t.dtype == torch.bool:
        raise ExportError(f"{folder}: d2t holds {d2t.dtype}; it must hold integer offsets (target id = i + d2t[i])")
    ids = d2t.to(torch.int64) + torch.arange(d2t.shape[0])
    if bool(((ids < 0) | (ids >= cfg.vocab_size)).any()):
        raise ExportError(f"{folder}: d2t maps draft tokens outside the target's vocabulary of {cfg.vocab_size}")
    if torch.unique(ids).numel() != ids.numel():
        raise ExportError(f"{folder}: d2t maps two draft tokens to the same target id")
    return ids


def max_probability_logit(logits):
    """log(p / (1 - p)) of a distribution's largest probability p = softmax(logits).max(): the
    confidence of a drafter without a confidence head (float64, p kept inside [1e-12, 1 - 1e-12])."""
    import numpy as np

    x = np.asarray(logits, dtype=np.float64)
    p = 1.0 / np.exp(x - x.max()).sum()
    p = min(max(p, 1e-12), 1.0 - 1e-12)
    return math.log(p) - math.log1p(-p)


# --- the reference forward, written from the format (independent of model.py) ------------------
def _rms(x, w, eps):
    import torch

    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):
    import torch

    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = pos.to(torch.float32)[:, None] * inv[None]  # [S, D/2]
    emb = torch.cat([ang, ang], -1)
    half = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * emb.cos() + half * emb.sin()


class Reference:
    """DeepSpec's DSpark forward over a checkpoint's tensors, from scratch every round: what an
    imported drafter must reproduce."""

    def __init__(self, cfg: DeepSpecConfig, tensors: dict) -> None:
        self.cfg, self.t = cfg, tensors

    def propose(self, features, anchor: int, slots: int | None = None):
        """features [n, F] (every context position's target features), anchor the token at n →
        (greedy drafts [b] as target ids, confidence logits [b]) as numpy arrays."""
        import torch
        import torch.nn.functional as F

        cfg, t = self.cfg, self.t
        b = slots or cfg.block_size
        feats = torch.as_tensor(features, dtype=torch.float32)
        n = feats.shape[0]
        with torch.no_grad():
            ctx = _rms(feats @ t["fc.weight"].T, t["hidden_norm.weight"], cfg.rms_eps)
            ids = torch.tensor([anchor] + [cfg.mask_token_id] * (b - 1))
            x = t["embed_tokens.weight"][ids]
            ctx_pos, blk_pos = torch.arange(n), torch.arange(n, n + b)
            for i in range(cfg.num_layers):
                x = x + self._attention(i, _rms(x, t[f"layers.{i}.input_layernorm.weight"], cfg.rms_eps), ctx,
                                        ctx_pos, blk_pos)
                y = _rms(x, t[f"layers.{i}.post_attention_layernorm.weight"], cfg.rms_eps)
                p = f"layers.{i}.mlp."
                x = x + (F.silu(y @ t[p + "gate_proj.weight"].T) * (y @ t[p + "up_proj.weight"].T)) @ \
                    t[p + "down_proj.weight"].T
            h = _rms(x, t["norm.weight"], cfg.rms_eps)
            logits = h @ t["lm_head.weight"].T
            drafts, conf = [], []
            prev = anchor  # a target id: markov_w1 has a row for every token
            to_target = t["d2t"] if cfg.draft_vocab_size else torch.arange(cfg.vocab_size)
            for k in range(b):
                step = logits[k]  # [draft rows]
                feat = h[k]
                if cfg.markov_rank:
                    row = t["markov_head.markov_w1.weight"][prev]
                    step = step + t["markov_head.markov_w2.weight"] @ row
                    if cfg.confidence_with_markov:
                        feat = torch.cat([h[k], row])
                if cfg.confidence_head:
                    conf.append(float(t["confidence_head.proj.weight"][0] @ feat + t["confidence_head.proj.bias"][0]))
                else:
                    conf.append(max_probability_logit(step.numpy()))
                prev = int(to_target[int(step.argmax())])
                drafts.append(prev)
        import numpy as np

        return np.asarray(drafts, dtype=np.int64), np.asarray(conf)

    def _attention(self, i: int, y, ctx, ctx_pos, blk_pos):
        import torch

        cfg, t, p = self.cfg, self.t, f"layers.{i}.self_attn."
        d, nh, nkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads

        def proj(name, x):
            out = x @ t[p + name + ".weight"].T
            return out + t[p + name + ".bias"] if cfg.attention_bias else out

        def heads(x, count):
            return x.view(x.shape[0], count, d).transpose(0, 1)  # [heads, S, d]

        q = _rope(_rms(heads(proj("q_proj", y), nh), t[p + "q_norm.weight"], cfg.rms_eps), blk_pos, cfg.rope_theta)
        k = torch.cat([_rope(_rms(heads(proj("k_proj", src), nkv), t[p + "k_norm.weight"], cfg.rms_eps), pos,
                             cfg.rope_theta) for src, pos in ((ctx, ctx_pos), (y, blk_pos))], 1)
        v = torch.cat([heads(proj("v_proj", ctx), nkv), heads(proj("v_proj", y), nkv)], 1)
        k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
        att = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(d), -1) @ v  # no mask: context and whole block
        return proj("o_proj", att.transpose(0, 1).reshape(y.shape[0], nh * d))


# --- conversion into this project's drafter -----------------------------------------------------
# This project's names of a drafter layer's tensors (model.py) and DeepSpec's (Qwen3 layers).
LAYER_NAMES = {"in_norm": "input_layernorm", "post_norm": "post_attention_layernorm", "q": "self_attn.q_proj",
               "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
               "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm", "gate": "mlp.gate_proj",
               "up": "mlp.up_proj", "down": "mlp.down_proj"}


def layer_tensors(tensors: dict, num_layers: int, to_deepspec: bool) -> dict:
    """The layers' tensors of ``tensors`` renamed into the other naming (biases where present)."""
    out = {}
    for i in range(num_layers):
        for ours, theirs in LAYER_NAMES.items():
            src, dst = (ours, theirs) if to_deepspec else (theirs, ours)
            for part in ("weight", "bias"):
                if f"layers.{i}.{src}.{part}" in tensors:
                    out[f"layers.{i}.{dst}.{part}"] = tensors[f"layers.{i}.{src}.{part}"]
    return out


def to_draft_model(cfg: DeepSpecConfig, tensors: dict):
    """This project's ``DSparkDraft`` computing the checkpoint's forward: the full vocabulary
    (or d2t's ids) as the draft vocabulary, the mask slot's embedding as the learned mask
    embedding, a zero Markov row for the outside-the-vocabulary index (an anchor outside a d2t
    vocabulary reads its own ``markov_w1`` row: ``anchor_table``), a zero confidence head when
    the checkpoint has none (the runtime then uses ``max_probability_logit``)."""
    import torch

    from .model import DraftConfig, DSparkDraft

    r = max(cfg.markov_rank, 1)  # no Markov head: a rank-1 head of zeros adds nothing
    dcfg = DraftConfig(hidden_size=cfg.hidden_size, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                       head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size, num_layers=cfg.num_layers,
                       feature_layers=cfg.feature_layers, rms_eps=cfg.rms_eps, rope_theta=cfg.rope_theta,
                       slots=cfg.block_size, draft_vocab=cfg.draft_rows, markov_rank=r, qk_norm=True,
                       attention_bias=cfg.attention_bias)
    t = tensors
    ids = t["d2t"] if cfg.draft_vocab_size else torch.arange(cfg.vocab_size)
    head = torch.zeros(cfg.vocab_size, cfg.hidden_size)
    head[ids] = t["lm_head.weight"]  # DSparkDraft keeps the draft vocabulary's rows of a full head
    model = DSparkDraft(dcfg, t["embed_tokens.weight"], head, ids, t["norm.weight"])
    state = {"fc.weight": t["fc.weight"], "ctx_norm.weight": t["hidden_norm.weight"],
             "mask_embed": t["embed_tokens.weight"][cfg.mask_token_id], "norm.weight": t["norm.weight"]}
    state |= layer_tensors(t, cfg.num_layers, to_deepspec=False)
    zeros_row = torch.zeros(1, r)
    if cfg.markov_rank:
        state["markov_in.weight"] = torch.cat([t["markov_head.markov_w1.weight"][ids], zeros_row])
        state["markov_out.weight"] = t["markov_head.markov_w2.weight"]
    else:
        state["markov_in.weight"] = torch.zeros(cfg.draft_rows + 1, r)
        state["markov_out.weight"] = torch.zeros(cfg.draft_rows, r)
    w = t["confidence_head.proj.weight"] if cfg.confidence_head else torch.zeros(1, cfg.hidden_size)
    state["conf.weight"] = w if cfg.confidence_with_markov else torch.cat([w, torch.zeros(1, r)], 1)
    state["conf.bias"] = t["confidence_head.proj.bias"] if cfg.confidence_head else torch.zeros(1)
    state["vocab_ids"] = ids
    model.load_state_dict(state, strict=True)
    return model.eval()


def anchor_table(cfg: DeepSpecConfig, tensors: dict):
    """markov_w1 [V, r] (FP16) when a d2t vocabulary leaves anchors outside it, whose Markov rows
    the draft-vocabulary table lacks; None otherwise."""
    import numpy as np

    if not (cfg.draft_vocab_size and cfg.markov_rank):
        return None
    return tensors["markov_head.markov_w1.weight"].numpy().astype(np.float16)


def read_calibration(folder: Path, cfg: DeepSpecConfig) -> tuple[list[float], list[float]] | None:
    """The per-position temperatures and biases of ``dspark_calibration.json`` beside a checkpoint
    (written by ``python -m export deepspec``), checked; None when there is none."""
    path = Path(folder) / CALIBRATION
    if not path.is_file():
        return None
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ValueError("too large")
        raw = json.loads(path.read_text(encoding="utf-8"))
        temps, biases = [float(t) for t in raw["temperatures"]], [float(b) for b in raw["biases"]]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        raise ExportError(f"{path} is not a calibration file ({exc}); remove it to use the confidences as "
                          "trained") from exc
    if not cfg.confidence_head:
        raise ExportError(f"{path} calibrates a confidence head, but {folder} has none; remove the file")
    if len(temps) != cfg.block_size or len(biases) != cfg.block_size:
        raise ExportError(f"{path} holds {len(temps)} temperatures and {len(biases)} biases for a block of "
                          f"{cfg.block_size}; it belongs to another drafter")
    if not all(math.isfinite(t) and t > 0 for t in temps) or not all(math.isfinite(b) for b in biases):
        raise ExportError(f"{path}: temperatures must be positive and finite, biases finite")
    return temps, biases


def load(folder: Path, manifest, engine: Path):
    """(config, tensors, project model) of a checkpoint checked against ``manifest``'s target."""
    cfg = read_config(folder)
    check_against_target(cfg, manifest, engine, folder)
    tensors = read_weights(folder, cfg)
    return cfg, tensors, to_draft_model(cfg, tensors)


def fingerprint(folder: Path) -> str:
    """sha256 over the config and the weight files, in order: the checkpoint's identity."""
    import hashlib

    from dspark_edge.manifest import sha256_file

    h = hashlib.sha256()
    for path in [Path(folder) / CONFIG, *weight_files(folder)]:
        h.update(f"{path.name}:{sha256_file(path)}\n".encode())
    return h.hexdigest()
