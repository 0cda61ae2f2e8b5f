"""Check exported target graphs against the PyTorch model they came from.

For each prompt: the prompt's logits and exposed hidden states (max |Δ|), 32 greedy tokens
(how many agree before the first divergence), and the logits of that continuation run
through the graph at its widest verify width (so multi-token verification is checked too).
Runs the graph through the runtime's own DecoderModel, i.e. the path users get.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dspark_edge.backends import BackendOptions
from dspark_edge.manifest import Manifest, ValidationResult
from dspark_edge.decoder import DecoderModel

log = logging.getLogger(__name__)

VALIDATION_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Q: A train travels 60 km in 45 minutes. What is its speed in km/h?\nA:",
)
GREEDY_TOKENS = 32
# FP32 must reproduce the reference: logits within this (scaled by the logit range) and
# every greedy token equal. Quantized graphs differ by design; on the reference continuation
# they must still pick the reference's argmax this often, which catches a broken graph but
# not quantization noise (one early flip makes greedy runs diverge, so that is only reported).
FP32_LOGIT_TOL = 2e-3
QUANT_MIN_TOP1 = 0.6


@dataclass
class Reference:
    prompt_ids: list[int]
    prompt_logits: np.ndarray  # [S, V]
    hidden: np.ndarray  # [S, H * len(layers)]
    greedy: list[int]  # GREEDY_TOKENS ids
    greedy_logits: np.ndarray  # [GREEDY_TOKENS, V]: logits predicting greedy[1:] and one more


def torch_reference(model, prompt_ids: list[int], hidden_layers: tuple[int, ...]) -> Reference:
    import inspect

    import torch

    # transformers renamed past_key_values to cache; pass whichever this version takes.
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        ids = torch.tensor([prompt_ids])
        out = model(ids, use_cache=True, output_hidden_states=True)
        hidden = torch.cat([out.hidden_states[i][0] for i in hidden_layers], dim=-1) if hidden_layers else \
            torch.zeros((len(prompt_ids), 0))
        prompt_logits = out.logits[0].float().numpy()
        past = getattr(out, "cache", None) or out.past_key_values
        tok = int(out.logits[0, -1].argmax())
        greedy, step_logits = [tok], []
        for _ in range(GREEDY_TOKENS - 1):
            out = model(torch.tensor([[tok]]), use_cache=True, **{cache_kw: past})
            past = getattr(out, "cache", None) or out.past_key_values
            step_logits.append(out.logits[0, -1].float().numpy())
            tok = int(out.logits[0, -1].argmax())
            greedy.append(tok)
    return Reference(prompt_ids, prompt_logits, hidden.float().numpy(), greedy, np.stack(step_logits))


def validate_precision(manifest: Manifest, engine_dir: Path, precision: str,
                       references: list[Reference], role: str = "target", exact: bool = False) -> ValidationResult:
    """FP32 graphs, and any with ``exact``, are held to FP32's bar (logits within tolerance, every
    greedy token equal) rather than the quantized one. A graph computing the source's own weights
    with FP32 activations (int4 from a GGUF's blocks) is exact in this sense."""
    exact = exact or precision == "fp32"
    target = DecoderModel(manifest, engine_dir, precision, options=BackendOptions(max_context=512), role=role)
    cache = target.new_cache()
    widest = max(target.widths)
    max_logit, max_hidden, compared, matched = 0.0, 0.0, 0, 0
    top1_same, top1_total = 0, 0
    scale = 1.0
    for ref in references:
        cache.reset()
        out = target.prefill(cache, np.asarray(ref.prompt_ids, dtype=np.int64), chunk=len(ref.prompt_ids))
        scale = max(scale, float(np.abs(ref.prompt_logits).max()))
        max_logit = max(max_logit, float(np.abs(out.logits - ref.prompt_logits).max()))
        if out.hidden is not None and ref.hidden.size:
            max_hidden = max(max_hidden, float(np.abs(out.hidden - ref.hidden).max()))
        # Greedy decoding at width 1.
        tok = int(np.argmax(out.logits[-1]))
        mine = [tok]
        for _ in range(GREEDY_TOKENS - 1):
            o = target.step(cache, np.array([tok], dtype=np.int64))
            cache.commit(1)
            tok = int(np.argmax(o.logits[-1]))
            mine.append(tok)
        agree = next((i for i, (a, b) in enumerate(zip(mine, ref.greedy)) if a != b), GREEDY_TOKENS)
        compared += GREEDY_TOKENS
        matched += agree
        # The reference continuation teacher-forced at the widest width.
        cache.rollback(len(ref.prompt_ids))
        forced = np.asarray(ref.greedy[:-1], dtype=np.int64)
        for start in range(0, forced.shape[0] - widest + 1, widest):
            o = target.step(cache, forced[start:start + widest])
            cache.commit(widest)
            expected = ref.greedy_logits[start:start + widest]
            max_logit = max(max_logit, float(np.abs(o.logits - expected).max()))
            top1_same += int(np.sum(o.logits.argmax(-1) == expected.argmax(-1)))
            top1_total += widest
    top1 = top1_same / max(1, top1_total)
    if exact:
        passed = max_logit <= FP32_LOGIT_TOL * scale and matched == compared
    else:
        passed = top1 >= QUANT_MIN_TOP1
    result = ValidationResult(precision=precision, prompts=len(references), max_abs_logit_diff=max_logit,
                              max_abs_hidden_diff=max_hidden, greedy_tokens_compared=compared,
                              greedy_tokens_matched=matched, teacher_forced_top1=top1, passed=bool(passed))
    log.info("validation %s: %s", precision, result)
    return result
