"""Checks that two runs hold the same samples and tokens: E304 nothing matched, E301 matched samples whose
tokens differ, E303/W303 loss masks that differ (above/below 1 % of positions).

`mask_issue` is the one E303/W303 rule: `check` applies it to runs joined by (step, sample_id, segment_idx),
`compare` to the samples `compare.align` matched. Both check tokens (E301) before masks, so the two commands
name the same first error on the same pair.
"""

from __future__ import annotations

import polars as pl

from pgdiag.data.runs import Run
from pgdiag.data.validate import Issue

MASK_ERROR_FRACTION = 0.01  # E303 above, W303 below


def mask_issue(n_only_a: int, n_a: int, n_only_b: int, n_b: int, detail: str) -> Issue | None:
    """E303 when over 1 % of either side's loss positions are not loss positions of the other, else W303 when
    any are; None when the masks agree."""
    if n_only_a + n_only_b == 0:
        return None
    fraction = max(n_only_a / max(n_a, 1), n_only_b / max(n_b, 1))
    code, severity = ("E303", "error") if fraction > MASK_ERROR_FRACTION else ("W303", "warning")
    return Issue(
        code,
        severity,
        n_only_a + n_only_b,
        f"loss masks differ on {100 * fraction:.3g} % of positions ({detail})",
        hint="the two sides train different positions; check tool/observation tokens in loss_mask",
    )


def cross_run_issues(run: Run, other: Run, max_examples: int) -> list[Issue]:
    """E304 (no sample matched by (step, sample_id, segment_idx)), E301 (matched, different tokens), E303/W303."""
    keys = ["step", "sample_id", "segment_idx"]

    def frame(r: Run) -> pl.DataFrame:
        schema = r.lazy.collect_schema()
        seg = (
            pl.col("segment_idx").fill_null(0).cast(pl.Int32)
            if "segment_idx" in schema
            else pl.lit(0, pl.Int32)
        )
        return r.lazy.select(
            pl.col("step").cast(pl.Int64),
            pl.col("sample_id").cast(pl.String),
            seg.alias("segment_idx"),
            pl.col("seq_hash").cast(pl.UInt64),
            pl.col("loss_mask"),
        ).collect()

    left, right = frame(run), frame(other)
    joined = left.join(right, on=keys, how="inner", suffix="_b")
    issues: list[Issue] = []
    if joined.height == 0:
        steps_a = f"{left['step'].min()}-{left['step'].max()}" if left.height else "none"
        steps_b = f"{right['step'].min()}-{right['step'].max()}" if right.height else "none"
        issues.append(
            Issue(
                "E304",
                "error",
                left.height,
                f"0 of {left.height} samples matched by (step, sample_id); steps {steps_a} vs {steps_b}?",
            )
        )
        return issues
    differ = joined.filter(pl.col("seq_hash") != pl.col("seq_hash_b")).sort(keys)
    if differ.height:
        shown = "; ".join(
            f"step {s}, sample {i}"
            for s, i in differ.select("step", "sample_id").head(max_examples).iter_rows()
        )
        issues.append(
            Issue(
                "E301",
                "error",
                differ.height,
                f"{differ.height} matched samples differ in tokens ({shown})",
                step=int(differ["step"][0]),
                sample_id=str(differ["sample_id"][0]),
            )
        )
    same = joined.filter(pl.col("seq_hash") == pl.col("seq_hash_b"))
    if same.height:
        mask_a = same["loss_mask"].explode().fill_null(False).to_numpy()
        mask_b = same["loss_mask_b"].explode().fill_null(False).to_numpy()
        if mask_a.shape == mask_b.shape:
            n_only_a, n_only_b = int((mask_a & ~mask_b).sum()), int((mask_b & ~mask_a).sum())
            detail = f"{n_only_a} only in {run.label}, {n_only_b} only in {other.label}"
            issue = mask_issue(n_only_a, int(mask_a.sum()), n_only_b, int(mask_b.sum()), detail)
            if issue is not None:
                issues.append(issue)
    return issues
