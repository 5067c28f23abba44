"""Loading a run's rows: `read_token_batch` and its steps `load_rows`, `validate_rows`, `build_token_batch`.

Why: every command needs a few columns of a run (or of one piece of it, `pgdiag.data.pieces`) as flat arrays,
validated, fast. How: `load_rows` selects only the needed columns, joins recompute parts on (step, sample_id,
segment_idx) (E305 on a seq_hash disagreement, E504 on an incomplete dataset), flattens list columns to numpy
buffers through Arrow; `pgdiag.data.validate.validate_rows` checks them; `build_token_batch` keeps the loss
positions of the sound rows as float64 in a `TokenBatch`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import polars as pl

from pgdiag.data.batch import TokenBatch
from pgdiag.data.flat import FlatList, RowTable, flat_list
from pgdiag.data.kept import KEPT_COLUMNS, KEPT_IDS, KEPT_OFFSETS, kept_from_series
from pgdiag.data.loss_view import LossView, loss_view
from pgdiag.data.memory import MemoryLimits, check_piece_memory
from pgdiag.data.runs import FILE_COLUMN, Run, incomplete_error, incomplete_issues, with_recompute
from pgdiag.data.schema import (
    REQUIRED_COLUMNS,
    cast_problem,
    entropy_column,
    full_logprobs_column,
    kept_kl_column,
    kept_mass_column,
    stream_column,
)
from pgdiag.data.validate import (
    CheckResult,
    Issue,
    MessageParts,
    RowIssues,
    as_template,
    check_result,
    missing_columns,
    raise_first_error,
    validate_rows,
)
from pgdiag.errors import Code, InvalidInputError, not_among

_F32_MAX = float(np.finfo(np.float32).max)


@dataclass(frozen=True)
class LoadedBatch:
    """A `TokenBatch` and the warnings found while loading it."""

    batch: TokenBatch
    checks: CheckResult


@dataclass(frozen=True)
class LoadedRows:
    """Rows of a run read for validation and flattening, before any rule ran."""

    table: RowTable
    issues: list[Issue]  # E102/E103/E305 found while reading
    streams: tuple[str, ...]
    entropy: tuple[str, ...]


def _typed_issues(run: Run, schema: pl.Schema, columns: Sequence[str]) -> list[Issue]:
    issues = []
    for column in columns:
        problem = cast_problem(column, schema[column]) if column in schema else None
        if problem is not None:
            issues.append(Issue(Code.LOSSY_CAST, "error", 1, f"{run.display_path(run.paths[0])}: {problem}"))
    return issues


def _range_issue(column: str, values: np.ndarray, kind: str) -> Issue | None:
    if values.size == 0:
        return None
    if kind == "int32":
        lo, hi = int(values.min()), int(values.max())
        if lo < np.iinfo(np.int32).min or hi > np.iinfo(np.int32).max:
            worst = lo if lo < np.iinfo(np.int32).min else hi
            return Issue(Code.LOSSY_CAST, "error", 1, f"{column}: value {worst} does not fit int32")
    elif kind == "float32" and values.dtype == np.float64:
        finite = values[np.isfinite(values)]
        if finite.size and float(np.abs(finite).max()) > _F32_MAX:
            return Issue(
                Code.LOSSY_CAST,
                "error",
                1,
                f"{column}: list<double> with {float(np.abs(finite).max()):.3g} does not fit float32",
            )
    return None


def load_rows(
    run: Run,
    *,
    streams: Sequence[str],
    entropy: Sequence[str] = (),
    scalars: Sequence[str] = (),
    lists: Sequence[str] = (),
    memory: MemoryLimits | None = None,
    kept: bool | None = None,
    kept_of: Sequence[str] = (),
) -> LoadedRows:
    """Collect the needed columns of `run` (recompute joined) and flatten every list column.

    Required columns are always read; missing ones are E102 issues and the rows cannot be loaded
    (an InvalidInputError is raised with the first such issue, as nothing can be validated without them).
    The kept-set columns (`pgdiag.data.kept`), when the run has them, are read and validated (E220-E223) when
    `kept` is True, or by default (None) when the rollout stream is read (its zero-fill rules skip the
    positions whose recorded set holds one token). `kept_of`: kept-set recompute tags whose ``kept_mass`` and
    ``logprobs_full`` columns are joined too (``<tag>_kept_mass``, ``<tag>_full_vocab``; E111 for a tag
    without them).
    Before the read, UsageError E518 when the columns of its steps need more memory than is left
    (`pgdiag.data.memory.check_piece_memory`; `memory` says where to read what is left).
    """
    schema = run.lazy.collect_schema()
    stream_cols = [stream_column(s) for s in streams]
    entropy_cols = [entropy_column(t) for t in entropy]
    for stream in (*streams, *entropy):
        if stream in run.incomplete:
            raise incomplete_error(run, stream)
    for stream in streams:
        if stream not in run.streams:
            message = f"{run.label}: no stream {stream!r}"
            raise not_among(Code.STREAM_NOT_FOUND, message, "streams", run.streams)
    for tag in entropy:
        if tag not in run.entropy_streams:
            message = f"{run.label}: no entropy for {tag!r}"
            raise not_among(Code.STREAM_NOT_FOUND, message, "entropy", run.entropy_streams)
    read_kept = ("rollout" in streams) if kept is None else kept
    kept_cols = [c for c in KEPT_COLUMNS if c in schema] if read_kept else []
    if KEPT_IDS not in kept_cols or KEPT_OFFSETS not in kept_cols:
        kept_cols = []
    file_cols = [
        c
        for c in (*REQUIRED_COLUMNS, "segment_idx", *scalars, *lists, *stream_cols, *kept_cols)
        if c in schema
    ]
    issues = missing_columns(set(schema), REQUIRED_COLUMNS)
    if issues:
        raise InvalidInputError(
            issues[0].code, f"{run.display_path(run.paths[0])}: {issues[0].message}", issues[0].hint
        )
    issues = _typed_issues(run, schema, file_cols)
    if issues:
        raise InvalidInputError(Code.LOSSY_CAST, issues[0].message, "re-import with pgdiag import")
    file_cols = list(dict.fromkeys(file_cols))
    check_piece_memory(
        run.label,
        run.paths,
        {*file_cols, *stream_cols},
        run.step_subset,
        memory,
    )
    for tag in kept_of:
        if tag not in run.kept_tags:
            message = f"{run.label}: recompute {tag!r} holds no kept sets"
            then = " (pgdiag logprobs --kept-set)"
            raise not_among(Code.STREAM_NOT_FOUND, message, "kept-set recomputes", run.kept_tags, then)
    kept_extra = [
        c for tag in kept_of for c in (kept_mass_column(tag), full_logprobs_column(tag), kept_kl_column(tag))
    ]
    lazy = with_recompute(run, run.scan(with_file=True), [*stream_cols, *entropy_cols, *kept_extra])
    if kept_extra:
        joined = lazy.collect_schema()
        kept_extra = [c for c in kept_extra if c in joined]
    recompute_hash = [
        f"__{t}_seq_hash" for t in run.recompute if stream_column(t) in stream_cols or t in entropy
    ]
    wanted = [
        *file_cols,
        *(c for c in stream_cols if c not in file_cols),
        *entropy_cols,
        *kept_extra,
        *recompute_hash,
        FILE_COLUMN,
    ]
    try:
        fixed_size = {c for c in wanted if isinstance(schema.get(c), pl.Array)}
        frame = lazy.select(
            pl.col(c).cast(pl.List(schema[c].inner)) if c in fixed_size else pl.col(c) for c in wanted
        ).collect()
    except pl.exceptions.PolarsError as exc:
        raise InvalidInputError(
            Code.LOSSY_CAST,
            f"{run.label}: cannot read the rollouts or join the recompute parts ({exc})",
            "re-import with pgdiag import, or rerun pgdiag logprobs --overwrite",
        ) from exc
    shown = {f: run.display_path(f) for f in frame[FILE_COLUMN].unique().to_list()}
    frame = frame.with_columns(pl.col(FILE_COLUMN).replace_strict(shown, return_dtype=pl.String))
    issues = [*incomplete_issues(run), *_recompute_issues(run, frame, recompute_hash)]
    list_cols = [
        "input_ids",
        "loss_mask",
        *stream_cols,
        *entropy_cols,
        *kept_extra,
        *(c for c in lists if c in frame.columns),
    ]
    kept_sets = kept_from_series({c: frame[c] for c in kept_cols})
    frame = frame.drop(kept_cols)
    flat: dict[str, FlatList] = {}
    for column in dict.fromkeys(list_cols):
        raw = flat_list(frame[column])
        frame = frame.drop(column)  # frees polars' chunks once Arrow holds the (rechunked) buffers
        if column == "input_ids":
            problem = _range_issue(column, raw.values, "int32") if raw.values.dtype.itemsize > 4 else None
            if problem is not None:
                raise InvalidInputError(Code.LOSSY_CAST, problem.message, "re-import with pgdiag import")
            flat[column] = FlatList(
                raw.offsets, raw.values.astype(np.int32, copy=False), raw.valid, raw.row_valid
            )
        elif column == "loss_mask":
            flat[column] = raw
        else:
            problem = _range_issue(column, raw.values, "float32")
            if problem is not None:
                raise InvalidInputError(Code.LOSSY_CAST, problem.message, "re-import with pgdiag import")
            flat[column] = FlatList(
                raw.offsets, raw.values.astype(np.float32, copy=False), raw.valid, raw.row_valid
            )
    table = RowTable(frame.drop(recompute_hash), flat, tuple(stream_cols), kept_sets)
    return LoadedRows(table, issues, tuple(streams), tuple(entropy))


def _recompute_issues(run: Run, frame: pl.DataFrame, hash_columns: Sequence[str]) -> list[Issue]:
    issues = []
    for column in hash_columns:
        tag = column[2 : -len("_seq_hash")]
        stale = (frame[column].is_null() | (frame[column] != frame["seq_hash"].cast(pl.UInt64))).fill_null(
            True
        )
        n_stale = int(stale.sum())
        if n_stale:
            first = frame.filter(stale).row(0, named=True)
            parts = MessageParts(
                as_template(f"logprobs/{tag} was computed on other rollouts: ")
                + "{n} samples missing or with another seq_hash (first: {examples})",
                sums=(("n", n_stale),),
                examples=((None, f"step {first['step']}, sample {first['sample_id']}"),),
                max_examples=1,
                located=False,
            )
            issues.append(
                Issue(
                    Code.STALE_RECOMPUTE,
                    "error",
                    n_stale,
                    parts.render(0),
                    step=int(first["step"]),
                    sample_id=str(first["sample_id"]),
                    hint="rerun pgdiag logprobs --overwrite",
                    rule=parts.template,
                    parts=parts,
                )
            )
    return issues


def build_token_batch(
    run: Run,
    frame: pl.DataFrame,
    view: LossView,
    *,
    streams: Sequence[str],
    entropy: Sequence[str] = (),
    sample_row: np.ndarray | None = None,
    advantages: bool = True,
    reward: bool = True,
    env: bool = False,
    kept_of: Sequence[str] = (),
) -> TokenBatch:
    """A float64 `TokenBatch` from the scalar `frame` and the `view` of structurally sound rows.

    Needs no list buffer, so callers can drop them first (peak memory). `sample_row` (S,) maps rows back to
    the rows as read (default: identity).
    """
    offsets = view.row_start  # (S + 1,)
    n_loss = np.diff(offsets)
    n_rows = frame.height
    pos = (view.index - np.repeat(view.seq_offsets[:-1], n_loss)).astype(np.int32)  # (M,)
    group_raw = frame["group_id"].cast(pl.String).fill_null("").to_numpy().astype(object)
    group_names, group = np.unique(group_raw, return_inverse=True)
    adv: np.ndarray | None = None
    if advantages and "advantages" in view.values:
        adv = view.values["advantages"].astype(np.float64)
    elif advantages and "advantage" in frame.columns:
        adv = np.repeat(frame["advantage"].cast(pl.Float64).fill_null(np.nan).to_numpy(), n_loss)
    segment = (
        frame["segment_idx"].fill_null(0).cast(pl.Int32).to_numpy()
        if "segment_idx" in frame.columns
        else np.zeros(n_rows, dtype=np.int32)
    )
    reward_values = (
        frame["reward"].cast(pl.Float64).fill_null(np.nan).to_numpy()
        if reward and "reward" in frame.columns
        else None
    )
    return TokenBatch(
        label=run.label,
        step=frame["step"].cast(pl.Int64).to_numpy(),
        sample_id=frame["sample_id"].cast(pl.String).to_numpy().astype(object),
        segment_idx=segment,
        group=group.astype(np.int64),
        group_names=group_names.astype(object),
        prompt_len=frame["prompt_len"].cast(pl.Int32).to_numpy(),
        seq_len=np.diff(view.seq_offsets).astype(np.int32),
        offsets=offsets,
        pos=pos,
        token_id=view.token_id,
        streams={s: view.values[stream_column(s)].astype(np.float64) for s in streams},
        entropy={t: view.values[entropy_column(t)].astype(np.float64) for t in entropy},
        advantages=adv,
        reward=reward_values,
        env=frame["env"].cast(pl.String).to_numpy().astype(object)
        if env and "env" in frame.columns
        else None,
        sample_row=np.arange(n_rows, dtype=np.int64) if sample_row is None else sample_row,
        seq_hash=frame["seq_hash"].cast(pl.UInt64).fill_null(0).to_numpy()
        if "seq_hash" in frame.columns
        else None,
        kept_size=view.kept_size,
        kept_mass={t: view.values[kept_mass_column(t)].astype(np.float64) for t in kept_of},
        full_vocab={t: view.values[full_logprobs_column(t)].astype(np.float64) for t in kept_of},
        kept_kl={
            t: view.values[kept_kl_column(t)].astype(np.float64)
            for t in kept_of
            if kept_kl_column(t) in view.values
        },
    )


def batch_inputs(rows: LoadedRows, found: RowIssues) -> tuple[pl.DataFrame, LossView, np.ndarray]:
    """The scalar frame, loss view and source row indices of the sound rows, for `build_token_batch`."""
    table = found.sound if found.sound is not None else rows.table
    view = found.loss if found.loss is not None else loss_view(table)
    n_rows = rows.table.n_rows
    keep = np.arange(n_rows, dtype=np.int64) if found.bad_rows is None else np.flatnonzero(~found.bad_rows)
    return table.frame, view, keep


def read_token_batch(
    run: Run,
    *,
    streams: Sequence[str],
    entropy: Sequence[str] = (),
    advantages: bool = True,
    reward: bool = True,
    env: bool = False,
    ignore: Sequence[str] = (),
    max_examples: int = 5,
    piece: bool = False,
    raise_errors: bool = True,
    kept_of: Sequence[str] = (),
) -> LoadedBatch:
    """Load, validate and flatten the loss positions of `run` for the given streams.

    Raises InvalidInputError with the first error (lowest code) unless its code is in `ignore`; warnings are
    returned in `LoadedBatch.checks`. Rows with ignored structural errors are left out of the batch.
    `piece`: `run` is one piece of a run read in pieces: the errors of the rules judged over the run (E206's
    share of exact 0.0, E302 by nulls: `Issue.pooled`) do not raise but are returned in the checks with this
    piece's share of those rules (`CheckResult.pending`), for the caller to merge over the pieces
    (`merge_check_results`) and raise the run's verdict. `raise_errors` False: no error raises (the caller
    merges and raises the run's first error, as one read would).
    """
    scalars = [c for c, on in (("advantage", advantages), ("reward", reward), ("env", env)) if on]
    lists = ["advantages"] if advantages else []
    rows = load_rows(run, streams=streams, entropy=entropy, scalars=scalars, lists=lists, kept_of=kept_of)
    found = validate_rows(rows.table, ignore=ignore, max_examples=max_examples)
    issues = [i for i in (*rows.issues, *found.issues) if i.code not in set(ignore)]
    if raise_errors:
        raise_first_error([i for i in issues if not (piece and i.pooled is not None)])
    pending = found.pending
    frame, view, keep = batch_inputs(rows, found)
    kept_streams, kept_entropy = rows.streams, rows.entropy
    del rows, found  # drop the list buffers before the float64 arrays are allocated
    batch = build_token_batch(
        run,
        frame,
        view,
        streams=kept_streams,
        entropy=kept_entropy,
        sample_row=keep,
        advantages=advantages,
        reward=reward,
        env=env,
        kept_of=kept_of,
    )
    return LoadedBatch(batch, check_result(issues, pending=pending))
