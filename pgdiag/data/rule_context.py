"""What every row and token rule of `data.validate` shares: the `Locator` that names examples (file, step,
sample, pos) in one-line messages, and the `RuleContext` of one `RowTable` (issues found, run-level rule shares,
rows excluded for structural errors, ignored codes).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np
import polars as pl

from pgdiag.data.flat import RowTable
from pgdiag.data.issues import Example, First, Issue, MessageParts, as_template
from pgdiag.data.run_rules import PendingRule


class Locator:
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


def null_mask(frame: pl.DataFrame, column: str) -> np.ndarray:
    """(R,) bool: rows where `column` is null."""
    return frame[column].is_null().to_numpy()


class RuleContext:
    """What the row and token rules share over one `RowTable`: its locator, the issues found so far, the run-level
    rule shares (`PendingRule`) and the rows excluded for structural errors."""

    def __init__(
        self, table: RowTable, *, ignore: Collection[str], max_examples: int, vocab_size: int | None
    ):
        self.table = table
        self.frame = table.frame
        self.ignore = set(ignore)
        self.loc = Locator(table.frame, max_examples)
        self.vocab_size = vocab_size
        self.issues: list[Issue] = []
        self.pending: list[PendingRule] = []  # shares of the rules judged over the run (`merge_piece_issues`)
        self.bad = np.zeros(table.n_rows, dtype=bool)

    def on(self, code: str) -> bool:
        return code not in self.ignore

    def add(self, issue: Issue) -> None:
        self.issues.append(issue)

    def flag(
        self, where: np.ndarray, code: str, severity: str, text: str, *, hint: str | None = None
    ) -> None:
        """Add `code` at the rows where the (R,) bool `where` holds, when any does; a `text` with an ``{n}``
        field gets their number there (`Locator.issue`'s `sums`)."""
        if where.any():
            rows = np.flatnonzero(where)
            sums = (("n", int(rows.size)),) if "{n}" in text else ()
            self.add(self.loc.issue(code, severity, text, rows, rows.size, hint=hint, sums=sums))
