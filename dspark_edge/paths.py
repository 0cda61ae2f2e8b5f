"""Where outputs go: paths checked before the work that fills them, writes whose OS errors
become ``OutputError`` naming the option, the path and the fix. Knows nothing of what is
written."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from .errors import OutputError


def output_file(path: str | os.PathLike, what: str) -> Path:
    """``path`` as a file that can be written now (its folder exists and is writable, it is not
    a folder, and if it exists it is writable); ``what`` names it in the error (``--trace``)."""
    path = Path(path)
    if path.is_dir():
        raise OutputError(f"{what} {path} is a folder: give a file path inside it, e.g. {path / 'out'}")
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise OutputError(f"{what} {path}: folder {folder} does not exist; create it or pick another path")
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise OutputError(f"{what} {path}: not writable (permissions or a read-only file system); "
                          "pick another path")
    return path


def output_dir(path: str | os.PathLike, what: str) -> Path:
    """``path`` as a folder files can be written in (created when missing, its parents too)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputError(f"{what} {path} is a file, not a folder; pick a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"{what} {path}: cannot create the folder ({exc.strerror or exc}); pick another") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise OutputError(f"{what} {path}: not writable (permissions or a read-only file system); pick another")
    return path


@contextlib.contextmanager
def writing(path: str | os.PathLike, what: str) -> Iterator[None]:
    """Turn an OS error while writing ``path`` (disk full, file system gone read-only) into an
    ``OutputError``."""
    try:
        yield
    except OSError as exc:
        raise OutputError(f"{what} {path}: writing failed ({exc.strerror or exc}); free space or pick another "
                          "path") from None
