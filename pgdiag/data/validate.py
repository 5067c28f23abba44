"""Validation of loaded rollout rows (E102-E103, E201-E213, W214-W217): the row and token rules.

Why: bad input must never turn into a wrong number, so every reader validates before it computes. How: the
reader (`pgdiag.data.runs`) hands over a `RowTable`, the scalar columns as a polars frame plus every list column
flattened into one `FlatList` (offsets + values + element validity). Each rule is a handful of vectorised numpy
operations over those flat buffers and per-row offsets (cumulative sums, bincount, repeat), never a Python loop
over tokens. Every violation becomes one `Issue` whose one-line message names the file, step, sample, position
and column of at most `max_examples` locations plus a count of the rest. Rules whose code is in `ignore` are
skipped. Rows with structural errors (E201, E202, E213 on ids or mask) are reported in `RowIssues.bad_rows` and
excluded from the token rules, which would otherwise read misaligned values. The issue model lives in
`data.issues`, the rules judged over a whole run in `data.run_rules`.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import numpy as np
import polars as pl

from pgdiag.data.flat import METADATA_LISTS, FlatList, RowTable, subset_rows
from pgdiag.data.issues import (
    ISSUE_SCHEMA,
    CheckResult,
    CheckSettings,
    Example,
    First,
    Issue,
    MessageParts,
    as_template,
    check_result,
    merge_check_results,
    merge_piece_issues,
    raise_first_error,
)
from pgdiag.data.kept import kept_issues, position_sizes
from pgdiag.data.loss_view import LossView, loss_view
from pgdiag.data.run_rules import (
    ZERO_FILL_FRACTION,
    NullShiftPart,
    PendingRule,
    ZeroFill,
    ZeroFillPart,
    zero_against_other,
    zero_fill_rows,
)
from pgdiag.data.schema import REQUIRED_HINTS
from pgdiag.data.seqhash import seq_hashes

# the issue model and the run-level rules, where the callers of this module have always found them
__all__ = [
    "ISSUE_SCHEMA",
    "LOGPROB_POSITIVE_TOL",
    "ZERO_FILL_FRACTION",
    "CheckResult",
    "CheckSettings",
    "Issue",
    "MessageParts",
    "NullShiftPart",
    "PendingRule",
    "RowIssues",
    "ZeroFill",
    "ZeroFillPart",
    "as_template",
    "check_result",
    "merge_check_results",
    "merge_piece_issues",
    "missing_columns",
    "raise_first_error",
    "validate_rows",
    "zero_against_other",
    "zero_fill_rows",
]

LOGPROB_POSITIVE_TOL = 1e-6


@dataclass(frozen=True)
class RowIssues:
    """Issues found on a `RowTable`, the rows excluded for structural errors, and the sound rows' view."""

    issues: list[Issue] = field(default_factory=list)
    bad_rows: np.ndarray | None = None  # (R,) bool, None = all rows structurally sound
    sound: RowTable | None = None  # the structurally sound rows (the input table when bad_rows is None)
    loss: LossView | None = None  # loss positions of `sound`
    pending: list[PendingRule] = field(
        default_factory=list
    )  # this table's share of the rules judged over a run


