"""An engine folder is never left half-written: build in a hidden sibling, rename into place.

``staging(output)`` yields a fresh ``.<name>.partial-<pid>`` folder next to ``output``; on
success ``publish`` swaps it in (an existing folder is moved aside first and removed after),
on any failure the staging folder is removed. A process killed mid-export leaves only a
hidden partial folder, which the next export in that parent folder removes. Scratch space
(``scratch(output)``: intermediate graphs, builder logs) lives beside the output the same way,
as ``.<name>.scratch-<pid>``, never in the system's temp folder, so a killed export's
scratch is reaped by the next export too.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shlex
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

from dspark_edge.errors import ExportError

log = logging.getLogger(__name__)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_partials(output: Path) -> None:
    """Remove ``.<name>.partial-<pid>`` / ``.old-<pid>`` / ``.scratch-<pid>`` folders left by dead exports."""
    for kind in ("partial", "old", "scratch"):
        for path in output.parent.glob(f".{output.name}.{kind}-*"):
            try:
                pid = int(path.name.rsplit("-", 1)[1])
            except ValueError:
                continue
            if not _pid_alive(pid):
                log.info("removing %s left by an interrupted export", path)
                shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _sibling(output: Path, kind: str) -> Iterator[Path]:
    """A fresh ``.<name>.<kind>-<pid>`` folder beside ``output``, removed when the block ends."""
    output.parent.mkdir(parents=True, exist_ok=True)
    path = output.parent / f".{output.name}.{kind}-{os.getpid()}"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def staging(output: Path) -> Iterator[Path]:
    output.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(output)
    with _sibling(output, "partial") as stage:
        try:
            yield stage
        except OSError as exc:  # disk full, quota, permissions: say so, keep what was there
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise ExportError(f"no space left on the device holding {output.parent} ({exc}): free some space "
                                  f"or write elsewhere; nothing was written and {output} is unchanged") from exc
            raise ExportError(f"the export failed ({exc}); nothing was written and {output} is unchanged") from exc


@contextlib.contextmanager
def scratch(output: Path) -> Iterator[Path]:
    """A scratch folder beside ``output`` for the export's intermediate files, removed when the
    export ends (and by the next export if this process is killed)."""
    with _sibling(output, "scratch") as path:
        yield path


def publish(stage: Path, output: Path) -> None:
    """Move the finished ``stage`` to ``output``, replacing what was there."""
    old = None
    if output.exists():
        old = output.parent / f".{output.name}.old-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(output, old)
    os.replace(stage, output)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def replacing_file(path: Path) -> Iterator[Path]:
    """A temporary path beside ``path``, renamed onto it when the block succeeds and removed
    otherwise: ``path`` is either the old file or the complete new one, never half of one."""
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}.npz")  # .npz: savez keeps the name as is
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        yield tmp
        os.replace(tmp, path)
    except OSError as exc:  # disk full, permissions: say so; what was there stays
        raise ExportError(f"writing {path} failed ({exc}); {path} is unchanged") from exc
    finally:
        tmp.unlink(missing_ok=True)


def export_command() -> str:
    """The ``python -m export ...`` command line of this process, for a file's metadata ("" when
    the exporter was called as a library)."""
    return ("python -m export " + " ".join(shlex.quote(a) for a in sys.argv[1:])) if sys.argv[1:] else ""
