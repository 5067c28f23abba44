"""File-system checks of the paths a command reads or writes, as clean errors (docs/reliability.md).

Why: an input path that is too long, lies under a file, is a loop of links, a FIFO or a device (``/dev/zero``
would be read forever), or may not be read, and an output path that cannot be written, raised `OSError` deep in
polars, pyarrow or `os.makedirs` (exit 101). How: `check_input_path` stats the path once (following links) and
turns each failure into E516, naming the path and the reason; `readable_file` also refuses anything but a
regular file and opens it once (a permission the process lacks); `check_output_path` does the same for the
folders an output goes to (E517). A path that does not exist passes `check_input_path`: the caller says E501.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from pgdiag.errors import Code, UsageError

_REASONS = {
    errno.ENAMETOOLONG: "the path is too long (a name over 255 bytes or the whole path over 4,096)",
    errno.ELOOP: "a loop of symbolic links",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOTDIR: "a part of the path is a file, not a folder",
}


def _reason(error: OSError) -> str:
    return _REASONS.get(error.errno or 0, error.strerror or str(error))


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def check_input_path(path: str | Path) -> os.stat_result | None:
    """The `os.stat` of an input path (links followed), or None when it does not exist (the caller's E501).

    UsageError E516 when the path cannot be reached (too long, under a file, a loop of links, a dangling link,
    permission) or is neither a regular file nor a folder (a FIFO, a device, a socket).
    """
    path = Path(path)
    try:
        info = os.stat(path)
    except OSError as error:
        if error.errno == errno.ENOENT:
            if os.path.lexists(path):
                raise UsageError(
                    Code.UNREADABLE_PATH,
                    f"{path}: cannot be read (a link that leads nowhere)",
                    "fix the link or give its target",
                ) from None
            return None
        raise UsageError(
            Code.UNREADABLE_PATH, f"{path}: cannot be read ({_reason(error)})", _hint(error)
        ) from None
    except ValueError:  # a NUL byte in the path
        raise UsageError(
            Code.UNREADABLE_PATH, f"{path!r}: cannot be read (the path holds a NUL byte)"
        ) from None
    if not (stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode)):
        raise UsageError(
            Code.UNREADABLE_PATH,
            f"{path}: cannot be read ({_kind(info.st_mode)}, not a file or folder)",
            "give a Parquet file or a run folder; copy a stream to a file first",
        )
    return info


def _hint(error: OSError) -> str:
    if error.errno in (errno.EACCES, errno.EPERM):
        return "fix its permissions, or run as a user who may read it"
    if error.errno == errno.ENAMETOOLONG:
        return "shorten the path (a symbolic link to the folder helps)"
    return "check the path"


def readable_file(path: str | Path) -> Path:
    """`path` when it is a regular file this process may open; UsageError E516 otherwise (E501 when absent)."""
    path = Path(path)
    info = check_input_path(path)
    if info is None:
        raise UsageError(Code.INPUT_NOT_FOUND, f"{path}: no such file or directory")
    if not stat.S_ISREG(info.st_mode):
        raise UsageError(
            Code.UNREADABLE_PATH, f"{path}: cannot be read (a folder, not a file)", "give a file"
        )
    try:
        with open(path, "rb"):
            pass
    except OSError as error:
        raise UsageError(
            Code.UNREADABLE_PATH, f"{path}: cannot be read ({_reason(error)})", _hint(error)
        ) from None
    return path


def check_output_path(path: str | Path) -> None:
    """Refuse an output path that cannot be written before any work: UsageError E517 when it is too long, runs
    through a loop of links, or its nearest existing folder may not be written (permission, read-only). A file
    where a folder must be is E502 (`pgdiag.data.writing.check_destination`)."""
    path = Path(path)
    for candidate in (path, *path.parents):
        try:
            info = os.stat(candidate)
        except FileNotFoundError:
            continue
        except NotADirectoryError:
            continue  # a file in the way: check_destination names it (E502)
        except OSError as error:
            raise UsageError(
                Code.UNWRITABLE_PATH, f"{candidate}: cannot be written ({_reason(error)})", _hint(error)
            ) from None
        except ValueError:
            raise UsageError(
                Code.UNWRITABLE_PATH, f"{path!r}: cannot be written (the path holds a NUL byte)"
            ) from None
        if stat.S_ISDIR(info.st_mode) and not os.access(candidate, os.W_OK | os.X_OK):
            raise UsageError(
                Code.UNWRITABLE_PATH,
                f"{candidate}: cannot be written (permission denied or a read-only file system)",
                "choose another --out, or fix the folder's permissions",
            )
        return
