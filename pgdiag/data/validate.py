"""Validation of loaded rollout rows (E102-E103, E201-E213, W214-W217).

Why: bad input must never turn into a wrong number, so every reader validates before it computes. How: the
reader (`pgdiag.data.runs`) hands over a `RowTable`, the scalar columns as a polars frame plus every list column
flattened into one `FlatList` (offsets + values + element validity). Each rule is a handful of vectorised numpy
operations over those flat buffers and per-row offsets (cumulative sums, bincount, repeat), never a Python loop
over tokens. Every violation becomes one `Issue` whose one-line message names the file, step, sample, position
and column of at most `max_examples` locations plus a count of the rest. Rules whose code is in `ignore` are
skipped. Rows with structural errors (E201, E202, E213 on ids or mask) are reported in `RowIssues.bad_rows` and
excluded from the token rules, which would otherwise read misaligned values.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import polars as pl

from pgdiag.data.flat import METADATA_LISTS, FlatList, LossView, RowTable, loss_view, subset_rows
from pgdiag.data.kept import kept_issues, position_sizes
from pgdiag.data.schema import REQUIRED_HINTS
from pgdiag.data.seqhash import seq_hashes
from pgdiag.errors import (
    EXIT_GATE,
    EXIT_INVALID,
    EXIT_OK,
    InvalidInputError,
    UsageError,
    catalogued,
    one_line,
)

LOGPROB_POSITIVE_TOL = 1e-6
ZERO_FILL_FRACTION = 0.01
ISSUE_SCHEMA = {
    "code": pl.String,
    "severity": pl.String,
    "count": pl.Int64,
    "message": pl.String,
    "step": pl.Int64,
    "sample_id": pl.String,
    "pos": pl.Int64,
}


@dataclass(frozen=True)
class ZeroFill:
    """Exact zeros of one log-prob stream on its loss positions, by the E206 rule."""

    zero: np.ndarray  # (Z,) token indices holding exactly 0.0
    all_zero_rows: np.ndarray  # (R,) samples with >= 2 loss values, every one exactly 0.0
    fraction: float  # Z / M

    @property
    def fraction_filled(self) -> bool:
        return self.fraction > ZERO_FILL_FRACTION


def zero_fill_rows(values: np.ndarray, offsets: np.ndarray) -> ZeroFill:
    """The one-stream zero-fill rule (E206: > 1 % exact 0.0, or a sample whose >= 2 loss values are all 0.0)
    on the (M,) loss-position values of one stream, samples delimited by `offsets` (S + 1,)."""
    zero = np.flatnonzero(values == 0.0)
    n_loss = np.diff(offsets)
    rows = np.searchsorted(offsets, zero, side="right") - 1
    zero_per_row = np.bincount(rows, minlength=n_loss.shape[0])
    all_zero_rows = np.flatnonzero((zero_per_row == n_loss) & (n_loss >= 2))
    fraction = zero.size / values.shape[0] if values.shape[0] else 0.0
    return ZeroFill(zero, all_zero_rows, fraction)


def zero_against_other(values: np.ndarray, other: np.ndarray) -> np.ndarray:
    """(Z,) token indices where `values` is exactly 0.0 while the other stream of the pair is below −1 (a token
    it gives p < 0.37 cannot have p = 1 here): the pair form of the E206 zero-fill rule, on (M,) arrays."""
    zero = np.flatnonzero(values == 0.0)
    with np.errstate(invalid="ignore"):
        return zero[other[zero] < -1.0]


@dataclass(frozen=True)
class CheckSettings:
    """What every command's checks skip and show: codes to ignore and examples per issue."""

    ignore: tuple[str, ...] = ()  # check codes to skip (E306, E207, W4xx, ...)
    max_examples: int = 5  # example locations listed per issue

    def __post_init__(self) -> None:
        object.__setattr__(self, "ignore", tuple(self.ignore))
        if self.max_examples < 0:
            raise UsageError("E503", f"--max-examples must be >= 0 (got {self.max_examples})")


Example = tuple[str | None, str]  # (file or None, "step s, sample x, pos p[, note]") of one example location


def as_template(text: str) -> str:
    """`text` as a `str.format` template that renders to itself."""
    return text.replace("{", "{{").replace("}", "}}")


