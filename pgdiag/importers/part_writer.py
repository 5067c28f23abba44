"""The step parts of an import, written on one background thread while the preset reads the next step.

Why: Arrow's Parquet encoder and zstd, and the fsync after them, release the GIL, so step k is compressed and
flushed while the preset reads step k + 1; `pgdiag.importers.writer` submits each part and waits before the
rename onto OUT.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent import futures
from typing import Any


class PartWriter:
    """Writes the step parts on one background thread, one part at a time, in order.

    Arrow's Parquet encoder and zstd, and the fsync after them, release the GIL, so step k is compressed and
    flushed while the preset reads step k + 1 (unpickling and JSON parsing hold the GIL: reading ahead in a
    thread would gain nothing). `submit` first waits for the part before it, so at most one table is waiting
    and a failed write is raised at the next `submit` or at `wait`, before anything is renamed onto OUT.
    """

    def __init__(self) -> None:
        self._pool = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="pgdiag-import-write")
        self._pending: futures.Future[Any] | None = None

    def submit(self, write: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self.wait()
        self._pending = self._pool.submit(write, *args, **kwargs)

    def wait(self) -> None:
        """Block until the part submitted last is written; raise its error if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Wait for the thread to finish (a failed write ignored: an error is already on its way)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            futures.wait([pending])
        self._pool.shutdown(wait=True)
