"""The rules judged over a whole run rather than a piece (E206/W216 one-stream zero fills, the E302 null-pattern
shift): each piece contributes a mergeable part (`ZeroFillPart`, `NullShiftPart`) and the verdict is taken on the
merged counts (`issues.merge_piece_issues`), so a run read in pieces gets the verdict a whole read gives.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from pgdiag.data.flat import row_of
from pgdiag.data.issues import Example, First, Issue, MessageParts, as_template
from pgdiag.errors import Code

ZERO_FILL_FRACTION = 0.01


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
    rows = row_of(offsets, zero)
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
            code, severity, hint = (
                Code.ZERO_FILLED,
                "error",
                "missing values written as 0? import them as null",
            )
        elif (self.n_zero or self.n_tiny) and self.w216:
            template = f"{column}: {{z}} exact 0.0 and {{t}} in (0, 1e-6] (p≈1 tokens or fills)"
            count, examples = self.n_zero + self.n_tiny, self.zero + self.tiny
            first = self.first_zero if self.n_zero else self.first_tiny
            sums = (("z", self.n_zero), ("t", self.n_tiny))
            code, severity, hint = Code.ISOLATED_ZEROS, "warning", None
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
            Code.SHIFTED,
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