@dataclass(frozen=True)
class MessageParts:
    """What an issue's message is made of, so that the issues of a run read in pieces merge into the message one
    read gives (`merge_piece_issues`): the text as a template whose fields are the counts it states (`sums`, added
    over the pieces; `maxima`, the largest), and the first example locations (concatenated over the pieces, the
    first `max_examples` shown). `located`: the reader's layout, ``[file: ]text (ex; ex); N more`` with the file
    named once when every shown example is in it; else ``template`` has an ``{examples}`` field (joined by
    `joiner`) and `more` (``{n}`` = the examples not shown) follows when some are not shown."""

    template: str
    sums: tuple[tuple[str, int], ...] = ()
    maxima: tuple[tuple[str, float], ...] = ()
    examples: tuple[Example, ...] = ()
    max_examples: int = 5
    located: bool = True
    joiner: str = "; "
    more: str = ""
    once: bool = False  # a finding about the whole run that every piece repeats: kept once, count not added

    def render(self, count: int) -> str:
        values: dict[str, object] = {**dict(self.sums), **dict(self.maxima)}
        shown = self.examples[: max(0, self.max_examples)]
        if not self.located:
            message = self.template.format(**values, examples=self.joiner.join(loc for _, loc in shown))
            return message + (self.more.format(n=count - len(shown)) if count > len(shown) else "")
        files = [file for file, _ in shown]
        single_file = len(set(files)) <= 1
        bits = [loc if single_file else f"file {file}, {loc}" for file, loc in shown]
        prefix = f"{files[0]}: " if files and single_file and files[0] is not None else ""
        message = prefix + self.template.format(**values)
        if bits:
            message += f" ({'; '.join(bits)})"
        if count > len(bits) and bits:
            message += f"; {count - len(bits)} more"
        return message

    def merge(self, other: MessageParts) -> MessageParts:
        """`self` then `other` (a later piece): counts added, maxima the larger, examples concatenated."""
        later = dict(other.sums)
        highs = dict(other.maxima)
        return replace(
            self,
            sums=tuple((k, v + later.get(k, 0)) for k, v in self.sums),
            maxima=tuple((k, max(v, highs.get(k, v))) for k, v in self.maxima),
            examples=(self.examples + other.examples)[: max(0, self.max_examples)],
        )


@dataclass(frozen=True)
class Issue:
    """One violated rule: its code, severity, how many locations violate it, and the first location.

    `parts` (when set) rebuilds the message from its counts and examples when pieces merge; `pooled` marks the
    verdict of one piece on a rule judged over the run (`PendingRule`), replaced when pieces merge."""

    code: str
    severity: str  # "error" | "warning" | "note"
    count: int
    message: str
    step: int | None = None
    sample_id: str | None = None
    pos: int | None = None
    hint: str | None = None
    rule: str | None = field(default=None, compare=False)  # the message before its locations (merge key)
    parts: MessageParts | None = field(default=None, compare=False)
    pooled: tuple[str, str] | None = field(
        default=None, compare=False
    )  # the `PendingRule.key` it is a verdict of

    def __post_init__(self) -> None:
        if (
            self.severity != "note"
        ):  # a note (rows dropped at import) carries the code "note", not a catalogue code
            catalogued(self.code)  # ValueError for a code outside the catalogue: a bug in pgdiag
        object.__setattr__(
            self, "message", one_line(self.message)
        )  # an id holding a line break stays one line


First = tuple[int | None, str | None, int | None]  # (step, sample_id, pos) of an issue's first location


