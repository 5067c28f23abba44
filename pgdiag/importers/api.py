"""The import API: `import_run` (a framework dump through a preset) and `write_run` (your own DataFrame).

Both end in `pgdiag.importers.writer.write_steps`: validated, one step at a time, all or nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import polars as pl

from pgdiag.errors import Code, UsageError
from pgdiag.importers.base import ImportedStep, ImportOptions, load_preset
from pgdiag.importers.canonical import canonical_step, split_steps
from pgdiag.importers.writer import ImportResult, StepSummary, write_steps


def import_run(
    preset: str,
    src: str | Path,
    out: str | Path,
    *,
    options: ImportOptions | None = None,
    overwrite: bool = False,
    ignore: tuple[str, ...] = (),
    progress: Callable[[StepSummary], None] | None = None,
    **option_values: Any,
) -> ImportResult:
    """Import the dump `src` with `preset` (``pgdiag import --preset``) into the run directory `out`.

    `options` holds the common import options (`ImportOptions`), or pass them as keywords
    (``import_run("nemo-rl", src, out, temperature=1.0, group_by="prompt")``); `ignore` silences validation
    warnings by code;
    `progress` is called with each step's `StepSummary`. Refusals: E701 (unsafe global), E702 (text only),
    E703 (torn or unknown layout), any validation error; on any of them nothing is written.
    """
    if options is not None and option_values:
        raise UsageError(
            Code.SETTINGS_TWICE, "pass import options either as options= or as keywords, not both"
        )
    try:
        options = options or ImportOptions(**option_values)
    except TypeError as exc:
        raise UsageError(Code.BAD_OPTION_VALUE, f"unknown import option ({exc})") from None
    options.check()
    src = Path(src)
    if not src.exists():
        raise UsageError(Code.INPUT_NOT_FOUND, f"{src}: no such file or directory")
    reader = load_preset(preset)
    return write_steps(
        reader.read(src, options),
        out,
        options=options,
        preset=preset,
        overwrite=overwrite,
        ignore=ignore,
        progress=progress,
    )


def _shifts(shift: int | Mapping[str, int]) -> tuple[tuple[str | None, int], ...]:
    if isinstance(shift, Mapping):
        return tuple((column, int(k)) for column, k in shift.items())
    return ((None, int(shift)),) if shift else ()


def write_run(
    df: pl.DataFrame | Any,
    out: str | Path,
    *,
    label: str | None = None,
    group_by: str = "auto",
    shift: int | Mapping[str, int] = 0,
    step: int | None = None,
    sampling: Mapping[str, Any] | None = None,
    overwrite: bool = False,
) -> ImportResult:
    """Write a run from a DataFrame in canonical columns (docs/schema.md), validated, all or nothing.

    `df` is a polars DataFrame (a pyarrow Table or a dict of lists goes through ``pl.DataFrame``) with at least
    ``input_ids``, ``loss_mask``, one stream (``rollout_logprobs`` ...), and ``step`` unless `step` is given.
    Derived when absent: ``run`` (`label`, default: `out`'s name), ``prompt_len`` (first loss position; give it
    for response-aligned lists), ``sample_id`` (``"{step}:{row}"``), ``group_id`` (`group_by`: ``auto`` =
    the column when present, else ``prompt``; or ``prompt``, ``contiguous:N``), ``seq_hash``. `shift` moves
    per-token lists (an int for all, ``{"old_logprobs": 1}`` per column). `sampling` (``temperature``,
    ``top_p``, ``top_k``, ``min_p``, ``logprobs_mode``, ``engine``, ``tempered``) fills the footer. An error
    raises `InvalidInputError` (or `UsageError`) and writes nothing.
    """
    frame = df if isinstance(df, pl.DataFrame) else pl.DataFrame(df)
    options = ImportOptions(step=step, label=label, group_by=group_by, shifts=_shifts(shift))
    options.check()
    sampling = dict(sampling or {})
    tempered = sampling.get("tempered", "unknown")

    def steps() -> Iterator[ImportedStep]:
        for number, rows in split_steps(frame, options, "<DataFrame>"):
            imported = canonical_step(rows, number, options, src_files=(), sampling=sampling)
            imported.framework = "python"
            imported.sampling = {**sampling, "tempered": tempered}
            yield imported

    return write_steps(steps(), out, options=options, preset="canonical", overwrite=overwrite)
