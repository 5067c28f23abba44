"""`check_run` (`pgdiag check`) and `check_frame`: the reader's validation plus every check of `pgdiag.checks`.

Bad data never raises here: every finding is an issue of the result. For one run: the reader's rules
(`data.validate`), then on every stream pair that includes ``rollout`` (or the pair given) the pair checks
(`checks.pairs`: E302 shift; `data.token_issues`: E206 zero fill against the other stream) and the
signatures (`checks.signatures`: W401, W403, W406, W407, W410), W408 when old equals new, and the footer
checks (`checks.metadata`). For two runs, also the sample checks of `checks.samples` (E304, E301, E303/W303). `compare` calls the same functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from os import PathLike

import numpy as np
import polars as pl

from pgdiag.checks.metadata import metadata_checks, recompute_settings
from pgdiag.checks.pairs import (
    ShiftSample,
    keep_tokens,
    shift_issue,
    shift_rule,
    shift_verdict,
)
from pgdiag.checks.samples import CrossRunParts, cross_run_findings, cross_run_parts, one_side_parts
from pgdiag.checks.signatures import SignatureStats, signature_issues, signature_stats
from pgdiag.data.batch import TokenBatch
from pgdiag.data.flat import METADATA_LISTS, FlatList, RowTable, flat_list
from pgdiag.data.kept import KEPT_COLUMNS, kept_from_series
from pgdiag.data.load import batch_inputs, build_token_batch, load_rows
from pgdiag.data.pieces import StepPiece, plan_step_pieces
from pgdiag.data.reader import RunsReader
from pgdiag.data.runs import FILE_COLUMN, Run, read_run, restrict_steps
from pgdiag.data.schema import REQUIRED_COLUMNS, cast_problem, stream_column
from pgdiag.data.token_issues import zero_fill_issues
from pgdiag.data.validate import (
    CheckResult,
    Issue,
    check_result,
    merge_piece_issues,
    missing_columns,
    validate_rows,
)
from pgdiag.errors import Code, InvalidInputError, UsageError


def _pair_piece(
    batch: TokenBatch, a: str, b: str, *, max_examples: int
) -> tuple[list[Issue], SignatureStats]:
    """The pair checks of streams (a, b) on one piece (E302, E206 against the other stream) and the sums of its
    signatures, on the loss positions where both are finite."""
    lp_a, lp_b = batch.streams[a], batch.streams[b]
    name_a, name_b = stream_column(a), stream_column(b)
    issues: list[Issue] = []
    shift = shift_issue(lp_a, lp_b, batch, name_a=name_a, name_b=name_b)
    if shift is not None:
        issues.append(shift)
    issues += zero_fill_issues(
        lp_a,
        lp_b,
        batch,
        name_a=name_a,
        name_b=name_b,
        single_stream=False,
        max_examples=max_examples,
        legit_a=batch.one_token_sets(a),
        legit_b=batch.one_token_sets(b),
    )
    valid = np.isfinite(lp_a) & np.isfinite(lp_b)  # (M,)
    where = batch if valid.all() else keep_tokens(batch, valid)
    return issues, signature_stats(lp_a[valid], lp_b[valid], where, max_examples=max_examples)


def _pair_findings(stats: SignatureStats, a: str, b: str) -> list[Issue]:
    name_a, name_b = stream_column(a), stream_column(b)
    found = signature_issues(
        stats,
        name=f"{name_b} vs {name_a}",
        name_a=name_a,
        name_b=name_b,
        sampling_side_is_engine=a == "rollout",
    )
    return list(found.issues)


def pair_checks(batch: TokenBatch, a: str, b: str, *, max_examples: int = 5) -> list[Issue]:
    """The pair checks and signatures of streams (a, b) of `batch` on the loss positions where both are finite.

    Δ = lp_b − lp_a. The single-stream rules (E205, E206 by share, E207) are the reader's and are not repeated.
    """
    issues, stats = _pair_piece(batch, a, b, max_examples=max_examples)
    return issues + _pair_findings(stats, a, b)


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
        Issue(Code.LOSSY_CAST, "error", 1, f"{source}: {problem}")
        for c in frame.columns
        if (problem := cast_problem(c, frame.schema[c])) is not None
    ]
    if issues:
        return check_result([i for i in issues if i.code not in ignored], strict=strict)
    stream_cols = tuple(c for c in frame.columns if c.endswith("_logprobs") and c not in KEPT_COLUMNS)
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
                problem = Issue(
                    Code.LOSSY_CAST, "error", 1, f"{source}: input_ids: value {high} does not fit int32"
                )
                return check_result([problem] if Code.LOSSY_CAST not in ignored else [], strict=strict)
        numpy_type = (
            np.int32 if column == "input_ids" else (np.bool_ if column == "loss_mask" else np.float32)
        )
        lists[column] = FlatList(
            raw.offsets, raw.values.astype(numpy_type, copy=False), raw.valid, raw.row_valid
        )
    kept = kept_from_series({c: frame[c] for c in KEPT_COLUMNS if c in frame.columns})
    scalars = frame.drop([*list_cols, *(c for c in KEPT_COLUMNS if c in frame.columns)]).with_columns(
        pl.lit(source).alias(FILE_COLUMN)
    )
    found = validate_rows(
        RowTable(scalars, lists, stream_cols, kept),
        ignore=ignored,
        max_examples=max_examples,
        vocab_size=vocab_size,
    )
    return check_result([i for i in found.issues if i.code not in ignored], strict=strict)


CHECK_CHUNK_ROWS = 16_384  # rows of both runs read at a time by `check_run` (whole steps)


@dataclass(frozen=True)
class CheckedPiece:
    """One piece of a run as `check` reads it: its batch, the reader's checks (their rules judged over the run
    held as `CheckResult.pending`) and whether its rows are structurally sound (for the cross-run checks)."""

    batch: TokenBatch
    checks: CheckResult
    sound: bool


@dataclass
class RunChecks:
    """Every check of one run over its pieces (`pgdiag.data.fold.Fold`): `read(piece)` reads one piece (the run
    restricted to the piece's steps) with the reader's checks, `add(read)` checks it, `finish(reader)` gives the
    run's issues with the reader's checks merged over the pieces (`pgdiag.data.reader.RunsReader`)."""

    run: Run
    pair_streams: list[str]
    explicit_pair: bool = False  # --streams A,B: check that pair only (else every pair with rollout)
    ignored: frozenset[str] = frozenset()
    max_examples: int = 5
    vocab_size: int | None = None
    pairs: list[tuple[str, str]] | None = None
    shift: dict[tuple[str, str], ShiftSample] = field(default_factory=dict)  # E302's pooled sample, per pair
    pair_issues: dict[tuple[str, str], list[list[Issue]]] = field(default_factory=dict)  # per pair, per piece
    stats: dict[tuple[str, str], SignatureStats] = field(default_factory=dict)
    old_equals_new: bool | None = None  # None until a piece has both streams
    n_tokens: int = 0
    sound: bool = True
    failed: Issue | None = None  # the reader refused a piece: the run's only finding

    def read(self, piece: Run) -> CheckedPiece | None:
        """One piece of `self.run` read with the reader's checks; None when its rows cannot be read (`failed`)."""
        try:
            rows = load_rows(
                piece,
                streams=list(dict.fromkeys(self.pair_streams)),
                entropy=self.run.entropy_streams,
                scalars=["advantage", "reward", "env", "temperature"],
                lists=["advantages", *METADATA_LISTS],
            )
        # unreadable rows: this one issue is the run's finding, as for one read
        except InvalidInputError as exc:
            self.failed = Issue(exc.code, "error", 1, exc.message, hint=exc.hint)
            self.sound = False
            return None
        checked = validate_rows(
            rows.table, ignore=self.ignored, max_examples=self.max_examples, vocab_size=self.vocab_size
        )
        found = check_result(rows.issues + checked.issues, pending=checked.pending)
        sound = checked.bad_rows is None
        frame, view, keep = batch_inputs(rows, checked)
        loaded_streams, loaded_entropy = rows.streams, rows.entropy
        del rows, checked  # drop the list buffers before the float64 arrays are allocated
        batch = build_token_batch(
            piece, frame, view, streams=loaded_streams, entropy=loaded_entropy, sample_row=keep, env=True
        )
        return CheckedPiece(batch, found, sound)

    def add(self, read: CheckedPiece) -> TokenBatch | None:
        """Check one piece read by `read`; its batch when structurally sound (for cross-run checks)."""
        pair_streams, batch, sound = self.pair_streams, read.batch, read.sound
        if self.pairs is None:
            if self.explicit_pair:
                self.pairs = [(pair_streams[0], pair_streams[1])]
            elif "rollout" in pair_streams:
                self.pairs = [("rollout", s) for s in pair_streams if s != "rollout"]
            else:
                self.pairs = []
        for a, b in self.pairs:
            issues, stats = _pair_piece(batch, a, b, max_examples=self.max_examples)
            self.pair_issues.setdefault((a, b), []).append(issues)
            held = self.shift.get((a, b), ShiftSample.empty())
            self.shift[(a, b)] = held.merge(ShiftSample.of_piece(batch.streams[a], batch.streams[b], batch))
            self.stats[(a, b)] = (
                stats if (a, b) not in self.stats else self.stats[(a, b)].merge(stats, self.max_examples)
            )
        if {"old", "new"} <= set(batch.streams):
            equal = np.array_equal(batch.streams["old"], batch.streams["new"], equal_nan=True)
            self.old_equals_new = equal if self.old_equals_new is None else self.old_equals_new and equal
        self.n_tokens += batch.n_tokens
        self.sound &= sound
        return batch if sound else None

    def finish(self, reader: CheckResult | None = None) -> list[Issue]:
        """The issues of the whole run, in the order one read gives them: reader (`reader`: its checks merged over
        the pieces), each pair's checks and signatures, W408, the footer checks."""
        if self.failed is not None:
            return [self.failed]
        issues = [] if reader is None else list(reader.found)
        for a, b in self.pairs or []:
            pieces = self.pair_issues[(a, b)]
            if len(pieces) > 1:  # E302 on the sample pooled over the pieces (`ShiftSample`), not per piece
                names = {"name_a": stream_column(a), "name_b": stream_column(b)}
                rule = shift_rule(**names)
                pieces = [
                    [i for i in piece if not (i.code == Code.SHIFTED and i.rule == rule)] for piece in pieces
                ]
                shift = shift_verdict(self.shift[(a, b)], **names)
                issues += [] if shift is None else [shift]
            issues += merge_piece_issues(pieces)
            issues += _pair_findings(self.stats[(a, b)], a, b)
        if self.old_equals_new:
            issues.append(
                Issue(
                    Code.NO_OLD_STREAM,
                    "warning",
                    self.n_tokens,
                    "old_logprobs identical to new_logprobs: one iteration only?",
                )
            )
        issues += metadata_checks(self.run.meta, self.pair_streams, recompute_settings(self.run))
        if (
            not self.run.streams
        ):  # docs/schema.md: at least one stream column (a text-only import has none yet)
            issues.append(
                Issue(
                    Code.MISSING_COLUMN,
                    "error",
                    1,
                    f"{self.run.display_path(self.run.paths[0])}: no log-prob stream (no *_logprobs column, "
                    "no recompute under logprobs/)",
                    hint="recompute one with pgdiag logprobs RUN --model CKPT, or import the run's log-probs",
                )
            )
        return issues


def _stream_names(run: Run, streams: Sequence[str] | None) -> list[str]:
    pair_streams = list(streams) if streams is not None else list(run.streams)
    if streams is not None and len(pair_streams) != 2:
        raise UsageError(
            Code.UNPARSABLE_OPTION, f"--streams needs two names, got {pair_streams}", "pass --streams A,B"
        )
    return pair_streams


def _as_run(value: object, name: str) -> Run:
    """`value` as a `Run`: a run as given, a path read with `read_run`; E513 for any other type (an
    AttributeError deep inside before)."""
    if isinstance(value, Run):
        return value
    if isinstance(value, (str, PathLike)):
        return read_run(value)
    raise UsageError(
        Code.BAD_TENSORS,
        f"check_run: {name} is a {type(value).__name__}, not a run",
        "pass a pgdiag.read_run(PATH) result or the run's path",
    )


def check_run(
    run: Run,
    other: Run | None = None,
    *,
    streams: Sequence[str] | None = None,
    ignore: Sequence[str] = (),
    max_examples: int = 5,
    vocab_size: int | None = None,
    strict: bool = False,
    chunk_rows: int = CHECK_CHUNK_ROWS,
) -> CheckResult:
    """Run row validation and the data checks on `run`, and on `other` plus minimal cross-run checks.

    Bad data never raises here: every finding is an issue of the result (messages name the file, so the
    two runs' issues are told apart). `streams=[a, b]` restricts the semantic checks to that pair; by default
    every pair (rollout, s) is checked. Codes in `ignore` are dropped. Usage errors (no such stream,
    incomplete recompute dataset) still raise.

    The runs are read in pieces of consecutive whole steps, `chunk_rows` rows of both at a time
    (docs/reliability.md): the signatures and cross-run checks pool exact sums over the pieces; the reader's
    and the pair rules' issues of several pieces are merged per code and rule with the run's counts
    (`merge_piece_issues`), and E206's share of 0.0 and E302 (by nulls, and its medians on a pooled
    `ShiftSample`) are judged over the run.
    """
    run = _as_run(run, "run")
    other = None if other is None else _as_run(other, "other")
    ignored = set(ignore)
    options = {
        "explicit_pair": streams is not None,
        "ignored": frozenset(ignored),
        "max_examples": max_examples,
        "vocab_size": vocab_size,
    }
    found_a = RunChecks(run, _stream_names(run, streams), **options)
    found_b = None if other is None else RunChecks(other, _stream_names(other, streams), **options)
    found = [found_a] if found_b is None else [found_a, found_b]

    def read(piece: StepPiece, many: bool) -> tuple[list[CheckedPiece | None], list[CheckResult | None]]:
        pieces = [
            one.read(one.run if piece.steps is None else restrict_steps(one.run, piece.steps))
            if here and one.failed is None
            else None
            for one, here in zip(found, piece.present, strict=True)
        ]
        return pieces, [None if p is None else p.checks for p in pieces]

    # every piece handed on and nothing raised: `check` reports the reader's errors as issues
    runs = [one.run for one in found]
    reader = RunsReader(plan_step_pieces(runs, chunk_rows).pieces, read, n_runs=len(found), raises=False)
    cross: CrossRunParts | None = None
    for piece in reader:
        read_a, read_b = (*piece.read, None)[:2]
        batch_a = None if read_a is None else found_a.add(read_a)
        batch_b = None if read_b is None or found_b is None else found_b.add(read_b)
        del piece, read_a, read_b  # the batches not kept for the cross-run checks go now
        if found_b is None or not (found_a.sound and found_b.sound):
            continue
        if batch_a is not None and batch_b is not None:
            part = cross_run_parts(batch_a, batch_b, max_examples)
        elif batch_a is not None or batch_b is not None:
            lone, side = (batch_a, "a") if batch_a is not None else (batch_b, "b")
            label_other = (found_b.run if side == "a" else found_a.run).label
            part = one_side_parts(lone, side=side, label_other=label_other, max_examples=max_examples)
        else:
            continue
        cross = part if cross is None else cross.merge(part)
        del batch_a, batch_b
    merged = reader.finish()
    issues = found_a.finish(merged[0])
    if found_b is not None:
        issues += found_b.finish(merged[1])
        if found_a.sound and found_b.sound and cross is not None:
            issues += cross_run_findings(cross)
    return check_result([i for i in issues if i.code not in ignored], strict=strict)
