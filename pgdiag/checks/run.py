"""`check_run` (`pgdiag check`) and `check_frame`: the reader's validation plus every check of `pgdiag.checks`.

Bad data never raises here: every finding is an issue of the result. For one run: the reader's rules
(`data.validate`), then on every stream pair that includes ``rollout`` (or the pair given) the pair checks
(`checks.pairs`: E302 shift, E206 zero fill against the other stream) and the signatures (`checks.signatures`:
W401, W403, W406, W407, W410), W408 when old equals new, and the footer checks (`checks.metadata`). For two
runs, also the sample checks of `checks.samples` (E304, E301, E303/W303). `compare` calls the same functions.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import polars as pl

from pgdiag.checks.metadata import metadata_checks, recompute_settings
from pgdiag.checks.pairs import keep_tokens, shift_issue, zero_fill_issues
from pgdiag.checks.samples import cross_run_issues
from pgdiag.checks.signatures import signatures
from pgdiag.data.batch import TokenBatch
from pgdiag.data.flat import FlatList, RowTable, flat_list
from pgdiag.data.runs import FILE_COLUMN, Run, batch_inputs, build_token_batch, load_rows
from pgdiag.data.schema import REQUIRED_COLUMNS, cast_problem, stream_column
from pgdiag.data.validate import CheckResult, Issue, check_result, missing_columns, validate_rows
from pgdiag.errors import InvalidInputError, UsageError


def pair_checks(batch: TokenBatch, a: str, b: str, *, max_examples: int = 5) -> list[Issue]:
    """The pair checks and signatures of streams (a, b) of `batch` on the loss positions where both are finite.

    Δ = lp_b − lp_a. The single-stream rules (E205, E206 by share, E207) are the reader's and are not repeated.
    """
    lp_a, lp_b = batch.streams[a], batch.streams[b]
    name_a, name_b = stream_column(a), stream_column(b)
    issues: list[Issue] = []
    shift = shift_issue(lp_a, lp_b, batch, name_a=name_a, name_b=name_b)
    if shift is not None:
        issues.append(shift)
    issues += zero_fill_issues(
        lp_a, lp_b, batch, name_a=name_a, name_b=name_b, single_stream=False, max_examples=max_examples
    )
    valid = np.isfinite(lp_a) & np.isfinite(lp_b)  # (M,)
    where = batch if valid.all() else keep_tokens(batch, valid)
    found = signatures(
        lp_a[valid],
        lp_b[valid],
        where,
        name=f"{name_b} vs {name_a}",
        name_a=name_a,
        name_b=name_b,
        sampling_side_is_engine=a == "rollout",
        max_examples=max_examples,
    )
    return issues + list(found.issues)


def check_frame(
    frame: pl.DataFrame,
    *,
    source: str = "<frame>",
    ignore: Sequence[str] = (),
    max_examples: int = 5,
    vocab_size: int | None = None,
    strict: bool = False,
) -> CheckResult:
    """Row validation of an in-memory rollouts frame (e.g. before `write_rollouts` in an import).

    `source` names the data in messages in place of a file. Stream columns are every ``*_logprobs`` column.
    """
    ignored = set(ignore)
    issues = missing_columns(frame.columns, [c for c in REQUIRED_COLUMNS if c != "seq_hash"])
    issues += [
        Issue("E103", "error", 1, f"{source}: {problem}")
        for c in frame.columns
        if (problem := cast_problem(c, frame.schema[c])) is not None
    ]
    if issues:
        return check_result([i for i in issues if i.code not in ignored], strict=strict)
    stream_cols = tuple(c for c in frame.columns if c.endswith("_logprobs"))
    list_cols = [
        "input_ids",
        "loss_mask",
        *stream_cols,
        *(["advantages"] if "advantages" in frame.columns else []),
    ]
    lists = {}
    for column in list_cols:
        values = frame[column]
        if isinstance(values.dtype, pl.Array):
            values = values.cast(pl.List(values.dtype.inner))
        raw = flat_list(values)
        if column == "input_ids" and raw.values.size and raw.values.dtype.itemsize > 4:
            low, high = int(raw.values.min()), int(raw.values.max())
            if low < np.iinfo(np.int32).min or high > np.iinfo(np.int32).max:
                problem = Issue("E103", "error", 1, f"{source}: input_ids: value {high} does not fit int32")
                return check_result([problem] if "E103" not in ignored else [], strict=strict)
        numpy_type = (
            np.int32 if column == "input_ids" else (np.bool_ if column == "loss_mask" else np.float32)
        )
        lists[column] = FlatList(
            raw.offsets, raw.values.astype(numpy_type, copy=False), raw.valid, raw.row_valid
        )
    scalars = frame.drop(list_cols).with_columns(pl.lit(source).alias(FILE_COLUMN))
    found = validate_rows(
        RowTable(scalars, lists, stream_cols),
        ignore=ignored,
        max_examples=max_examples,
        vocab_size=vocab_size,
    )
    return check_result([i for i in found.issues if i.code not in ignored], strict=strict)


def _single_run_issues(
    run: Run, streams: Sequence[str] | None, ignored: set[str], max_examples: int, vocab_size: int | None
) -> tuple[list[Issue], TokenBatch | None]:
    """Validation and data-check issues of one run, and its batch when it loaded well enough for cross-run
    checks (None when the rows could not be read or some rows are structurally unsound)."""
    pair_streams = list(streams) if streams is not None else list(run.streams)
    if streams is not None and len(pair_streams) != 2:
        raise UsageError("E112", f"--streams needs two names, got {pair_streams}", "pass --streams A,B")
    try:
        rows = load_rows(
            run,
            streams=list(dict.fromkeys(pair_streams)),
            entropy=run.entropy_streams,
            scalars=["advantage", "reward", "env"],
            lists=["advantages"],
        )
    except InvalidInputError as exc:
        return [Issue(exc.code, "error", 1, exc.message, hint=exc.hint)], None
    found = validate_rows(rows.table, ignore=ignored, max_examples=max_examples, vocab_size=vocab_size)
    issues = rows.issues + found.issues
    sound = found.bad_rows is None
    frame, view, keep = batch_inputs(rows, found)
    loaded_streams, loaded_entropy = rows.streams, rows.entropy
    del rows, found  # drop the list buffers before the float64 arrays are allocated
    batch = build_token_batch(
        run, frame, view, streams=loaded_streams, entropy=loaded_entropy, sample_row=keep, env=True
    )
    del view
    if streams is not None:
        pairs = [(pair_streams[0], pair_streams[1])]
    else:
        pairs = [("rollout", s) for s in pair_streams if s != "rollout"] if "rollout" in pair_streams else []
    for a, b in pairs:
        issues += pair_checks(batch, a, b, max_examples=max_examples)
    if {"old", "new"} <= set(batch.streams) and np.array_equal(
        batch.streams["old"], batch.streams["new"], equal_nan=True
    ):
        issues.append(
            Issue(
                "W408",
                "warning",
                batch.n_tokens,
                "old_logprobs identical to new_logprobs: one iteration only?",
            )
        )
    issues += metadata_checks(run.meta, pair_streams, recompute_settings(run))
    return issues, batch if sound else None


def check_run(
    run: Run,
    other: Run | None = None,
    *,
    streams: Sequence[str] | None = None,
    ignore: Sequence[str] = (),
    max_examples: int = 5,
    vocab_size: int | None = None,
    strict: bool = False,
) -> CheckResult:
    """Run row validation and the data checks on `run`, and on `other` plus minimal cross-run checks.

    Bad data never raises here: every finding is an issue of the result (messages name the file, so the
    two runs' issues are told apart). `streams=[a, b]` restricts the semantic checks to that pair; by default
    every pair (rollout, s) is checked. Codes in `ignore` are dropped. Usage errors (no such stream,
    incomplete recompute dataset) still raise.
    """
    ignored = set(ignore)
    issues, batch = _single_run_issues(run, streams, ignored, max_examples, vocab_size)
    if other is not None:
        other_issues, other_batch = _single_run_issues(other, streams, ignored, max_examples, vocab_size)
        issues += other_issues
        if batch is not None and other_batch is not None:
            issues += cross_run_issues(batch, other_batch, max_examples)
    return check_result([i for i in issues if i.code not in ignored], strict=strict)