class _Locator:
    """Formats example locations (file, step, sample, pos) of violating rows for one-line messages."""

    def __init__(self, frame: pl.DataFrame, max_examples: int) -> None:
        self.frame = frame
        self.max_examples = max(0, max_examples)
        self.columns = set(frame.columns)

    def _value(self, column: str, row: int) -> object:
        return self.frame[column][row] if column in self.columns else None

    def examples(
        self, rows: np.ndarray, *, pos: np.ndarray | None = None, notes: Sequence[str] | None = None
    ) -> tuple[Example, ...]:
        """(file, "step s, sample x[, pos p][, note]") of the first `max_examples` of `rows`."""
        rows = np.asarray(rows, dtype=np.int64)[: self.max_examples]
        out = []
        for k, row in enumerate(rows.tolist()):
            bits = [f"step {self._value('step', row)}", f"sample {self._value('sample_id', row)}"]
            if pos is not None:
                bits.append(f"pos {int(pos[k])}")
            if notes is not None:
                bits.append(notes[k])
            file = self._value("__file", row)
            out.append((None if file is None else str(file), ", ".join(bits)))
        return tuple(out)

    def first(self, rows: np.ndarray, pos: np.ndarray | None = None) -> First:
        """(step, sample_id, pos) of the first of `rows` shown (all None when none is)."""
        rows = np.asarray(rows, dtype=np.int64)[: self.max_examples]
        if not rows.size:
            return (None, None, None)
        step, sample = self._value("step", int(rows[0])), self._value("sample_id", int(rows[0]))
        return (
            None if step is None else int(step),
            None if sample is None else str(sample),
            None if pos is None else int(pos[0]),
        )

    def issue(
        self,
        code: str,
        severity: str,
        text: str,
        rows: np.ndarray,
        count: int,
        *,
        pos: np.ndarray | None = None,
        notes: Sequence[str] | None = None,
        hint: str | None = None,
        sums: Sequence[tuple[str, int]] = (),
        maxima: Sequence[tuple[str, float]] = (),
    ) -> Issue:
        """An issue whose message is `text` followed by up to `max_examples` locations and the rest's count.

        With `sums`/`maxima`, `text` is a template whose fields are those counts (`MessageParts`: merged over
        the pieces of a run read in pieces); else it is the literal text."""
        template = text if (sums or maxima) else as_template(text)
        parts = MessageParts(
            template, tuple(sums), tuple(maxima), self.examples(rows, pos=pos, notes=notes), self.max_examples
        )
        return Issue(
            code,
            severity,
            int(count),
            parts.render(int(count)),
            *self.first(rows, pos),
            hint=hint,
            rule=template,
            parts=parts,
        )


def _row_of(offsets: np.ndarray, flat_index: np.ndarray) -> np.ndarray:
    """(K,) row owning each flat index."""
    return np.searchsorted(offsets, flat_index, side="right") - 1


def _null_rows(frame: pl.DataFrame, column: str) -> np.ndarray:
    return frame[column].is_null().to_numpy()


