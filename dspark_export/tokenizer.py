"""Write the runtime's tokenizer files and work out the special ids, fixing known traps.

Traps seen with GGUF-converted tokenizers: a post-processor that prepends BOS to every
encoding (for SmolLM2 the BOS id is ``<|im_start|>``, so that corrupts prompts), and an EOS
that is not the token the chat model ends its turn with. So: the runtime always encodes
without the post-processor, ``add_bos`` is decided here, and the end-of-turn token named by
the chat template joins the EOS ids.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from dspark_edge.manifest import TokenizerInfo

log = logging.getLogger(__name__)

END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")
TOKENIZER_FILE = "tokenizer.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"


def _ids(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def special_ids(hf_tokenizer, model_config, generation_config=None) -> TokenizerInfo:
    """The special ids the runtime uses, derived from config, tokenizer and chat template."""
    template = getattr(hf_tokenizer, "chat_template", None)
    eos: list[int] = []
    for value in (getattr(model_config, "eos_token_id", None),
                  getattr(generation_config, "eos_token_id", None) if generation_config else None,
                  hf_tokenizer.eos_token_id):
        eos += [i for i in _ids(value) if i not in eos]
    if template:
        for token in END_OF_TURN_TOKENS:
            tid = hf_tokenizer.convert_tokens_to_ids(token)
            if token in template and isinstance(tid, int) and tid != hf_tokenizer.unk_token_id and tid not in eos:
                eos.append(tid)
    if not eos:
        raise ValueError("the source names no EOS token and its chat template no end-of-turn token")
    bos = hf_tokenizer.bos_token_id
    bos_token = hf_tokenizer.bos_token
    # Prepend BOS only where the tokenizer does so itself AND the chat template does not use
    # the BOS string as a role marker (SmolLM2: BOS is <|im_start|>).
    with_special = hf_tokenizer("x", add_special_tokens=True)["input_ids"]
    add_bos = bool(bos is not None and with_special and with_special[0] == bos
                   and not (template and bos_token and bos_token in template))
    pad = hf_tokenizer.pad_token_id
    return TokenizerInfo(file=TOKENIZER_FILE, chat_template_file=CHAT_TEMPLATE_FILE if template else None,
                         bos_id=bos, eos_ids=tuple(eos), pad_id=pad, add_bos=add_bos)


def write_tokenizer(hf_tokenizer, model_config, folder: Path, generation_config=None) -> TokenizerInfo:
    """Write tokenizer.json (and chat_template.jinja) into ``folder``; return the special ids."""
    info = special_ids(hf_tokenizer, model_config, generation_config)
    backend = hf_tokenizer.backend_tokenizer
    data = json.loads(backend.to_str())
    # The runtime encodes with add_special_tokens=False and adds BOS itself when add_bos is
    # set; drop a post-processor that would add special tokens to keep the file unambiguous.
    post = data.get("post_processor")
    if post and post.get("type") == "TemplateProcessing":
        data["post_processor"] = None
    (folder / TOKENIZER_FILE).write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    if info.chat_template_file:
        (folder / info.chat_template_file).write_text(hf_tokenizer.chat_template, encoding="utf-8")
    log.info("tokenizer: bos=%s add_bos=%s eos=%s pad=%s", info.bos_id, info.add_bos, info.eos_ids, info.pad_id)
    return info