@dataclass(frozen=True)
class ZeroFillPart:
    """One piece's share of the one-stream zero-fill rule on one column, judged over the run (`merge_piece_issues`):
    E206 when more than `ZERO_FILL_FRACTION` of the run's loss values are exactly 0.0 (the run's share, not the
    piece's) or a sample's >= 2 loss values are all 0.0; else W216 for any 0.0 or value in (0, 1e-6]."""

    column: str
    n_zero: int
    n_loss: int
    n_tiny: int
    n_all_zero_rows: int
    zero: tuple[Example, ...]  # first exact-0.0 tokens
    rows: tuple[Example, ...]  # first all-zero samples
    tiny: tuple[Example, ...]  # first (0, 1e-6] tokens (W216 lists the 0.0 ones first)
    first_zero: First
    first_row: First
    first_tiny: First
    max_examples: int
    e206: bool = True  # the codes not ignored
    w216: bool = True

    @property
    def key(self) -> tuple[str, str]:
        return ("zero_fill", self.column)

    def merge(self, other: ZeroFillPart) -> ZeroFillPart:
        """`self` then `other` (a later piece): counts added, examples concatenated, first locations kept."""
        k = self.max_examples
        return replace(
            self,
            n_zero=self.n_zero + other.n_zero,
            n_loss=self.n_loss + other.n_loss,
            n_tiny=self.n_tiny + other.n_tiny,
            n_all_zero_rows=self.n_all_zero_rows + other.n_all_zero_rows,
            zero=(self.zero + other.zero)[:k],
            rows=(self.rows + other.rows)[:k],
            tiny=(self.tiny + other.tiny)[:k],
            first_zero=self.first_zero if self.n_zero else other.first_zero,
            first_row=self.first_row if self.n_all_zero_rows else other.first_row,
            first_tiny=self.first_tiny if self.n_tiny else other.first_tiny,
        )

    def issue(self) -> Issue | None:
        """The verdict on the rows counted so far (the whole run once every piece is merged)."""
        fraction = self.n_zero / self.n_loss if self.n_loss else 0.0
        filled = fraction > ZERO_FILL_FRACTION
        column = as_template(self.column)
        if (filled or self.n_all_zero_rows) and self.e206:
            if self.n_all_zero_rows and not filled:
                template = f"{column}: {{n}} samples with every loss value exactly 0.0"
                count, examples, first = self.n_all_zero_rows, self.rows, self.first_row
                sums: tuple[tuple[str, int], ...] = (("n", count),)
            else:
                template = as_template(f"{self.column}: {100 * fraction:.1f} % exact 0.0 on loss positions")
                count, examples, first, sums = self.n_zero, self.zero, self.first_zero, ()
            code, severity, hint = "E206", "error", "missing values written as 0? import them as null"
        elif (self.n_zero or self.n_tiny) and self.w216:
            template = f"{column}: {{z}} exact 0.0 and {{t}} in (0, 1e-6] (p≈1 tokens or fills)"
            count, examples = self.n_zero + self.n_tiny, self.zero + self.tiny
            first = self.first_zero if self.n_zero else self.first_tiny
            sums = (("z", self.n_zero), ("t", self.n_tiny))
            code, severity, hint = "W216", "warning", None
        else:
            return None
        parts = MessageParts(template, sums, (), examples, self.max_examples)
        return Issue(
            code,
            severity,
            count,
            parts.render(count),
            *first,
            hint=hint,
            rule=template,
            parts=parts,
            pooled=self.key,
        )


@dataclass(frozen=True)
class NullShiftPart:
    """One piece's share of the null-pattern E302 rule on one stream column, judged over the run: the stream is
    null on the last loss token and set just before the first one in every sample with loss tokens of the run."""

    column: str
    n_rows: int  # samples with loss tokens
    holds: bool  # every one of them shows the pattern
    examples: tuple[Example, ...]
    first: First
    max_examples: int

    @property
    def key(self) -> tuple[str, str]:
        return ("null_shift", self.column)

    def merge(self, other: NullShiftPart) -> NullShiftPart:
        return replace(
            self,
            n_rows=self.n_rows + other.n_rows,
            holds=self.holds and other.holds,
            examples=(self.examples + other.examples)[: self.max_examples],
            first=self.first if self.n_rows else other.first,
        )

    def issue(self) -> Issue | None:
        if not (self.n_rows and self.holds):
            return None
        template = as_template(
            f"{self.column} looks shifted by -1: set just before each loss span and null on the last loss token"
        )
        parts = MessageParts(template, (), (), self.examples, self.max_examples)
        return Issue(
            "E302",
            "error",
            self.n_rows,
            parts.render(self.n_rows),
            *self.first,
            hint="next-token aligned values? re-import with pgdiag import --shift 1",
            rule=template,
            parts=parts,
            pooled=self.key,
        )


PendingRule = ZeroFillPart | NullShiftPart


@dataclass(frozen=True)
class CheckResult:
    """Issues of one validation or check, as a tidy frame, with their counts and the resulting exit code."""

    issues: pl.DataFrame  # code, severity, count, message, step, sample_id, pos
    n_errors: int
    n_warnings: int
    exit_code: int  # 0 ok, 3 any error, 1 warnings only under strict
    hints: tuple[str | None, ...] = ()  # hint of each issue row, in order
    found: tuple[Issue, ...] = ()  # the issues themselves, in row order (`merge_check_results` reads them)
    pending: tuple[PendingRule, ...] = ()  # this piece's share of the rules judged over the run


def _merge_pending(pending: Sequence[Sequence[PendingRule]]) -> dict[tuple[str, str], PendingRule]:
    merged: dict[tuple[str, str], PendingRule] = {}
    for piece in pending:
        for part in piece:
            held = merged.get(part.key)
            merged[part.key] = part if held is None else held.merge(part)  # type: ignore[arg-type]
    return merged


