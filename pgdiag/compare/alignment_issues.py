"""The issues of aligning two runs, raised at once or held back over the pieces of a run read step by step.

What: `raise_or_record(issue, ignore, issues)` raises an error (`InvalidInputError`, exit 3, with the hint of
`ALIGN_HINTS`) unless its code is ignored, and lists a warning. `Deferred` holds the counts behind E304 (nothing
matched), E306 (samples on one side only), E303/W303 (loss masks differ) and E302's pooled shift sample for one
piece of a run (`pgdiag.compare.align.align_batches` with ``deferred=True``); `Deferred.merge` pools consecutive
pieces and its `*_issues` methods raise or list them as a run read whole would (first locations in step order).
`unmatched_side` gives the counts of a piece where only one run has samples.

Why apart: whether two runs match is a property of the whole runs, so a comparison read in pieces must decide
these issues after the last piece, with the same messages as a comparison of the whole runs.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, replace

import numpy as np

from pgdiag.checks.pairs import ShiftSample, shift_verdict
from pgdiag.checks.samples import mask_issue
from pgdiag.compare.matching import JOIN_KEYS
from pgdiag.data.batch import TokenBatch
from pgdiag.data.validate import Issue
from pgdiag.errors import Code, InvalidInputError

ALIGN_HINTS = {
    Code.TOKENS_DIFFER: "compare runs built from the same token ids (retokenized text or template drift?)",
    Code.NOTHING_MATCHED: "check --steps and --join (hash joins match sequences whose sample ids differ)",
    Code.UNMATCHED_SAMPLES: "compare matched samples only with --ignore E306",
}


def raise_or_record(issue: Issue, ignore: Collection[str], issues: list[Issue]) -> None:
    if issue.code in ignore:
        return
    if issue.severity == "error":
        hint = issue.hint or ALIGN_HINTS.get(issue.code)
        raise InvalidInputError(issue.code, issue.message, hint)
    issues.append(issue)


def where_text(step: np.ndarray, sample_id: np.ndarray, row: int, pos: int | None = None) -> str:
    text = f"step {int(step[row])}, sample {sample_id[row]}"
    return text if pos is None else f"{text}, pos {pos}"


@dataclass(frozen=True)
class Deferred:
    """The counts behind E304, E306 and E303/W303 of one piece of a run read step by step (`align_batches`
    with ``deferred=True``); `merge` pools consecutive pieces and `issues` raises or lists them as a run read
    whole would (first locations in step order)."""

    pair_name: str
    label_a: str
    label_b: str
    join: str
    n_a: int  # samples of side a
    n_b: int
    n_matched: int
    only_a: int  # samples of a with no match in b
    only_b: int
    first_only: tuple[str, int, str] | None  # (text, step, sample_id) of the first unmatched sample
    first_only_b: tuple[str, int, str] | None  # the first unmatched sample of b (used when a has none)
    steps: tuple[int, int] | None  # (min, max) step of side a
    steps_b: tuple[int, int] | None
    mask_only_a: int = 0  # matched loss positions on side a only
    mask_a: int = 0  # matched loss positions of side a
    mask_only_b: int = 0
    mask_b: int = 0
    mask_first: tuple[str, int, str, int] | None = (
        None  # (text, step, sample_id, pos) of the first difference
    )
    shift: ShiftSample | None = None  # E302's sample of the matched tokens, pooled over the pieces
    shift_names: tuple[str, str] = ("", "")  # (name_a, name_b) of the E302 message

    def merge(self, other: Deferred) -> Deferred:
        def span(x: tuple[int, int] | None, y: tuple[int, int] | None) -> tuple[int, int] | None:
            return x if y is None else y if x is None else (min(x[0], y[0]), max(x[1], y[1]))

        return replace(
            self,
            n_a=self.n_a + other.n_a,
            n_b=self.n_b + other.n_b,
            n_matched=self.n_matched + other.n_matched,
            only_a=self.only_a + other.only_a,
            only_b=self.only_b + other.only_b,
            first_only=self.first_only or other.first_only,
            first_only_b=self.first_only_b or other.first_only_b,
            steps=span(self.steps, other.steps),
            steps_b=span(self.steps_b, other.steps_b),
            mask_only_a=self.mask_only_a + other.mask_only_a,
            mask_a=self.mask_a + other.mask_a,
            mask_only_b=self.mask_only_b + other.mask_only_b,
            mask_b=self.mask_b + other.mask_b,
            mask_first=self.mask_first or other.mask_first,
            shift=self.shift
            if other.shift is None
            else other.shift
            if self.shift is None
            else self.shift.merge(other.shift),
            shift_names=self.shift_names if self.shift is not None else other.shift_names,
        )

    def unmatched_issues(self, ignore: Collection[str]) -> list[Issue]:
        """E304 (raised) when nothing matched, then E306 (raised unless ignored, else dropped)."""
        if self.n_matched == 0:
            raise InvalidInputError(
                Code.NOTHING_MATCHED,
                f"{self.pair_name}: 0 of {self.n_a} samples matched by {JOIN_KEYS[self.join]}; steps "
                f"{span_text(self.steps)} vs {span_text(self.steps_b)}",
                ALIGN_HINTS[Code.NOTHING_MATCHED],
            )
        issues: list[Issue] = []
        if self.only_a or self.only_b:
            first = self.first_only if self.only_a else self.first_only_b
            assert first is not None
            raise_or_record(
                Issue(
                    Code.UNMATCHED_SAMPLES,
                    "error",
                    self.only_a + self.only_b,
                    f"{self.pair_name}: {self.only_a} of {self.n_a} samples of {self.label_a} have no match in "
                    f"{self.label_b} and {self.only_b} of {self.n_b} of {self.label_b} none in {self.label_a} "
                    f"(first: {first[0]}; join {JOIN_KEYS[self.join]})",
                    first[1],
                    first[2],
                ),
                ignore,
                issues,
            )
        return issues

    def shift_issues(self, ignore: Collection[str]) -> list[Issue]:
        """E302 (raised unless ignored) on the matched tokens' sample pooled over the pieces (`ShiftSample`)."""
        if self.shift is None or Code.SHIFTED in ignore:
            return []
        name_a, name_b = self.shift_names
        found = shift_verdict(self.shift, name_a=name_a, name_b=name_b)
        issues: list[Issue] = []
        if found is not None:
            raise_or_record(replace(found, message=f"{self.pair_name}: {found.message}"), ignore, issues)
        return issues

    def mask_issues(self, ignore: Collection[str]) -> list[Issue]:
        """E303 (raised unless ignored) or W303 over the pooled loss positions of the matched samples."""
        if self.mask_first is None:
            return []
        text, step, sample_id, pos = self.mask_first
        found = mask_issue(
            self.mask_only_a,
            self.mask_a,
            self.mask_only_b,
            self.mask_b,
            f"{self.mask_only_a} only in {self.label_a}, {self.mask_only_b} only in {self.label_b}; first: "
            f"{text}; metrics use the intersection",
        )
        issues: list[Issue] = []
        if found is not None:
            found = replace(
                found, message=f"{self.pair_name}: {found.message}", step=step, sample_id=sample_id, pos=pos
            )
            raise_or_record(found, ignore, issues)
        return issues


