"""A pre-flight memory guard for reading one piece of a run (E518 before the read, not an abort during it).

Why: polars and Arrow allocate in native code, and a failed allocation there aborts the process (exit 134)
before Python sees a `MemoryError`. How: before a piece (a chunk of steps, or a whole run) is collected,
`check_piece_memory` adds up the uncompressed sizes, from the Parquet footers, of the column chunks it will read
(the row groups that can hold its steps, the columns it selects) and compares that with the memory this process
can still get: ``MemAvailable`` of ``/proc/meminfo`` and, when a cgroup v2 limit is set, ``memory.max`` minus
``memory.current`` (the smaller of the two). The estimate is a lower bound of what the read needs (the decoded
columns alone, before the flat buffers and float64 arrays built from them), so the guard refuses only a piece
that cannot fit; pieces that fit it may still run out later (then E518 from the `MemoryError` handler, or an
abort inside polars). docs/reliability.md, "Out of memory".
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pgdiag.errors import Code, UsageError

_STEP_DIR = re.compile(r"^step=(-?\d+)$")


@dataclass(frozen=True)
class MemoryLimits:
    """Where the guard reads the memory left: the kernel's meminfo and a cgroup v2 directory, or a fixed value.

    `available_bytes` set: that value is used and nothing is read (tests, or a user who knows better).
    """

    meminfo: Path = Path("/proc/meminfo")
    cgroup: Path = Path("/sys/fs/cgroup")
    available_bytes: int | None = None


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError):
        return None


def available_memory(limits: MemoryLimits | None = None) -> int | None:
    """Bytes this process can still allocate, by `limits`; None when nothing says (no /proc, no cgroup)."""
    limits = limits or MemoryLimits()
    if limits.available_bytes is not None:
        return limits.available_bytes
    found: list[int] = []
    meminfo = _read_text(limits.meminfo)
    if meminfo is not None:
        match = re.search(r"^MemAvailable:\s+(\d+)\s*kB", meminfo, re.MULTILINE)
        if match:
            found.append(int(match.group(1)) * 1024)
    maximum = _read_text(limits.cgroup / "memory.max")
    if maximum is not None and maximum.strip().isdigit():
        current = _read_text(limits.cgroup / "memory.current")
        used = int(current.strip()) if current is not None and current.strip().isdigit() else 0
        found.append(max(0, int(maximum.strip()) - used))
    return min(found) if found else None


def _step_of_path(path: Path) -> int | None:
    """The step of a ``step=<S>/`` partition file, else None."""
    match = _STEP_DIR.match(path.parent.name)
    return int(match.group(1)) if match else None


def _statistic(value: object) -> int | None:
    return int(value) if isinstance(value, int) else None


def piece_bytes(
    paths: Sequence[Path], columns: Collection[str], steps: Sequence[int] | None
) -> dict[Path, int]:
    """Uncompressed bytes, per file holding some, of the column chunks of `columns` in the row groups of `paths` that can hold a row of
    `steps` (sorted; None = every row group): a file under ``step=<S>/`` by its folder, else a row group by the
    min/max statistics of its ``step`` column (a row group without them counts)."""
    total: dict[Path, int] = {}
    for path in paths:
        folder_step = _step_of_path(path)
        if steps is not None and folder_step is not None:
            index = bisect.bisect_left(steps, folder_step)
            if index == len(steps) or steps[index] != folder_step:
                continue
        try:
            metadata = pq.ParquetFile(path).metadata
        except (OSError, pa.ArrowException):
            continue  # the read itself reports an unreadable file (E101/E516)
        names = [metadata.schema.column(i).path.split(".")[0] for i in range(metadata.num_columns)]
        step_index = names.index("step") if "step" in names else None
        for g in range(metadata.num_row_groups):
            group = metadata.row_group(g)
            if steps is not None and folder_step is None and step_index is not None:
                stats = group.column(step_index).statistics
                low = _statistic(stats.min) if stats is not None and stats.has_min_max else None
                high = _statistic(stats.max) if stats is not None and stats.has_min_max else None
                if low is not None and high is not None:
                    index = bisect.bisect_left(steps, low)
                    if index == len(steps) or steps[index] > high:
                        continue
            n_bytes = sum(
                group.column(i).total_uncompressed_size for i, name in enumerate(names) if name in columns
            )
            if n_bytes:
                total[path] = total.get(path, 0) + n_bytes
    return total


def _size(n_bytes: int) -> str:
    if n_bytes >= 2**30:
        return f"{n_bytes / 2**30:.2f} GiB"
    return f"{n_bytes / 2**20:.1f} MiB" if n_bytes >= 2**20 else f"{n_bytes:,} bytes"


def check_piece_memory(
    what: str,
    paths: Sequence[Path],
    columns: Collection[str],
    steps: Sequence[int] | None,
    limits: MemoryLimits | None = None,
) -> None:
    """UsageError E518 (exit 2) when the piece of run `what` (its files `paths`, the `columns` read, `steps` or None
    for all) needs more than the memory left (`available_memory`), before anything is read; else nothing."""
    available = available_memory(limits)
    if available is None:
        return
    per_file = piece_bytes(paths, columns, None if steps is None else sorted(steps))
    needed = sum(per_file.values())
    if needed > available:
        files = f"{next(iter(per_file))}" if len(per_file) == 1 else f"{what} ({len(per_file)} files)"
        where = "the whole run" if steps is None else _steps_text(steps)
        raise UsageError(
            Code.OUT_OF_MEMORY,
            f"{files}, {where}: reading it needs at least {_size(needed)} (its uncompressed columns) but only "
            f"{_size(available)} of memory is available",
            "a step too large for this machine: read fewer steps with --steps, or use a machine with more memory",
        )


def _steps_text(steps: Sequence[int]) -> str:
    ordered = sorted(steps)
    if len(ordered) == 1:
        return f"step {ordered[0]}"
    return f"steps {ordered[0]}-{ordered[-1]}"