def merge_piece_issues(
    pieces: Sequence[Sequence[Issue]], pending: Sequence[Sequence[PendingRule]] = ()
) -> list[Issue]:
    """The issues of a run read in pieces of consecutive steps, as one list, as one read of the run gives them.

    Rules judged over the run (`pending`: each piece's `ZeroFillPart`/`NullShiftPart`, one list per piece) are
    judged again on their merged counts, replacing the pieces' own verdicts (`Issue.pooled`). Other issues of the
    same code, severity and rule (`Issue.rule`: the message template before its counts and locations; issues
    without one merge by code and severity) are one issue whose count is the sum; with `Issue.parts` its message
    is rebuilt from the summed counts and the concatenated examples (the first `max_examples` shown, then how
    many more), which is the message one read gives wherever the examples fall in row order; without parts the
    first piece's message is kept and then says how many more the later pieces found (" [+N in later steps]").
    Location and hint are the first piece's. One piece: unchanged."""
    if len(pieces) == 1:
        return list(pieces[0])
    rules = _merge_pending(pending)
    verdicts = {key: part.issue() for key, part in rules.items()}
    merged: dict[tuple[str, str, str], tuple[Issue, int, MessageParts | None]] = {}
    out_keys: list[tuple[str, str, str] | tuple[str, str]] = []
    for piece in pieces:
        for issue in piece:
            if issue.pooled is not None and issue.pooled in rules:
                if issue.pooled not in out_keys:
                    out_keys.append(issue.pooled)
                continue
            key = (issue.code, issue.severity, issue.rule or "")
            if key not in merged:
                merged[key] = (issue, issue.count, issue.parts)
                out_keys.append(key)
                continue
            first, total, parts = merged[key]
            if parts is not None and parts.once:
                continue
            joined = None if parts is None or issue.parts is None else parts.merge(issue.parts)
            merged[key] = (first, total + issue.count, joined)
    out_keys += [k for k in rules if k not in out_keys]
    out = []
    for key in out_keys:
        if len(key) == 2:
            verdict = verdicts.get(key)  # type: ignore[call-overload]
            if verdict is not None:
                out.append(verdict)
            continue
        first, total, parts = merged[key]  # type: ignore[index]
        if parts is not None:
            out.append(replace(first, count=total, message=parts.render(total), parts=parts))
            continue
        later = total - first.count
        message = first.message if later == 0 else f"{first.message} [+{later} in later steps]"
        out.append(replace(first, count=total, message=message))
    return out


def check_result(
    issues: Sequence[Issue], *, strict: bool = False, pending: Sequence[PendingRule] = ()
) -> CheckResult:
    """Bundle `issues` (errors first, then by code) into a `CheckResult` with its exit code; `pending` is the
    share of the rules judged over the run when `issues` are those of one piece (`merge_check_results`)."""
    ordered = sorted(issues, key=lambda issue: (issue.severity != "error", issue.code))
    frame = pl.DataFrame(
        {
            "code": [i.code for i in ordered],
            "severity": [i.severity for i in ordered],
            "count": [i.count for i in ordered],
            "message": [i.message for i in ordered],
            "step": [i.step for i in ordered],
            "sample_id": [i.sample_id for i in ordered],
            "pos": [i.pos for i in ordered],
        },
        schema=ISSUE_SCHEMA,
    )
    n_errors = sum(1 for i in ordered if i.severity == "error")
    n_warnings = len(ordered) - n_errors
    if n_errors:
        exit_code = EXIT_INVALID
    elif n_warnings and strict:
        exit_code = EXIT_GATE
    else:
        exit_code = EXIT_OK
    return CheckResult(
        frame, n_errors, n_warnings, exit_code, tuple(i.hint for i in ordered), tuple(ordered), tuple(pending)
    )


def raise_first_error(issues: Sequence[Issue]) -> None:
    """InvalidInputError with the first error of `issues` by code (their order among equal codes); else nothing."""
    errors = sorted((i for i in issues if i.severity == "error"), key=lambda i: i.code)
    if errors:
        raise InvalidInputError(errors[0].code, errors[0].message, errors[0].hint)


def merge_check_results(results: Sequence[CheckResult], *, strict: bool = False) -> CheckResult:
    """The checks of a run read in pieces as one `CheckResult` (`merge_piece_issues`: the rules judged over the
    run judged on the pieces' merged counts; one issue per code, severity and rule, counts added, examples
    concatenated, the first piece's location)."""
    found = merge_piece_issues([r.found for r in results], [r.pending for r in results])
    return check_result(found, strict=strict)


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
