"""Checks that two runs hold the same samples and tokens: E304 nothing matched, E301 matched samples whose
tokens differ, E303/W303 loss masks that differ (above/below 1 % of positions).

`mask_issue` is the one E303/W303 rule: `check` applies it to runs joined by (step, sample_id, segment_idx),
`compare` to the samples `compare.align` matched. Both check tokens (E301) before masks, so the two commands
name the same first error on the same pair.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl

from pgdiag.data.batch import TokenBatch
from pgdiag.data.validate import Issue
from pgdiag.errors import Code

MASK_ERROR_FRACTION = 0.01  # E303 above, W303 below


def mask_issue(n_only_a: int, n_a: int, n_only_b: int, n_b: int, detail: str) -> Issue | None:
    """E303 when over 1 % of either side's loss positions are not loss positions of the other, else W303 when
    any are; None when the masks agree."""
    if n_only_a + n_only_b == 0:
        return None
    fraction = max(n_only_a / max(n_a, 1), n_only_b / max(n_b, 1))
    code, severity = (
        (Code.MASKS_DIFFER, "error")
        if fraction > MASK_ERROR_FRACTION
        else (Code.MASKS_DIFFER_SLIGHTLY, "warning")
    )
    return Issue(
        code,
        severity,
        n_only_a + n_only_b,
        f"loss masks differ on {100 * fraction:.3g} % of positions ({detail})",
        hint="the two sides train different positions; check tool/observation tokens in loss_mask",
    )


def _sample_keys(batch: TokenBatch) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "step": batch.step.astype(np.int64),
            "sample_id": batch.sample_id.astype(str),
            "segment_idx": batch.segment_idx.astype(np.int32),
            "seq_hash": batch.seq_hash,
            "row": np.arange(batch.n_samples, dtype=np.int64),
        }
    )


def _step_range(step: np.ndarray) -> str:
    return f"{step.min()}-{step.max()}" if step.size else "none"


@dataclass(frozen=True)
class CrossRunParts:
    """The counts behind `cross_run_findings` of one piece of two runs (the same steps of each), mergeable over
    consecutive pieces: the issues of the merged parts are those of the two runs read whole."""

    label_a: str
    label_b: str
    n_a: int
    matched: int
    steps_a: tuple[int, int] | None  # (min, max)
    steps_b: tuple[int, int] | None
    n_differ: int  # matched samples whose seq_hash differs (E301)
    differ_examples: tuple[tuple[int, str], ...]  # first max_examples (step, sample_id), key order
    mask_only_a: int
    mask_a: int
    mask_only_b: int
    mask_b: int
    max_examples: int = 5  # examples shown (at least the first is kept for the issue's location)

    def merge(self, other: CrossRunParts) -> CrossRunParts:
        def span(x: tuple[int, int] | None, y: tuple[int, int] | None) -> tuple[int, int] | None:
            return x if y is None else y if x is None else (min(x[0], y[0]), max(x[1], y[1]))

        return CrossRunParts(
            self.label_a,
            self.label_b,
            self.n_a + other.n_a,
            self.matched + other.matched,
            span(self.steps_a, other.steps_a),
            span(self.steps_b, other.steps_b),
            self.n_differ + other.n_differ,
            (self.differ_examples + other.differ_examples)[: max(self.max_examples, 1)],
            self.mask_only_a + other.mask_only_a,
            self.mask_a + other.mask_a,
            self.mask_only_b + other.mask_only_b,
            self.mask_b + other.mask_b,
            self.max_examples,
        )


def _span(step: np.ndarray) -> tuple[int, int] | None:
    return (int(step.min()), int(step.max())) if step.size else None


def cross_run_parts(a: TokenBatch, b: TokenBatch, max_examples: int) -> CrossRunParts:
    """The `CrossRunParts` of two batches (a piece of each run, or each run whole)."""
    keys = ["step", "sample_id", "segment_idx"]
    joined = _sample_keys(a).join(_sample_keys(b), on=keys, how="inner", suffix="_b").sort(keys)
    differ = joined.filter(pl.col("seq_hash") != pl.col("seq_hash_b"))
    examples = tuple(
        (int(st), str(i))
        for st, i in differ.select("step", "sample_id").head(max(max_examples, 1)).iter_rows()
    )
    same = joined.filter(pl.col("seq_hash") == pl.col("seq_hash_b"))
    only_a = n_a = only_b = n_b = 0
    if same.height:
        sub_a, sub_b = a.select(same["row"].to_numpy()), b.select(same["row_b"].to_numpy())
        key_a = (sub_a.token_sample() << 32) | sub_a.pos.astype(np.int64)  # (M_a,) (matched sample, pos)
        key_b = (sub_b.token_sample() << 32) | sub_b.pos.astype(np.int64)
        n_both = np.intersect1d(key_a, key_b, assume_unique=True).size
        only_a, n_a, only_b, n_b = key_a.size - n_both, key_a.size, key_b.size - n_both, key_b.size
    return CrossRunParts(
        a.label,
        b.label,
        a.n_samples,
        joined.height,
        _span(a.step),
        _span(b.step),
        differ.height,
        examples,
        only_a,
        n_a,
        only_b,
        n_b,
    )


def one_side_parts(batch: TokenBatch, *, side: str, label_other: str, max_examples: int) -> CrossRunParts:
    """The parts of a piece where only one run (`side` "a" or "b") has samples: nothing matched."""
    if side == "a":
        return CrossRunParts(
            batch.label,
            label_other,
            batch.n_samples,
            0,
            _span(batch.step),
            None,
            0,
            (),
            0,
            0,
            0,
            0,
            max_examples,
        )
    return CrossRunParts(
        label_other, batch.label, 0, 0, None, _span(batch.step), 0, (), 0, 0, 0, 0, max_examples
    )


def _span_text(span: tuple[int, int] | None) -> str:
    return f"{span[0]}-{span[1]}" if span is not None else "none"


def cross_run_findings(parts: CrossRunParts) -> list[Issue]:
    """E304 (no sample matched by (step, sample_id, segment_idx)), E301 (matched, different tokens: their
    `seq_hash` differs), then E303/W303 (the loss positions of samples with equal tokens differ), from the
    (merged) parts of the two runs as read (`TokenBatch.seq_hash`), so no run is read again."""
    if parts.matched == 0:
        message = (
            f"0 of {parts.n_a} samples matched by (step, sample_id); steps {_span_text(parts.steps_a)} vs "
            f"{_span_text(parts.steps_b)}?"
        )
        return [Issue(Code.NOTHING_MATCHED, "error", parts.n_a, message)]
    issues: list[Issue] = []
    if parts.n_differ:
        shown = "; ".join(f"step {s}, sample {i}" for s, i in parts.differ_examples[: parts.max_examples])
        issues.append(
            Issue(
                Code.TOKENS_DIFFER,
                "error",
                parts.n_differ,
                f"{parts.n_differ} matched samples differ in tokens ({shown})",
                step=parts.differ_examples[0][0],
                sample_id=parts.differ_examples[0][1],
                hint="compare runs built from the same token ids (retokenized text or template drift?)",
            )
        )
    if parts.mask_a or parts.mask_b:
        detail = f"{parts.mask_only_a} only in {parts.label_a}, {parts.mask_only_b} only in {parts.label_b}"
        issue = mask_issue(parts.mask_only_a, parts.mask_a, parts.mask_only_b, parts.mask_b, detail)
        if issue is not None:
            issues.append(issue)
    return issues
