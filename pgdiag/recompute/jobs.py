"""`recompute_logprobs`: one call that runs a recompute in this process, on every rank of a ``torchrun`` job, or on
``tp × dp`` local workers it starts itself, so a notebook gets what ``pgdiag logprobs --tp 2`` does.

What: `recompute_logprobs(run, model, tp=2, progress=...)` returns the `RecomputeResult` of global rank 0 (None on
the other ranks of a ``torchrun`` job). `progress` is any callable taking a `ProgressUpdate`; it is called on
global rank 0 only. With local workers it is pickled into each worker (spawn start method), so it must be a
module-level object; when it is a context manager it is entered around the recompute (the CLI's bar does that).
How: `launch.run_workers` starts the workers through torch's elastic launch API; each runs `_worker`, which never
raises: a `PgdiagError` comes back with its code and the parent raises the worst one.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pgdiag.errors import EXIT_INTERNAL, EXIT_INVALID, Code, InvalidInputError, PgdiagError, UsageError
from pgdiag.recompute.forward import ProgressUpdate
from pgdiag.recompute.launch import launched_by_torchrun, run_workers, setup_distributed, teardown_distributed
from pgdiag.recompute.logprobs import RecomputeResult, recompute_rank
from pgdiag.recompute.settings import RecomputeSettings

Progress = Callable[[ProgressUpdate], None]


@dataclass(frozen=True)
class RecomputeJob:
    """Everything a worker needs to run `recompute_rank` (picklable for spawned workers)."""

    run: Any  # a run path or `Run`
    model: Any  # a checkpoint path (a loaded model only in this process)
    settings: RecomputeSettings = field(default_factory=RecomputeSettings)
    tp: int | None = None
    dp: int | None = None
    device: str | None = None
    progress: Progress | None = None


@dataclass(frozen=True)
class WorkerOutcome:
    """A worker's answer: its exit code, the result (global rank 0) and the error it raised, if any."""

    exit_code: int
    result: RecomputeResult | None = None
    error: tuple[str, str, str, str | None] | None = None  # (kind, code, message, hint)


def recompute_logprobs(
    run: Any,
    model: Any,
    settings: RecomputeSettings | None = None,
    *,
    tp: int | None = None,
    dp: int | None = None,
    tp_group: Any = None,
    device: str | None = None,
    progress: Progress | None = None,
    **options: Any,
) -> RecomputeResult | None:
    """Recompute log-probs and entropy of `run` with `model` under `settings` (`RecomputeSettings`: tag, dtype,
    head_dtype, temperature, impl, batch_tokens, ...; or its fields as keyword `options`, the notebook form, not
    both: E514), tensor parallel over `tp` ranks and data parallel over `dp` replicas.

    In a plain process with ``tp × dp > 1`` the workers are started here (gloo on CPU, NCCL on CUDA); under
    ``torchrun`` every rank calls this with the same arguments; with your own `tp_group` the recompute runs on
    this rank as given. Returns global rank 0's result, None on the other ranks of a ``torchrun`` job.
    """
    if settings is not None and options:
        raise UsageError(Code.SETTINGS_TWICE, "give either a RecomputeSettings or keyword options, not both")
    settings = settings or RecomputeSettings(**options)
    if tp_group is not None:
        with _entered(progress) as callback:
            return recompute_rank(run, model, settings, tp_group=tp_group, device=device, progress=callback)
    job = RecomputeJob(run, model, settings, tp, dp, device, progress)
    if launched_by_torchrun():
        try:
            return _run_ranked(job)
        finally:
            teardown_distributed()
    nproc = (tp or 1) * (dp or 1)
    if nproc == 1:
        with _entered(progress) as callback:
            return recompute_rank(run, model, settings, device=device, progress=callback)
    if not isinstance(model, str | Path):
        raise UsageError(
            Code.AMBIGUOUS_INPUT, "local tp/dp workers load the model themselves: pass a checkpoint path"
        )
    outcomes: dict[int, WorkerOutcome] = run_workers(_worker, job, nproc=nproc)
    worst = max(outcomes.values(), key=lambda o: o.exit_code)
    if worst.error is not None:
        kind, code, message, hint = worst.error
        if kind == "internal":
            raise RuntimeError(message)
        raise (InvalidInputError if worst.exit_code == EXIT_INVALID else UsageError)(code, message, hint)
    return outcomes[0].result


@contextlib.contextmanager
def _entered(progress: Progress | None):  # type: ignore[no-untyped-def]
    """`progress` entered when it is a context manager (the CLI's bar), else as given."""
    if progress is not None and hasattr(progress, "__enter__"):
        with progress as entered:  # type: ignore[attr-defined]
            yield entered
    else:
        yield progress


def _run_ranked(job: RecomputeJob) -> RecomputeResult | None:
    setup = setup_distributed(tp=job.tp, dp=job.dp, device=job.device)
    progress = job.progress if setup.layout.is_main else None
    with _entered(progress) as callback:
        result = recompute_rank(
            job.run,
            job.model,
            job.settings,
            tp_group=setup.tp_group,
            device=str(setup.device),
            progress=callback,
        )
    return result if setup.layout.is_main else None


def _worker(job: RecomputeJob) -> WorkerOutcome:
    """Entry point of a self-launched worker: never raises, so the parent can report the worst exit code."""
    try:
        return WorkerOutcome(0, _run_ranked(job))
    except PgdiagError as error:
        kind = "invalid" if isinstance(error, InvalidInputError) else "usage"
        return WorkerOutcome(error.exit_code, None, (kind, error.code, error.message, error.hint))
    except Exception as error:
        detail = traceback.format_exc() if os.environ.get("PGDIAG_TRACEBACK") == "1" else ""
        message = f"worker {os.environ.get('RANK', '?')}: {type(error).__name__}: {error}{detail}"
        return WorkerOutcome(EXIT_INTERNAL, None, ("internal", "INTERNAL", message, None))
    finally:
        teardown_distributed()
