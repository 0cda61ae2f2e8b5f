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


def write_tokenizer(hf_tokenizer, model_config, folder: Path, generation_config=None,
                    source_file: Path | None = None) -> TokenizerInfo:
    """Write tokenizer.json (and chat_template.jinja) into ``folder``; return the special ids.

    ``source_file``: the source's own tokenizer.json (a Hugging Face folder), copied byte for
    byte: a tokenizer rebuilt by the loading library can differ from it (normalizer,
    pre-tokenizer, added tokens), and the engine must encode as the model's own files do. The
    runtime always encodes with add_special_tokens=False and adds BOS itself when ``add_bos``
    is set, so a post-processor in the file never applies. A source without one (a GGUF file)
    gets the loaded tokenizer's, with such a post-processor dropped to keep the file
    unambiguous."""
    info = special_ids(hf_tokenizer, model_config, generation_config)
    if source_file is not None and source_file.is_file():
        _check_same_vocabulary(hf_tokenizer, source_file)
        (folder / TOKENIZER_FILE).write_bytes(source_file.read_bytes())
    else:
        data = json.loads(hf_tokenizer.backend_tokenizer.to_str())
        post = data.get("post_processor")
        if post and post.get("type") == "TemplateProcessing":
            data["post_processor"] = None
        (folder / TOKENIZER_FILE).write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    if not info.chat_template_file:
        log.warning("the source has no chat template: chat messages cannot be formatted (generate with plain "
                    "text prompts, or pass a template with --chat-template / load(chat_template=))")
    if info.chat_template_file:
        (folder / info.chat_template_file).write_text(hf_tokenizer.chat_template, encoding="utf-8")
    log.info("tokenizer: bos=%s add_bos=%s eos=%s pad=%s", info.bos_id, info.add_bos, info.eos_ids, info.pad_id)
    return info


def _check_same_vocabulary(hf_tokenizer, source_file: Path) -> None:
    """The special ids were read through the loaded tokenizer: refuse to pair them with a file
    whose ids for those tokens differ."""
    from tokenizers import Tokenizer

    from dspark_edge.errors import ExportError

    try:
        own = Tokenizer.from_file(str(source_file))
    except Exception as exc:  # the tokenizers library raises its own exception types
        raise ExportError(f"{source_file} cannot be read as a tokenizer ({exc})") from exc
    for token, tid in hf_tokenizer.get_vocab().items():
        if tid in (hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id, hf_tokenizer.pad_token_id) \
                and own.token_to_id(token) != tid:
            raise ExportError(f"{source_file} gives {token!r} the id {own.token_to_id(token)}, but the model's "
                              f"configuration uses {tid}; the folder's tokenizer files disagree")
