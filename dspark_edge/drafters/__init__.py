"""Drafters behind one protocol (``base.Drafter``): the DSpark block drafter, model-free n-gram
lookup, an independent draft model, and self-drafting (the target's own cheaper graph over its KV
cache). ``create`` turns a user's choice into a drafter."""

from __future__ import annotations

import logging

from ..manifest import engine_path
from .base import AcceptanceTracker, BaseDrafter, Draft, Drafter, DraftRequest
from .ngram import NgramDrafter
from .ngram_table import FILE_NAME as TABLE_FILE
from .ngram_table import NgramTable
from .spec import DrafterSpec, parse
from .spec import parse as parse_spec

log = logging.getLogger(__name__)

__all__ = ["AcceptanceTracker", "BaseDrafter", "Draft", "DraftRequest", "Drafter", "DrafterSpec", "NgramDrafter", "NgramTable",
           "create", "parse_spec"]


def create(spec, target_manifest, options=None, verify_hashes: bool = True, engine_dir=None,
           shared: dict | None = None):
    """The drafter a name stands for (``spec.parse``; the grammar is ``spec.KINDS``), or a
    Drafter object used as is; None for "none". "ngram" takes the engine folder's corpus table
    (``ngram_table.npz``) when it has one; "auto" must be resolved first (it depends on the
    target's precision and device: ``load`` does it). ``shared``: models the drafters made with
    the same dict share (the self drafter's copy; ``Pipeline.batch_slots``)."""
    from ..errors import ConfigError

    if spec is not None and hasattr(spec, "propose"):
        return spec
    s = parse(spec)
    if s.kind == "none":
        return None
    if s.kind == "auto":
        raise ConfigError("drafter 'auto' depends on the target's precision and device: pass it to load(), or "
                          "resolve it first with dspark_edge.pipeline.auto_drafter")
    if s.kind == "ngram":
        table_path = None if engine_dir is None or s.option == "prompt" else engine_path(engine_dir, TABLE_FILE)
        if table_path is None or not table_path.is_file():
            return NgramDrafter()
        table = NgramTable.load_for(table_path, target_manifest)
        log.info("n-gram drafter: prompt lookup and the corpus table %s (%d contexts)", table_path, table.entries)
        return NgramDrafter(table=table, calibrated=s.option != "online")
    if engine_dir is None and s.kind != "draft_model":
        raise ConfigError(f"drafter {str(s)!r} uses the target's engine folder; pass engine_dir")
    if s.self_drafting:
        from .self_draft import SelfDrafter

        ngram = create("ngram", target_manifest, engine_dir=engine_dir) if s.kind != "self" else None
        if s.kind == "ngram+dspark+self":
            ngram = _ngram_dspark(ngram, engine_dir, target_manifest, None, options, verify_hashes, prefer_int8=True)
        return SelfDrafter(engine_dir, target_manifest, s.option or "int8", options=options,
                           verify_hashes=verify_hashes, ngram=ngram, shared=shared)
    if s.kind == "dspark":
        from .dspark import DSparkDrafter

        return DSparkDrafter(engine_dir, target_manifest, s.option, options=options, verify_hashes=verify_hashes)
    if s.kind == "ngram+dspark":
        return _ngram_dspark(create("ngram", target_manifest, engine_dir=engine_dir), engine_dir, target_manifest,
                             s.option, options, verify_hashes)
    from .draft_model import DraftModelDrafter

    return DraftModelDrafter(s.option, target_manifest, options=options, verify_hashes=verify_hashes)


def _ngram_dspark(ngram, engine_dir, target_manifest, precision, options, verify_hashes, prefer_int8=False):
    """The ``ngram+dspark`` drafter over ``ngram``; ``precision`` None: the engine's first drafter
    graph, or with ``prefer_int8`` (inside ``ngram+dspark+self``, whose DSpark drafts are the cheap
    path) its INT8 graph where it has one: cheaper a round, and as accurate as FP32's where measured
    (``drafters/README.md``, run 5)."""
    from .dspark import DSparkDrafter
    from .ngram_dspark import NgramDSparkDrafter

    if prefer_int8 and precision is None and target_manifest.drafter is not None and "int8" in target_manifest.precisions("drafter"):
        precision = "int8"
    dspark = DSparkDrafter(engine_dir, target_manifest, precision, options=options, verify_hashes=verify_hashes)
    return NgramDSparkDrafter(ngram, dspark)
