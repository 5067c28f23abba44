"""Finding a run's files: the rollouts Parquet files of a RUN argument and its recompute directories.

Why: a RUN argument is a run directory, a directory of Parquet files, one file or a quoted glob, and a run's
recompute streams live under ``RUN/logprobs/<tag>/`` or in ``--attach`` directories; every command needs the same
list, in the same read order. How: `resolve_paths` walks the folder (hidden and ``_`` names skipped, unreadable
entries E516, nothing found E501) and sorts the files by their ``step=`` folder; `recompute_dirs` splits the
recompute directories into complete (``_manifest.json`` says so) and unfinished ones.
"""

from __future__ import annotations

import glob as globlib
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from pgdiag.data.paths import check_input_path, readable_file
from pgdiag.errors import Code, UsageError

_STEP_DIR = re.compile(r"^step=(-?\d+)$")


def _visible(path: Path, base: Path) -> bool:
    try:
        parts = path.relative_to(base).parts
    except ValueError:
        parts = (path.name,)
    return not any(part.startswith(("_", ".")) for part in parts)


def natural_key(path: Path) -> tuple:
    steps = [int(m.group(1)) for part in path.parts if (m := _STEP_DIR.match(part))]
    return (steps[-1] if steps else -1, str(path))


def parquet_under(directory: Path) -> list[Path]:
    """Every visible ``*.parquet`` file below `directory`; a folder or link that cannot be read is E516.

    (``Path.rglob`` skipped an unreadable ``step=N/`` folder silently, so a command ran on part of the run.)
    """

    def refuse(error: OSError) -> None:
        raise UsageError(
            Code.UNREADABLE_PATH,
            f"{error.filename or directory}: cannot be read ({error.strerror or error})",
            "fix its permissions or link, or move it out of the run",
        )

    found: list[Path] = []
    for folder, subfolders, names in os.walk(directory, onerror=refuse, followlinks=True):
        base = Path(folder)
        subfolders[:] = [name for name in subfolders if _visible(base / name, directory)]
        for name in names:
            path = base / name
            if not _visible(path, directory):
                continue
            if path.is_symlink() and not path.exists():  # dangling, or a loop of links
                refuse(OSError(40, "a link that leads nowhere or loops", str(path)))
            if name.endswith(".parquet"):
                found.append(readable_file(path))  # E516 for a FIFO, a device or a file it may not open
    return found


def resolve_paths(path: str | Path) -> tuple[tuple[Path, ...], Path | None]:
    """The rollouts files of a RUN argument, in read order, and the run directory if it is one (E501)."""
    text = str(path)
    candidate = Path(text)
    root: Path | None = None
    check_input_path(candidate)  # E516: too long, under a file, a loop of links, a FIFO or a device
    if candidate.is_dir():
        if (candidate / "rollouts").is_dir():
            root = candidate
            files = parquet_under(candidate / "rollouts")
        else:
            files = parquet_under(candidate)
    elif candidate.is_file():
        files = [readable_file(candidate)]
    elif globlib.has_magic(text):
        files = [
            Path(p)
            for p in globlib.glob(text, recursive=True)
            if Path(p).is_file() and not Path(p).name.startswith(("_", "."))
        ]
    else:
        files = []
    if not files:
        raise UsageError(
            Code.INPUT_NOT_FOUND,
            f"nothing matched {text}",
            "give a run directory, a Parquet file, or a quoted glob",
        )
    return tuple(sorted(files, key=natural_key)), root


def recompute_manifest(directory: Path) -> dict[str, Any]:
    """The recompute manifest of `directory` ({} when absent or unreadable)."""
    try:
        manifest = json.loads((directory / "_manifest.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def recompute_dirs(
    root: Path | None, attach: Sequence[str | Path]
) -> tuple[dict[str, Path], dict[str, Path]]:
    """(complete, incomplete) recompute directories by tag. Found under RUN/logprobs/, an unfinished one
    (interrupted or refused run) is set aside as incomplete; an --attach directory is always used (E504 later)."""
    found: dict[str, Path] = {}
    incomplete: dict[str, Path] = {}
    if root is not None and (root / "logprobs").is_dir():
        for sub in sorted((root / "logprobs").iterdir()):
            if sub.is_dir() and not sub.name.startswith(("_", ".")):
                if recompute_manifest(sub).get("complete") is True:
                    found[sub.name] = sub
                else:
                    incomplete[sub.name] = sub
    for directory in attach:
        directory = Path(directory)
        if not directory.is_dir():
            raise UsageError(
                Code.INPUT_NOT_FOUND,
                f"--attach {directory}: not a directory",
                "give a logprobs/<tag> directory",
            )
        tag = directory.name
        manifest = directory / "_manifest.json"
        tag = str(manifest_object(manifest).get("tag", tag))
        found[tag] = directory
        incomplete.pop(tag, None)
    return found, incomplete


def manifest_object(manifest: Path) -> dict[str, Any]:
    """A recompute ``_manifest.json`` as an object; {} when it is absent, unreadable or JSON of another shape."""
    try:
        value = json.loads(manifest.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return value if isinstance(value, dict) else {}


def part_schema_has_entropy(directory: Path) -> bool:
    parts = parquet_under(directory)
    return bool(parts) and "entropy" in pq.read_schema(parts[0]).names


def part_schema_has_kept(directory: Path) -> bool:
    """Whether a recompute's parts hold the kept-set columns (``kept_mass``, ``logprobs_full``)."""
    parts = parquet_under(directory)
    return bool(parts) and {"kept_mass", "logprobs_full"} <= set(pq.read_schema(parts[0]).names)
