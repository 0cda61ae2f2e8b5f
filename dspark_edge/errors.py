"""The project's error hierarchy: every error a user can cause derives from DSparkError.

Messages say what went wrong, where, and how to fix it.
"""

from __future__ import annotations

import struct
import zipfile
import zlib

# What numpy and zipfile raise for a damaged .npz file (truncated, a damaged member or its
# compressed data, an unsupported zip version or compression method, an encrypted member):
# readers of engine-folder tables catch these and raise an EngineError naming the fix.
NPZ_ERRORS: tuple[type[BaseException], ...] = (
    OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile, zlib.error, struct.error,
    RuntimeError)  # zipfile's NotImplementedError (version, compression) and "encrypted" errors;
                   # RecursionError (deeply nested JSON metadata)


class DSparkError(Exception):
    """Base class of every error dspark_edge raises on purpose."""


class ManifestError(DSparkError):
    """manifest.json is missing, malformed, of an unknown schema, or has a bad field."""


class EngineError(DSparkError):
    """An engine folder does not match its manifest (missing file, sha256 mismatch, bad graph)."""


class ConfigError(DSparkError, ValueError):
    """A configuration value is out of range or of the wrong type."""


class BackendError(DSparkError):
    """An inference backend or execution provider cannot be created or failed to run."""


class PromptError(DSparkError, ValueError):
    """The prompt is empty, malformed, or does not fit the context."""


class ExportError(DSparkError):
    """An export was rejected before it started, or failed (nothing was left half-written)."""


class GenerationError(DSparkError):
    """A generation failed mid-way; ``partial`` holds what was decided before the failure."""

    def __init__(self, message: str, partial: object | None = None) -> None:
        super().__init__(message)
        self.partial = partial


class OutputError(ConfigError):
    """An output file cannot be written: its folder is missing or read-only, the path is a
    folder, or the disk is full. Raised before the work where it can be known then (an output
    path is an option: a ConfigError)."""