def span_text(span: tuple[int, int] | None) -> str:
    if span is None:
        return "none"
    return str(span[0]) if span[0] == span[1] else f"{span[0]}-{span[1]}"


def step_span(step: np.ndarray) -> tuple[int, int] | None:
    return None if step.size == 0 else (int(step.min()), int(step.max()))


def first_unmatched(batch: TokenBatch, rows: np.ndarray) -> tuple[str, int, str] | None:
    """(text, step, sample_id) of the first of `rows`, for E306."""
    if rows.size == 0:
        return None
    r = int(rows[0])
    return (
        f"{where_text(batch.step, batch.sample_id, r)} of {batch.label}",
        int(batch.step[r]),
        str(batch.sample_id[r]),
    )


def unmatched_side(batch: TokenBatch, *, side: str, pair_name: str, label_other: str, join: str) -> Deferred:
    """The `Deferred` counts of a piece where only one run has samples (`side` "a" or "b"): all unmatched."""
    rows = np.arange(batch.n_samples)
    first = first_unmatched(batch, rows)
    empty = None  # no steps on the other side
    if side == "a":
        return Deferred(
            pair_name,
            batch.label,
            label_other,
            join,
            batch.n_samples,
            0,
            0,
            batch.n_samples,
            0,
            first,
            None,
            step_span(batch.step),
            empty,
        )
    return Deferred(
        pair_name,
        label_other,
        batch.label,
        join,
        0,
        batch.n_samples,
        0,
        0,
        batch.n_samples,
        None,
        first,
        empty,
        step_span(batch.step),
    )
