"""The issue model of every check: `Issue` (one finding: code, severity, count, one-line message, first
location), `CheckSettings`, `CheckResult`, and the merge of the issues of a run read in pieces
(`merge_piece_issues`, `merge_check_results`, `raise_first_error`).

Why in `data`: the reader applies the row and token rules (E1xx-E2xx, E206 included) to every piece it reads, and
every stage above it (check, metrics, compare, whatif, drift) gets its findings from the reader in this one model;
`checks` adds the cross-stream and cross-run rules on top (tests/test_layout.py states which stage may import
which).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import polars as pl

from pgdiag.errors import (
    EXIT_GATE,
    EXIT_INVALID,
    EXIT_OK,
    Code,
    InvalidInputError,
    UsageError,
    catalogued,
    one_line,
)

if TYPE_CHECKING:
    from pgdiag.data.run_rules import PendingRule

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
class CheckSettings:
    """What every command's checks skip and show: codes to ignore and examples per issue."""

    ignore: tuple[str, ...] = ()  # check codes to skip (E306, E207, W4xx, ...)
    max_examples: int = 5  # example locations listed per issue

    def __post_init__(self) -> None:
        object.__setattr__(self, "ignore", tuple(self.ignore))
        if self.max_examples < 0:
            raise UsageError(Code.BAD_OPTION_VALUE, f"--max-examples must be >= 0 (got {self.max_examples})")


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


def issues_frame(issues: Sequence[Issue]) -> pl.DataFrame:
    """The table of `issues`, a row each in their order (`ISSUE_SCHEMA`, also the checks table of a report)."""
    return pl.DataFrame(
        {name: [getattr(i, name) for i in issues] for name in ISSUE_SCHEMA}, schema=ISSUE_SCHEMA
    )


def check_result(
    issues: Sequence[Issue], *, strict: bool = False, pending: Sequence[PendingRule] = ()
) -> CheckResult:
    """Bundle `issues` (errors first, then by code) into a `CheckResult` with its exit code; `pending` is the
    share of the rules judged over the run when `issues` are those of one piece (`merge_check_results`)."""
    ordered = sorted(issues, key=lambda issue: (issue.severity != "error", issue.code))
    frame = issues_frame(ordered)
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
