"""A drafter trained here, written in DeepSpec's checkpoint format (``Qwen3DSparkModel``), so the
engines that serve DSpark (vLLM, SGLang, llama.cpp's converter, TensorRT Edge-LLM) load it.

The project's drafter is DeepSpec's architecture (``model.py`` with ``qk_norm``), so the writing
is a renaming, with three conventions bridged:

- the mask slot: DeepSpec embeds the block's mask slots with ``embed_tokens[mask_token_id]``; the
  drafter here learns its mask embedding, which is written into that row of the drafter's copy of
  the target's embeddings. The row's own token then embeds as the mask when it is an anchor, so
  ``mask_token_id`` is a special token the target never emits in chat (``default_mask_token``).
- the draft vocabulary: a drafter trained on the full vocabulary is written in DeepSpec's own
  form (``lm_head`` and ``markov_w2`` over every token). One trained on a reduced vocabulary is
  written with the speculators / llama.cpp convention (``draft_vocab_size``, ``d2t``): llama.cpp
  loads it, DeepSpec's own loader does not (it has no reduced vocabulary); writing it over the full
  vocabulary would let tokens it never learned to rank compete, so it is not offered.
- ``markov_w1`` has a row per target token: the draft vocabulary's rows, and the drafter's
  out-of-vocabulary row for every other token (what the drafter here reads for such an anchor).

Beside the weights: ``dspark_calibration.json`` (the per-position temperatures and biases of
c_k = σ(z_k / T_k + b_k), fitted on held-out rounds) and ``dspark_provenance.json``. DeepSpec's
loader ignores both; what each engine reads is in docs/drafters.md.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path


from dspark_edge.errors import ExportError

from .deepspec import ARCHITECTURE, CALIBRATION, CONFIG, layer_tensors

log = logging.getLogger(__name__)

DEEPSPEC_DIR = "deepspec"  # where train-drafter writes the checkpoint inside its output folder
WEIGHTS = "model.safetensors"
PROVENANCE = "dspark_provenance.json"


def default_mask_token(tokenizer, eos_ids) -> int:
    """The highest-numbered special token that is not an end-of-sequence token and does not occur
    in the chat template: a token the target never reads or writes in chat."""
    template = tokenizer.chat_template or ""
    free = [i for i in sorted(tokenizer.special_ids)
            if i not in set(eos_ids) and tokenizer.decode([i], skip_special_tokens=False) not in template]
    if not free:
        raise ExportError("the target's tokenizer has no special token outside its chat template to stand for "
                          "DeepSpec's mask slot; name one with --mask-token-id")
    return free[-1]


def deepspec_config(model, target_config: dict, mask_token_id: int, anchors: int) -> dict:
    """config.json: the target's text config with DeepSpec's DSpark fields."""
    cfg = model.cfg
    vocab = int(model.embed.shape[0])
    out = dict(target_config)
    for key in ("auto_map", "quantization_config", "_name_or_path", "transformers_version", "torch_dtype", "dtype"):
        out.pop(key, None)
    out.update(
        architectures=[ARCHITECTURE], model_type="qwen3", hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        intermediate_size=cfg.intermediate_size, rms_norm_eps=cfg.rms_eps, rope_theta=cfg.rope_theta,
        attention_bias=cfg.attention_bias, vocab_size=vocab, num_target_layers=int(target_config["num_hidden_layers"]),
        num_hidden_layers=cfg.num_layers, layer_types=["full_attention"] * cfg.num_layers, block_size=cfg.slots,
        mask_token_id=int(mask_token_id), target_layer_ids=[s - 1 for s in cfg.feature_layers],
        num_anchors=int(anchors), markov_rank=cfg.markov_rank, markov_head_type="vanilla",
        enable_confidence_head=True, confidence_head_with_markov=True, tie_word_embeddings=False,
        use_sliding_window=False, torch_dtype="float32")
    out.pop("rope_scaling", None)
    if cfg.draft_vocab < vocab:
        out["draft_vocab_size"] = cfg.draft_vocab
    return out


def deepspec_tensors(model, mask_token_id: int) -> dict:
    """DeepSpec's state dict (FP32 torch tensors, ``d2t`` int64) of a drafter trained here."""
    import torch

    cfg = model.cfg
    if not cfg.qk_norm:
        raise ExportError("this drafter was trained without per-head q/k norms (an architecture older than "
                          "DeepSpec's Qwen3 layers); train it again with this version of train-drafter")
    vocab, vd = int(model.embed.shape[0]), cfg.draft_vocab
    if not 0 <= mask_token_id < vocab:
        raise ExportError(f"--mask-token-id {mask_token_id} is outside the vocabulary of {vocab} tokens")
    sd = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    ids = model.vocab_ids.long()
    embed = model.embed.float().clone()
    embed[mask_token_id] = sd["mask_embed"]
    w1 = sd["markov_in.weight"][vd].expand(vocab, -1).clone()  # the out-of-vocabulary row ...
    w1[ids] = sd["markov_in.weight"][:vd]  # ... and the draft vocabulary's own rows
    t = {"embed_tokens.weight": embed, "fc.weight": sd["fc.weight"], "hidden_norm.weight": sd["ctx_norm.weight"],
         "norm.weight": sd["norm.weight"], "markov_head.markov_w1.weight": w1,
         "confidence_head.proj.weight": sd["conf.weight"], "confidence_head.proj.bias": sd["conf.bias"]}
    if vd < vocab:
        t["lm_head.weight"] = model.head.float().clone()  # the draft vocabulary's rows, in its order
        t["markov_head.markov_w2.weight"] = sd["markov_out.weight"]
        t["d2t"] = (ids - torch.arange(vd)).to(torch.int64)
    else:  # the full vocabulary, in the drafter's own order: put each row at its token id
        head, w2 = torch.zeros(vocab, cfg.hidden_size), torch.zeros(vocab, cfg.markov_rank)
        head[ids], w2[ids] = model.head.float(), sd["markov_out.weight"]
        t["lm_head.weight"], t["markov_head.markov_w2.weight"] = head, w2
    t |= layer_tensors(sd, cfg.num_layers, to_deepspec=True)
    return {k: v.contiguous() for k, v in t.items()}


