"""What the ranks of a recompute agree on: whether any rank saw a flag, totals over replicas, the writer's lock.

What: `any_rank(flag, layout, device)` and `sum_over_ranks(counts, layout, device)` are the two all-reduces every
rank calls (no-ops in one process); `writer_lock(out_dir, ...)` makes global rank 0 hold the tag directory's
exclusive lock for the whole recompute, and every rank raise E519 when another process holds it;
`remove_empty_dirs` takes back the directories a failed recompute created.

Why apart: a rank that raises while another waits at a barrier hangs the job, so every refusal is agreed on
through these before anyone raises.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pgdiag.data.writing import directory_lock
from pgdiag.errors import Code, UsageError

if TYPE_CHECKING:
    from pgdiag.recompute.launch import ParallelLayout


def any_rank(flag: bool, layout: ParallelLayout, device: torch.device) -> bool:
    """Whether `flag` holds on any rank (every rank must call this)."""
    if layout.world_size == 1:
        return flag
    value = torch.tensor([int(flag)], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return bool(value.item())


def sum_over_ranks(counts: list[int], layout: ParallelLayout, device: torch.device) -> list[int]:
    """Totals over DP replicas (TP ranks of a replica count the same tokens, so only TP rank 0 contributes)."""
    if layout.world_size == 1:
        return counts
    mine = counts if layout.is_writer else [0] * len(counts)
    total = torch.tensor(mine, dtype=torch.int64, device=device)
    torch.distributed.all_reduce(total)
    return [int(v) for v in total.tolist()]


@contextlib.contextmanager
def writer_lock(
    out_dir: Path, layout: ParallelLayout, device: torch.device, created: list[Path]
) -> Iterator[None]:
    """Global rank 0 creates `out_dir` and holds its exclusive lock (`pgdiag.data.writing.directory_lock`)
    while the block runs; when another process holds it, every rank raises E519 (nothing of ours written)."""
    with contextlib.ExitStack() as held:
        busy: UsageError | None = None
        if layout.is_main:
            out_dir.mkdir(parents=True, exist_ok=True)
            try:
                held.enter_context(directory_lock(out_dir, wait=False))
            except UsageError as error:
                busy = error
        if any_rank(busy is not None, layout, device):
            if layout.is_main:
                remove_empty_dirs(created)
            raise busy or UsageError(
                Code.OUTPUT_BUSY, f"{out_dir}: another process is writing this output now"
            )
        yield


def remove_empty_dirs(directories: list[Path]) -> None:
    """Remove those of `directories` (made by this recompute, deepest first) that are empty."""
    for directory in directories:
        if directory.is_dir() and not any(directory.iterdir()):
            directory.rmdir()