class _Rules:
    """The validation rules over one `RowTable`; each method appends at most a few issues."""

    def __init__(
        self, table: RowTable, *, ignore: Collection[str], max_examples: int, vocab_size: int | None
    ):
        self.table = table
        self.frame = table.frame
        self.ignore = set(ignore)
        self.loc = _Locator(table.frame, max_examples)
        self.vocab_size = vocab_size
        self.issues: list[Issue] = []
        self.pending: list[PendingRule] = []  # shares of the rules judged over the run (`merge_piece_issues`)
        self.bad = np.zeros(table.n_rows, dtype=bool)

    def on(self, code: str) -> bool:
        return code not in self.ignore

    def add(self, issue: Issue) -> None:
        self.issues.append(issue)

    # ---- structure: E213, E201, E202 -------------------------------------------------------------------
    def structure(self) -> None:
        ids = self.table.lists["input_ids"]
        mask = self.table.lists["loss_mask"]
        for column in ("run", "step", "sample_id", "prompt_len", "seq_hash"):
            if column not in self.frame.columns:
                continue
            nulls = _null_rows(self.frame, column)
            if nulls.any():
                self.bad |= nulls
                if self.on("E213"):
                    rows = np.flatnonzero(nulls)
                    self.add(self.loc.issue("E213", "error", f"{column} is null", rows, rows.size))
        for column, flat in (("input_ids", ids), ("loss_mask", mask)):
            null_rows = np.zeros(self.table.n_rows, dtype=bool)
            if flat.row_valid is not None:
                null_rows |= ~flat.row_valid
            if flat.valid is not None:
                bad_elems = np.flatnonzero(~flat.valid)
                null_rows[_row_of(flat.offsets, bad_elems)] = True
            if null_rows.any():
                self.bad |= null_rows
                if self.on("E213"):
                    rows = np.flatnonzero(null_rows)
                    self.add(self.loc.issue("E213", "error", f"{column} has nulls", rows, rows.size))
        lengths = ids.lengths
        for column, flat in self.table.lists.items():
            if column == "input_ids":
                continue
            wrong = flat.lengths != lengths
            if flat.row_valid is not None:
                wrong |= ~flat.row_valid
            if wrong.any():
                self.bad |= wrong
                if self.on("E201"):
                    rows = np.flatnonzero(wrong)
                    notes = [
                        "null list"
                        if flat.row_valid is not None and not flat.row_valid[r]
                        else f"length {flat.lengths[r]} != input_ids {lengths[r]}"
                        for r in rows[: self.loc.max_examples]
                    ]
                    self.add(
                        self.loc.issue(
                            "E201",
                            "error",
                            f"{column}: list length differs from input_ids",
                            rows,
                            rows.size,
                            notes=notes,
                        )
                    )
        prompt_len = self.frame["prompt_len"].to_numpy() if "prompt_len" in self.frame.columns else None
        if prompt_len is not None:
            outside = ~_null_rows(self.frame, "prompt_len") & ((prompt_len < 1) | (prompt_len > lengths))
            if outside.any():
                self.bad |= outside
                if self.on("E202"):
                    rows = np.flatnonzero(outside)
                    notes = [
                        f"prompt_len {prompt_len[r]}, T {lengths[r]}" for r in rows[: self.loc.max_examples]
                    ]
                    self.add(
                        self.loc.issue(
                            "E202", "error", "prompt_len outside [1, T]", rows, rows.size, notes=notes
                        )
                    )

    # ---- scalar rules: E210, E211, E212, W217, E207 on scalars --------------------------------------------
    def scalars(self) -> None:
        frame = self.frame
        keys = [c for c in ("run", "step", "sample_id") if c in frame.columns]
        if self.on("E210") and len(keys) == 3:
            key_frame = frame.select(
                *keys, pl.col("segment_idx").fill_null(0) if "segment_idx" in frame.columns else pl.lit(0)
            )
            dup = key_frame.is_duplicated().to_numpy()
            if dup.any():
                rows = np.flatnonzero(dup)
                self.add(
                    self.loc.issue(
                        "E210", "error", "duplicate (run, step, sample_id, segment_idx)", rows, rows.size
                    )
                )
        if self.on("E211") and "group_id" in frame.columns:
            group = frame["group_id"].cast(pl.String)
            missing = (group.is_null() | (group.str.len_chars() == 0)).to_numpy()
            if missing.any():
                rows = np.flatnonzero(missing)
                self.add(
                    self.loc.issue(
                        "E211",
                        "error",
                        "{n} samples without group_id",
                        rows,
                        rows.size,
                        hint="re-import with --group-by prompt",
                        sums=(("n", int(rows.size)),),
                    )
                )
        if self.on("W217") and {"group_id", "step"} <= set(frame.columns):
            sizes = (
                frame.group_by("step", "group_id")
                .len()
                .group_by("step")
                .agg(pl.col("len").min().alias("lo"), pl.col("len").max().alias("hi"))
            )
            uneven = sizes.filter(pl.col("lo") != pl.col("hi")).sort("step")
            if uneven.height:
                first = uneven.row(0, named=True)
                parts = MessageParts(
                    f"group_id: groups of unequal size within a step (step {first['step']}: sizes "
                    f"{first['lo']} to {first['hi']}); steps {{examples}}",
                    examples=tuple((None, str(s)) for s in uneven["step"].to_list()[: self.loc.max_examples]),
                    max_examples=self.loc.max_examples,
                    located=False,
                    joiner=", ",
                    more="; {n} more steps",
                )
                self.add(
                    Issue(
                        "W217",
                        "warning",
                        uneven.height,
                        parts.render(uneven.height),
                        step=int(first["step"]),
                        hint="contiguous grouping wrong?",
                        rule="group_id: groups of unequal size within a step",
                        parts=parts,
                    )
                )
        for column in ("reward", "advantage", "temperature"):
            if self.on("E207") and column in frame.columns:
                values = frame[column].cast(pl.Float64).to_numpy()
                nonfinite = np.isnan(values) & ~_null_rows(frame, column) | np.isinf(values)
                if nonfinite.any():
                    rows = np.flatnonzero(nonfinite)
                    self.add(self.loc.issue("E207", "error", f"{column}: NaN or inf", rows, rows.size))

    def seq_hash(self) -> None:
        if not self.on("E212") or "seq_hash" not in self.frame.columns:
            return
        ids = self.table.lists["input_ids"]
        computed = seq_hashes(ids.values.astype(np.int32, copy=False), ids.offsets)
        stored = self.frame["seq_hash"].fill_null(0).cast(pl.UInt64).to_numpy()
        wrong = (computed != stored) & ~self.bad
        if wrong.any():
            rows = np.flatnonzero(wrong)
            self.add(
                self.loc.issue(
                    "E212",
                    "error",
                    "seq_hash differs from the hash of input_ids",
                    rows,
                    rows.size,
                    hint="ids edited after import? re-import to refresh seq_hash",
                )
            )

    # ---- token rules ------------------------------------------------------------------------------------
    def tokens(self, view: LossView) -> None:
        """Token rules (E203, E204, E205-E209, W214-W216); every row of the table must be structurally sound."""
        ids = self.table.lists["input_ids"]
        offsets = ids.offsets
        n_rows = self.table.n_rows
        row_start = view.row_start
        n_loss = np.diff(row_start)
        good = ~self.bad
        prompt_len = self.frame["prompt_len"].fill_null(1).to_numpy().astype(np.int64)
        prompt_end = offsets[:-1] + np.clip(prompt_len, 0, ids.lengths)
        early = (np.searchsorted(view.index, prompt_end) - row_start[:-1] > 0) & good
        if early.any() and self.on("E203"):
            rows = np.flatnonzero(early)
            first_loss = (
                view.index[row_start[rows[: self.loc.max_examples]]] - offsets[rows[: self.loc.max_examples]]
            )
            notes = [f"prompt_len {prompt_len[r]}" for r in rows[: self.loc.max_examples]]
            self.add(
                self.loc.issue(
                    "E203",
                    "error",
                    "loss_mask true at position 0 or before prompt_len",
                    rows,
                    rows.size,
                    pos=first_loss,
                    notes=notes,
                    hint="loss position 0 has no context; spans inverted?",
                )
            )
        empty = (n_loss == 0) & good
        if empty.any() and self.on("W215"):
            rows = np.flatnonzero(empty)
            self.add(
                self.loc.issue(
                    "W215",
                    "warning",
                    "loss_mask: {n} samples with no loss tokens",
                    rows,
                    rows.size,
                    hint="kept: they change seq-mean denominators",
                    sums=(("n", int(rows.size)),),
                )
            )
        if self.on("E209") and "step" in self.frame.columns:
            steps = self.frame["step"].to_numpy()
            per_step = (
                pl.DataFrame({"step": steps[good], "n": n_loss[good]}).group_by("step").agg(pl.col("n").sum())
            )
            dry = per_step.filter(pl.col("n") == 0).sort("step")["step"].to_list()
            if dry:
                parts = MessageParts(
                    "loss_mask: step {examples} has no loss tokens",
                    examples=tuple((None, str(s)) for s in dry[: self.loc.max_examples]),
                    max_examples=self.loc.max_examples,
                    located=False,
                    joiner=", ",
                )
                self.add(
                    Issue(
                        "E209",
                        "error",
                        len(dry),
                        parts.render(0),
                        step=int(dry[0]),
                        rule=parts.template,
                        parts=parts,
                    )
                )
        if self.on("E209") and view.index.size == 0 and not any(i.code == "E209" for i in self.issues):
            self.add(Issue("E209", "error", 1, f"the selection ({n_rows} samples) has no loss tokens"))
        self._token_ids(ids, good)
        if self.table.kept is not None:
            for found in kept_issues(
                self.table.kept,
                ids,
                issue=self.loc.issue,
                on=self.on,
                vocab_size=self.vocab_size,
                max_examples=self.loc.max_examples,
            ):
                self.add(found)  # type: ignore[arg-type]
        for column, flat in self.table.lists.items():
            if column in METADATA_LISTS:
                self._finite_metadata(column, flat)
            elif column not in ("input_ids", "loss_mask"):
                self._float_column(column, flat, view)

    def _finite_metadata(self, column: str, flat: FlatList) -> None:
        """E207 on a per-token metadata list (`METADATA_LISTS`): any non-null non-finite value, loss or not."""
        bad = ~np.isfinite(flat.values)
        if flat.valid is not None:
            bad &= flat.valid
        if self.on("E207") and bad.any():
            bad_index = np.flatnonzero(bad)
            rows = _row_of(self.table.lists["input_ids"].offsets, bad_index)
            offsets = self.table.lists["input_ids"].offsets
            self.add(
                self.loc.issue(
                    "E207",
                    "error",
                    f"{column}: NaN or inf",
                    rows,
                    bad_index.size,
                    pos=bad_index - offsets[rows],
                )
            )

    def _token_ids(self, ids: FlatList, good: np.ndarray) -> None:
        if not self.on("E208"):
            return
        values = ids.values
        bad = values < 0
        if self.vocab_size is not None:
            bad |= values >= self.vocab_size
        if ids.valid is not None:
            bad &= ids.valid
        bad_index = np.flatnonzero(bad)
        if bad_index.size:
            rows = _row_of(ids.offsets, bad_index)
            keep = good[rows]
            bad_index, rows = bad_index[keep], rows[keep]
        if bad_index.size:
            limit = f" or >= vocab_size {self.vocab_size}" if self.vocab_size is not None else ""
            self.add(
                self.loc.issue(
                    "E208",
                    "error",
                    f"input_ids: token id < 0{limit}",
                    rows,
                    bad_index.size,
                    pos=bad_index - ids.offsets[rows],
                    notes=[f"token {values[i]}" for i in bad_index[: self.loc.max_examples]],
                )
            )

    def _float_column(self, column: str, flat: FlatList, view: LossView) -> None:
        offsets = self.table.lists["input_ids"].offsets
        ids = self.table.lists["input_ids"].values
        at_loss = view.values[column]
        valid_at_loss = view.valid[column]
        n_loss_total = view.index.size
        n_null_loss = 0 if valid_at_loss is None else int(n_loss_total - np.count_nonzero(valid_at_loss))
        if n_null_loss and self.on("E204"):
            where = np.flatnonzero(~valid_at_loss)
            flat_at = view.index[where]
            rows = view.rows_of(where)
            last = flat_at == offsets[rows + 1] - 1
            notes = [
                f"token {ids[f]}{', last' if is_last else ''}"
                for f, is_last in zip(
                    flat_at[: self.loc.max_examples], last[: self.loc.max_examples], strict=True
                )
            ]
            self.add(
                self.loc.issue(
                    "E204",
                    "error",
                    f"{column} null on a loss position",
                    rows,
                    n_null_loss,
                    pos=flat_at - offsets[rows],
                    notes=notes,
                    hint="appended EOS or unsampled token? drop it from loss_mask",
                )
            )
        if self.on("E302") and column in self.table.stream_columns:
            self._null_pattern_shift(column, flat, view, offsets, n_null_loss)
        n_valid = flat.values.shape[0] if flat.valid is None else int(np.count_nonzero(flat.valid))
        n_outside = n_valid - (n_loss_total - n_null_loss)
        if n_outside > 0 and self.on("W214"):
            loss = self.table.lists["loss_mask"].values
            outside = ~loss if flat.valid is None else (flat.valid & ~loss)
            flat_at = np.flatnonzero(outside)[: self.loc.max_examples]
            rows = _row_of(offsets, flat_at)
            self.add(
                self.loc.issue(
                    "W214",
                    "warning",
                    f"{as_template(column)} set on {{n:,}} non-loss positions (ignored)",
                    rows,
                    n_outside,
                    pos=flat_at - offsets[rows],
                    sums=(("n", n_outside),),
                )
            )
        if self.on("E207"):
            # loss positions (null ones are NaN in `at_loss`, so test them as valid only), then any
            # non-null value outside the mask (rare: W214)
            bad = ~np.isfinite(at_loss)
            if n_null_loss:
                bad &= valid_at_loss
            bad_index = view.index[np.flatnonzero(bad)]
            if n_outside > 0:
                loss = self.table.lists["loss_mask"].values
                outside_bad = ~np.isfinite(flat.values) & ~loss
                if flat.valid is not None:
                    outside_bad &= flat.valid
                bad_index = np.sort(np.concatenate([bad_index, np.flatnonzero(outside_bad)]))
            if bad_index.size:
                rows = _row_of(offsets, bad_index)
                bad_values = flat.values[bad_index]
                n_nan = int(np.isnan(bad_values).sum())
                n_pos = int((bad_values == np.inf).sum())
                n_neg = int(bad_values.size - n_nan - n_pos)
                self.add(
                    self.loc.issue(
                        "E207",
                        "error",
                        f"{as_template(column)}: {{nan}} NaN, {{pos}} +inf, {{neg}} -inf",
                        rows,
                        bad_index.size,
                        pos=bad_index - offsets[rows],
                        sums=(("nan", n_nan), ("pos", n_pos), ("neg", n_neg)),
                    )
                )
        if column in self.table.stream_columns:
            self._logprob_values(column, at_loss, view, offsets)

    def _null_pattern_shift(
        self, column: str, flat: FlatList, view: LossView, offsets: np.ndarray, n_null_loss: int
    ) -> None:
        """E302 by nulls: in every sample the stream is null on the last loss token and set just before the
        first one, the signature of next-token-aligned values stored one position early (judged over the run:
        `NullShiftPart`)."""
        n_loss = np.diff(view.row_start)
        rows = np.flatnonzero(n_loss > 0)
        if not n_null_loss or flat.valid is None:  # no null on a loss token: the pattern breaks in every row
            none = (None, None, None)
            self.pending.append(NullShiftPart(column, int(rows.size), not rows.size, (), none, 0))
            return
        first = view.index[view.row_start[rows]]
        last_token = view.row_start[rows + 1] - 1
        null_last = ~view.valid[column][last_token]
        before_ok = first > offsets[rows]
        set_before = np.zeros(rows.size, dtype=bool)
        set_before[before_ok] = flat.valid[first[before_ok] - 1]
        holds = bool((null_last & set_before).all())
        part = NullShiftPart(
            column,
            n_rows=int(rows.size),
            holds=holds,
            examples=self.loc.examples(rows) if holds else (),
            first=self.loc.first(rows) if holds else (None, None, None),
            max_examples=self.loc.max_examples,
        )
        self.pending.append(part)
        verdict = part.issue()
        if verdict is not None:
            self.add(verdict)

    def _logprob_values(self, column: str, at_loss: np.ndarray, view: LossView, offsets: np.ndarray) -> None:
        positive = at_loss > LOGPROB_POSITIVE_TOL
        n_positive = int(np.count_nonzero(positive))
        if n_positive and self.on("E205"):
            where = np.flatnonzero(positive)
            rows = view.rows_of(where)
            self.add(
                self.loc.issue(
                    "E205",
                    "error",
                    f"{as_template(column)}: {{n}} positive values (max {{max:.3g}})",
                    rows,
                    n_positive,
                    pos=view.index[where] - offsets[rows],
                    sums=(("n", n_positive),),
                    maxima=(("max", float(at_loss[where].max())),),
                )
            )
        if not (self.on("E206") or self.on("W216")):
            return
        at_loss = self._without_singletons(column, at_loss, view)
        filled = zero_fill_rows(at_loss, view.row_start)
        zero, all_zero_rows = filled.zero, filled.all_zero_rows
        tiny = np.flatnonzero((at_loss > 0.0) & ~positive)
        zero_rows = view.rows_of(zero)
        tiny_rows = view.rows_of(tiny)
        zero_pos = view.index[zero] - offsets[zero_rows]
        tiny_pos = view.index[tiny] - offsets[tiny_rows]
        part = ZeroFillPart(
            column,
            n_zero=int(zero.size),
            n_loss=int(at_loss.shape[0]),
            n_tiny=int(tiny.size),
            n_all_zero_rows=int(all_zero_rows.size),
            zero=self.loc.examples(zero_rows, pos=zero_pos),
            rows=self.loc.examples(all_zero_rows),
            tiny=self.loc.examples(tiny_rows, pos=tiny_pos),
            first_zero=self.loc.first(zero_rows, zero_pos),
            first_row=self.loc.first(all_zero_rows),
            first_tiny=self.loc.first(tiny_rows, tiny_pos),
            max_examples=self.loc.max_examples,
            e206=self.on("E206"),
            w216=self.on("W216"),
        )
        self.pending.append(part)
        verdict = part.issue()
        if verdict is not None:
            self.add(verdict)

    def _without_singletons(self, column: str, at_loss: np.ndarray, view: LossView) -> np.ndarray:
        """`at_loss` with the sampling stream's values where the recorded kept set holds one token replaced by
        -1: a renormalised log-prob there is exactly 0.0 by right, so the zero-fill rules (E206, W216) skip it."""
        if self.table.kept is None or column != "rollout_logprobs":
            return at_loss
        sizes = position_sizes(self.table.kept, self.table.lists["input_ids"].offsets)[view.index]  # (M,)
        single = sizes == 1
        if not single.any():
            return at_loss
        out = at_loss.copy()
        out[single & (at_loss >= 0.0)] = -1.0
        return out


