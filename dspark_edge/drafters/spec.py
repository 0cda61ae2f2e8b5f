"""The drafter names users write (``--drafter``, ``load(drafter=...)``), parsed in one place.

Grammar: ``none`` | ``auto`` | ``ngram[:online|:prompt]`` | ``self[:PRECISION]`` |
``ngram+self[:PRECISION]`` | ``dspark[:PRECISION]`` | ``ngram+dspark[:PRECISION]`` |
``ngram+dspark+self[:PRECISION]`` | the path of a draft-model engine folder.
``KINDS`` describes each form once; the help texts and error messages are made from it. This
module knows nothing about models: it only says what a name means.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from ..manifest import PRECISIONS

# kind → (the form users write, what it means). The order is the order help texts list them.
KINDS: dict[str, tuple[str, str]] = {
    "none": ("none", "plain decoding"),
    "auto": ("auto", "ngram+self for a target above INT8 on the CPU with the INT8 graph at hand, else the "
                     "engine's DSpark drafter when it has one, else ngram"),
    "ngram": ("ngram[:online|:prompt]", "prompt lookup with the engine's corpus table (calibrated confidences; "
                                        ":online estimates them online, :prompt drops the table)"),
    "self": ("self[:PRECISION]", "the engine's own graph at another precision (default int8) drafts over the "
                                 "target's KV cache"),
    "ngram+self": ("ngram+self[:PRECISION]", "n-gram drafts where they promise more, else the self drafter"),
    "dspark": ("dspark[:PRECISION]", "the engine folder's DSpark block drafter"),
    "ngram+dspark": ("ngram+dspark[:PRECISION]", "n-gram drafts where they promise more, else the DSpark drafter"),
    "ngram+dspark+self": ("ngram+dspark+self[:PRECISION]",
                          "the n-gram or DSpark drafts where they promise more, else the self drafter (PRECISION: "
                          "the copy's), checking the cheap drafts in its first pass"),
    "draft_model": ("PATH", "a draft-model engine folder"),
}
NGRAM_VARIANTS = ("table", "online", "prompt")


@dataclass(frozen=True)
class DrafterSpec:
    """What a drafter name means. ``option``: the n-gram variant ("table", "online", "prompt"),
    the precision of "self" / "ngram+self" / "dspark" / "ngram+dspark" (None: their default), the copy's
    precision of "ngram+dspark+self", or the draft model's folder."""

    kind: str
    option: str | None = None

    @property
    def own_model(self) -> bool:
        """Whether the drafter runs a graph beside the target ("auto" may: it can stand for the
        DSpark drafter or self-drafting)."""
        return self.kind not in ("none", "ngram")

    @property
    def self_drafting(self) -> bool:
        return self.kind in ("self", "ngram+self", "ngram+dspark+self")

    def __str__(self) -> str:
        if self.kind == "draft_model":
            return str(self.option)
        if self.kind == "ngram":
            return "ngram" if self.option in (None, "table") else f"ngram:{self.option}"
        return self.kind if self.option is None else f"{self.kind}:{self.option}"


def grammar() -> str:
    """The accepted forms, for help texts and errors: "none, auto, ngram[:online|:prompt], …"."""
    return ", ".join(form for form, _ in KINDS.values())


def describe() -> str:
    """One line per form with its meaning (``--help``)."""
    return "; ".join(f"{form}: {meaning}" for form, meaning in KINDS.values())


def parse(spec: str | os.PathLike | None) -> DrafterSpec:
    """The meaning of a drafter name; a ``ConfigError`` listing the grammar when it has none.
    A name that is not one of the forms is a draft-model folder only if that folder exists."""
    if spec is None:
        return DrafterSpec("none")
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"drafter {spec!r} is not a drafter name: use one of {grammar()}")
    name, sep, option = spec.strip().partition(":")
    if name in ("none", "auto") and not sep:
        return DrafterSpec(name)
    if name == "ngram":
        if sep and option not in ("online", "prompt"):
            raise ConfigError(f"drafter {spec!r}: the n-gram drafter takes ':online' or ':prompt', not {option!r}")
        return DrafterSpec("ngram", option or "table")
    if name in ("self", "ngram+self", "dspark", "ngram+dspark", "ngram+dspark+self"):
        if sep and option not in PRECISIONS:
            raise ConfigError(f"drafter {spec!r}: {option!r} is not a precision ({', '.join(PRECISIONS)})")
        return DrafterSpec(name, option or None)
    if Path(spec).is_dir():
        return DrafterSpec("draft_model", spec)
    raise ConfigError(f"drafter {spec!r} is not one of {grammar()} (a PATH must be an existing draft-model "
                      "engine folder)")


def own_model(drafter) -> bool:
    """Whether ``drafter`` (a name, a path or a Drafter object) names a drafter that runs a
    graph of its own; objects are the caller's business (False)."""
    return isinstance(drafter, (str, os.PathLike)) and parse(drafter).own_model