def write_deepspec(model, target_config: dict, output: Path, *, mask_token_id: int, anchors: int,
                   temperatures, biases, provenance: dict) -> Path:
    """Write ``output`` (config.json, model.safetensors and the two side files) through a staging
    folder renamed into place, so a kill leaves the old folder or none, never half of one."""
    import shutil

    from safetensors.torch import save_file

    output = Path(output)
    tensors = deepspec_tensors(model, mask_token_id)
    config = deepspec_config(model, target_config, mask_token_id, anchors)
    stage = output.parent / f".{output.name}.partial"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    try:
        save_file(tensors, str(stage / WEIGHTS), metadata={"format": "pt"})
        (stage / CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        calibration = {"form": "c_k = sigmoid(z_k / T_k + b_k), z_k the confidence head's logit at draft position k "
                               "(1-based, k = 1..block_size)",
                       "temperatures": [float(x) for x in temperatures], "biases": [float(x) for x in biases]}
        (stage / CALIBRATION).write_text(json.dumps(calibration, indent=1) + "\n", encoding="utf-8")
        (stage / PROVENANCE).write_text(json.dumps(provenance, indent=1) + "\n", encoding="utf-8")
        if output.exists():
            shutil.rmtree(output)
        stage.rename(output)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    log.info("wrote the DeepSpec checkpoint %s (%d tensors)", output, len(tensors))
    return output


def export_trained(weights: Path, target_engine: Path, output: Path, source: str = "default",
                   mask_token_id: int | None = None, progress=print) -> Path:
    """``python -m export deepspec``: a drafter folder from ``train-drafter`` → a DeepSpec checkpoint."""
    from dspark_edge.manifest import read_manifest

    from ..sources import load_source, resolve_source
    from .build import default_mask, load_drafter
    from .install import _check_trained

    manifest = read_manifest(target_engine)
    _check_trained(target_engine, weights, manifest)
    if mask_token_id is None:
        mask_token_id = default_mask(target_engine, manifest)
    progress(f"[1/2] loading the target ({source}) and the drafter ({weights})")
    target, _ = load_source(resolve_source(source))
    model, meta = load_drafter(weights, target)
    progress(f"[2/2] writing {output} (mask token {mask_token_id})")
    options = meta.get("training", {}).get("options", {})
    write_deepspec(model, target.config.to_dict(), output, mask_token_id=mask_token_id,
                   anchors=int(options.get("anchors", 40)), temperatures=meta["temperatures"],
                   biases=meta.get("biases", [0.0] * model.cfg.slots),
                   provenance={"drafter": str(weights), "target": meta["target"],
                               "training_data": meta.get("training", {}).get("data", "unknown")})
    progress(f"done: {output} ({'d2t draft vocabulary' if model.cfg.draft_vocab < model.embed.shape[0] else 'full vocabulary'})")
    return output
