"""Validation of loaded rollout rows (E102-E103, E201-E213, W214-W217): the row and token rules.

Why: bad input must never turn into a wrong number, so every reader validates before it computes. How: the
reader (`pgdiag.data.runs`) hands over a `RowTable`, the scalar columns as a polars frame plus every list column
flattened into one `FlatList` (offsets + values + element validity). Each rule is a handful of vectorised numpy
operations over those flat buffers and per-row offsets (cumulative sums, bincount, repeat), never a Python loop
over tokens. Every violation becomes one `Issue` whose one-line message names the file, step, sample, position
and column of at most `max_examples` locations plus a count of the rest. Rules whose code is in `ignore` are
skipped. Rows with structural errors (E201, E202, E213 on ids or mask) are reported in `RowIssues.bad_rows` and
excluded from the token rules, which would otherwise read misaligned values. The rules live by family:
`data.row_rules` (structure, scalar columns, seq_hash), `data.token_rules` (loss positions, token ids, kept sets,
metadata lists), `data.stream_rules` (each per-token float column), over the shared `data.rule_context`. The
issue model lives in `data.issues`, the rules judged over a whole run in `data.run_rules`.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import numpy as np

from pgdiag.data.flat import RowTable, subset_rows
from pgdiag.data.issues import (
    ISSUE_SCHEMA,
    CheckResult,
    CheckSettings,
    Issue,
    MessageParts,
    as_template,
    check_result,
    merge_check_results,
    merge_piece_issues,
    raise_first_error,
)
from pgdiag.data.loss_view import LossView, loss_view
from pgdiag.data.row_rules import scalar_rules, seq_hash_rule, structure_rules
from pgdiag.data.rule_context import RuleContext
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
from pgdiag.data.stream_rules import LOGPROB_POSITIVE_TOL
from pgdiag.data.token_rules import token_rules
from pgdiag.errors import Code

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


def missing_columns(columns: Collection[str], required: Sequence[str]) -> list[Issue]:
    """E102 for every column of `required` absent from `columns`."""
    issues = []
    for column in required:
        if column not in columns:
            hint = REQUIRED_HINTS.get(column, "re-import with pgdiag import")
            issues.append(Issue(Code.MISSING_COLUMN, "error", 1, f"missing column {column}", hint=hint))
    return issues


def validate_rows(
    table: RowTable,
    *,
    ignore: Collection[str] = (),
    max_examples: int = 5,
    vocab_size: int | None = None,
) -> RowIssues:
    """Run every row and token rule on `table` and collect the issues (nothing raises)."""
    rules = RuleContext(table, ignore=ignore, max_examples=max_examples, vocab_size=vocab_size)
    structure_rules(rules)
    scalar_rules(rules)
    seq_hash_rule(rules)
    if not rules.bad.any():
        view = loss_view(table)
        token_rules(rules, view)
        return RowIssues(rules.issues, None, table, view, rules.pending)
    sound = subset_rows(table, np.flatnonzero(~rules.bad))
    view = loss_view(sound)
    if sound.n_rows:
        sound_rules = RuleContext(sound, ignore=ignore, max_examples=max_examples, vocab_size=vocab_size)
        token_rules(sound_rules, view)
        rules.issues.extend(sound_rules.issues)
        rules.pending.extend(sound_rules.pending)
    return RowIssues(rules.issues, rules.bad, sound, view, rules.pending)