def missing_columns(columns: Collection[str], required: Sequence[str]) -> list[Issue]:
    """E102 for every column of `required` absent from `columns`."""
    issues = []
    for column in required:
        if column not in columns:
            hint = REQUIRED_HINTS.get(column, "re-import with pgdiag import")
            issues.append(Issue("E102", "error", 1, f"missing column {column}", hint=hint))
    return issues


def validate_rows(
    table: RowTable,
    *,
    ignore: Collection[str] = (),
    max_examples: int = 5,
    vocab_size: int | None = None,
) -> RowIssues:
    """Run every row and token rule on `table` and collect the issues (nothing raises)."""
    rules = _Rules(table, ignore=ignore, max_examples=max_examples, vocab_size=vocab_size)
    rules.structure()
    rules.scalars()
    rules.seq_hash()
    if not rules.bad.any():
        view = loss_view(table)
        rules.tokens(view)
        return RowIssues(rules.issues, None, table, view, rules.pending)
    sound = subset_rows(table, np.flatnonzero(~rules.bad))
    view = loss_view(sound)
    if sound.n_rows:
        token_rules = _Rules(sound, ignore=ignore, max_examples=max_examples, vocab_size=vocab_size)
        token_rules.tokens(view)
        rules.issues.extend(token_rules.issues)
        rules.pending.extend(token_rules.pending)
    return RowIssues(rules.issues, rules.bad, sound, view, rules.pending)
