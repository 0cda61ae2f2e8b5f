"""Drafters behind one protocol (``base.Drafter``): model-free n-gram lookup and an
independent draft model. ``create`` turns a user's choice into a drafter."""

from __future__ import annotations

from pathlib import Path

from .base import AcceptanceTracker, Draft, Drafter, DraftRequest
from .ngram import NgramDrafter

__all__ = ["AcceptanceTracker", "Draft", "DraftRequest", "Drafter", "NgramDrafter", "create"]


def create(spec, target_manifest, options=None, verify_hashes: bool = True):
    """None/"none" → no drafter; "ngram" → NgramDrafter(); a folder path → its draft model;
    an object with ``propose`` → used as is."""
    from ..errors import ConfigError

    if spec is None or spec == "none":
        return None
    if hasattr(spec, "propose"):
        return spec
    if spec == "ngram":
        return NgramDrafter()
    if isinstance(spec, (str, Path)) and Path(spec).is_dir():
        from .draft_model import DraftModelDrafter

        return DraftModelDrafter(spec, target_manifest, options=options, verify_hashes=verify_hashes)
    raise ConfigError(f"drafter {spec!r} is not 'none', 'ngram', a draft-model engine folder, or a Drafter object")
