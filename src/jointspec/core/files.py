"""Files jointspec writes whole or not at all, and what a user reads when one cannot be written.

A file is written under a temporary name beside its place and renamed over it once complete, so a reader finds the
old file or the new one, never half of one. Where the write fails (a full disk, a quota, a folder made read-only) the
temporary file is removed and the failure becomes a :class:`WriteError` naming the file, the reason and the room
left: torch's writer says only "unexpected pos 576 vs 534" when the disk fills, and safetensors' error comes without
the file's name. Any other error (a bug) goes on as it was, its temporary file removed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path

from jointspec.core.errors import JointspecError


def cache_root() -> Path:
    """jointspec's cache: ``$JOINTSPEC_CACHE``, else ``$XDG_CACHE_HOME/jointspec``, else ``~/.cache/jointspec``. (The
    CPU kernels' builds follow ``$XDG_CACHE_HOME`` alone: kernels/grouped.py.)"""
    if os.environ.get("JOINTSPEC_CACHE"):
        return Path(os.environ["JOINTSPEC_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jointspec"


class WriteError(JointspecError):
    """A file jointspec writes could not be written (the message names it, why, and the room left there)."""


@contextlib.contextmanager
def replacing(path: str | os.PathLike, what: str, then: str = "") -> Iterator[Path]:
    """A temporary path to write ``path``'s new content to; on leaving, it replaces ``path`` (atomically). On any
    failure it is removed and ``path`` stays as it was; a failure to write (:func:`is_write_failure`) becomes a
    :class:`WriteError` naming ``what`` ("the training checkpoint") and ending with ``then`` (what the user can do,
    what was kept). Any other error, Ctrl-C included, goes on as it was."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException as error:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if is_write_failure(error):
            raise cannot_write(what, path, error, then) from error
        raise


@contextlib.contextmanager
def replacing_together(paths: Sequence[Path], what: str, folder: Path, then: str = "") -> Iterator[list[Path]]:
    """:func:`replacing` for files that go together (a draft's weights and its config): temporary paths for
    ``paths`` (each keeping its suffix, which some writers insist on), all written in the block before any replaces
    its file. Then the last of ``paths``, the one that says the others are whole (a config), is removed first and
    put back last, so a folder stopped between the renames holds no config (refused where it is read), never new files
    read with an old one. A failure to write removes the temporaries and becomes a :class:`WriteError` naming
    ``what`` ("draft") in ``folder``, ending with ``then`` while the folder is as it was."""
    partial = [path.with_name(f"{path.stem}.tmp{os.getpid()}{path.suffix}") for path in paths]
    kept = then
    try:
        folder.mkdir(parents=True, exist_ok=True)
        yield partial
        kept = f"the folder holds no whole {what} now: run the same command again"
        paths[-1].unlink(missing_ok=True)
        for temporary, path in zip(partial, paths):
            os.replace(temporary, path)
    except BaseException as error:
        for path in partial:
            with contextlib.suppress(OSError):  # (a folder that could not be made, a read-only one)
                path.unlink()
        if is_write_failure(error):
            raise cannot_write(f"the {what}", folder, error, kept) from error
        raise


# How writers that do not raise OSError say that the disk or the folder failed them: torch's zip writer (a full disk,
# a file it could not open), safetensors (Rust's io::Error, as text or in its debug form).
_WRITE_FAILURES = ("unexpected pos", "PytorchStreamWriter failed", "file write failed", "open file failed",
                   "I/O error", "os error", "Os { code", "No space left on device")


def is_write_failure(error: BaseException) -> bool:
    """Whether ``error`` says a file could not be written (a full disk, a quota, a read-only folder), not a bug."""
    if isinstance(error, OSError):
        return True
    return isinstance(error, Exception) and not isinstance(error, JointspecError) and any(
        sign in str(error) for sign in _WRITE_FAILURES)


def cannot_write(what: str, path: str | os.PathLike, error: BaseException, then: str = "") -> WriteError:
    """The :class:`WriteError` for ``error``, raised while writing ``what`` at ``path``."""
    if isinstance(error, OSError) and error.strerror:
        reason = error.strerror
    else:
        reason = " ".join(str(error).split()) or type(error).__name__
    free = free_bytes(path)
    room = "" if free is None else f"; {_size(free)} free there"
    return WriteError(f"could not write {what} '{path}' ({reason}{room})" + (f"; {then}" if then else ""))


def free_bytes(path: str | os.PathLike) -> int | None:
    """The bytes free on the file system that holds ``path`` (or its nearest existing folder); None where unknown."""
    existing = Path(path).absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        return shutil.disk_usage(existing).free
    except OSError:
        return None


def _size(count: int) -> str:
    for unit, scale in (("GB", 10 ** 9), ("MB", 10 ** 6), ("kB", 10 ** 3)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} bytes"
