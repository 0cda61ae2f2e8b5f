"""Drafters behind one protocol (``base.Drafter``): the DSpark block drafter, model-free n-gram
lookup, an independent draft model, and self-drafting (the target's own cheaper graph over its KV
cache). ``create`` turns a user's choice into a drafter."""

from __future__ import annotations

import logging
from pathlib import Path

from .base import AcceptanceTracker, Draft, Drafter, DraftRequest
from .ngram import NgramDrafter
from ..manifest import engine_path
from .ngram_table import FILE_NAME as TABLE_FILE
from .ngram_table import NgramTable

log = logging.getLogger(__name__)

__all__ = ["AcceptanceTracker", "Draft", "DraftRequest", "Drafter", "NGRAM_SPECS", "NgramDrafter", "NgramTable", "SELF_SPECS",
           "create", "is_self_spec"]

NGRAM_SPECS = ("ngram", "ngram:prompt", "ngram:online")  # the n-gram drafter by name: no model of its own
SELF_SPECS = ("self", "ngram+self")  # a quantized copy of the target drafts (":<precision>", default int8)


def is_self_spec(spec) -> bool:
    """Whether a drafter given by name drafts with another precision of the target's own graph."""
    return isinstance(spec, str) and spec.partition(":")[0] in SELF_SPECS


def create(spec, target_manifest, options=None, verify_hashes: bool = True, engine_dir=None):
    """None/"none" → no drafter; "dspark" or "dspark:<precision>" → the engine folder's DSpark
    drafter; "ngram" → NgramDrafter() with the engine folder's corpus table when it has one
    (``ngram_table.npz``) and its calibrated confidences; "ngram:online" → the same table with
    confidences estimated online instead; "ngram:prompt" → prompt lookup alone; "self" / "self:<precision>"
    → the target's own graph at another precision (default int8) drafts over its KV cache;
    "ngram+self[:<precision>]" → the n-gram drafter, and that copy where it promises more; a folder path → its draft
    model; an object with ``propose`` → used as is."""
    from ..errors import ConfigError

    if spec is None or spec == "none":
        return None
    if spec == "auto":
        raise ConfigError("drafter 'auto' depends on the target's precision and device: pass it to load(), or "
                          "resolve it first with dspark_edge.pipeline.auto_drafter")
    if hasattr(spec, "propose"):
        return spec
    if spec in NGRAM_SPECS:
        table_path = None if engine_dir is None or spec == "ngram:prompt" else engine_path(engine_dir, TABLE_FILE)
        if table_path is None or not table_path.is_file():
            return NgramDrafter()
        table = NgramTable.load_for(table_path, target_manifest)
        log.info("n-gram drafter: prompt lookup and the corpus table %s (%d contexts)", table_path, table.entries)
        return NgramDrafter(table=table, calibrated=spec != "ngram:online")
    if is_self_spec(spec):
        from .self_draft import SelfDrafter

        if engine_dir is None:
            raise ConfigError("self-drafting uses another precision of the target's engine folder; pass engine_dir")
        name, _, precision = spec.partition(":")
        ngram = create("ngram", target_manifest, engine_dir=engine_dir) if name == "ngram+self" else None
        return SelfDrafter(engine_dir, target_manifest, precision or "int8", options=options,
                           verify_hashes=verify_hashes, ngram=ngram)
    if isinstance(spec, str) and (spec == "dspark" or spec.startswith("dspark:")):
        from .dspark import DSparkDrafter

        if engine_dir is None:
            raise ConfigError("the DSpark drafter lives in the target's engine folder; pass engine_dir")
        precision = spec.partition(":")[2] or None
        return DSparkDrafter(engine_dir, target_manifest, precision, options=options, verify_hashes=verify_hashes)
    if isinstance(spec, (str, Path)) and Path(spec).is_dir():
        from .draft_model import DraftModelDrafter

        return DraftModelDrafter(spec, target_manifest, options=options, verify_hashes=verify_hashes)
    raise ConfigError(f"drafter {spec!r} is not 'none', 'dspark', 'dspark:<precision>', 'ngram', 'ngram:prompt', "
                      "'ngram:online', 'self[:<precision>]', 'ngram+self[:<precision>]', "
                      "a draft-model "
                      "engine folder, or a Drafter object")
