"""Atomic file writes, shared by every stage (it imports nothing from pgdiag, and nothing heavier than `os`).

`atomic_write(path, write)`: the bytes land in ``.<name>.tmp-<pid>-<random>`` in the destination directory, are
fsynced, then `os.replace`d onto the final name and the directory is fsynced, so a reader never sees a
half-written file and a failed write leaves nothing behind. The random part comes from `secrets` (the OS), never
from a seeded generator, so a write inside a trainer (`pgdiag.capture`) leaves its random state untouched.
`temp_path` and `replace_with` are its two halves, for a file written elsewhere in pieces.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Run ``write(tmp)`` on a temp path beside `path`, fsync it, then move it onto `path`.

    The temp file is ``.<name>.tmp-<pid>-<random>`` in the destination directory (created if needed); it is
    removed when `write` raises or the process is interrupted. Returns the final path.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        write(tmp)
        replace_with(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def temp_path(path: Path) -> Path:
    """The temp file of an atomic write of `path`: ``.<name>.tmp-<pid>-<random>`` in the same directory."""
    return path.parent / f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"


def replace_with(tmp: Path, path: Path) -> None:
    """fsync the finished `tmp`, move it onto `path`, fsync the directory (a file written elsewhere in pieces,
    such as `compare --tokens-out`'s, lands the way `atomic_write`'s do)."""
    with open(tmp, "rb+") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    """fsync `directory` itself, so a rename in it survives a crash (POSIX; elsewhere nothing to do)."""
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
