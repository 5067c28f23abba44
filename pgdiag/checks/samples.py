"""Checks that two runs hold the same samples and tokens: E304 nothing matched, E301 matched samples whose
tokens differ, E303/W303 loss masks that differ (above/below 1 % of positions).

`mask_issue` is the one E303/W303 rule: `check` applies it to runs joined by (step, sample_id, segment_idx),
`compare` to the samples `compare.align` matched. Both check tokens (E301) before masks, so the two commands
name the same first error on the same pair.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from pgdiag.data.batch import TokenBatch
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


def cross_run_issues(a: TokenBatch, b: TokenBatch, max_examples: int) -> list[Issue]:
    """E304 (no sample matched by (step, sample_id, segment_idx)), E301 (matched, different tokens: their
    `seq_hash` differs), then E303/W303 (the loss positions of samples with equal tokens differ), on the two
    batches as read (`TokenBatch.seq_hash`), so no run is read again."""
    keys = ["step", "sample_id", "segment_idx"]
    joined = _sample_keys(a).join(_sample_keys(b), on=keys, how="inner", suffix="_b").sort(keys)
    if joined.height == 0:
        message = (
            f"0 of {a.n_samples} samples matched by (step, sample_id); steps {_step_range(a.step)} vs "
            f"{_step_range(b.step)}?"
        )
        return [Issue("E304", "error", a.n_samples, message)]
    issues: list[Issue] = []
    differ = joined.filter(pl.col("seq_hash") != pl.col("seq_hash_b"))
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
                hint="compare runs built from the same token ids (retokenized text or template drift?)",
            )
        )
    same = joined.filter(pl.col("seq_hash") == pl.col("seq_hash_b"))
    if same.height:
        sub_a, sub_b = a.select(same["row"].to_numpy()), b.select(same["row_b"].to_numpy())
        key_a = (sub_a.token_sample() << 32) | sub_a.pos.astype(np.int64)  # (M_a,) (matched sample, pos)
        key_b = (sub_b.token_sample() << 32) | sub_b.pos.astype(np.int64)
        n_both = np.intersect1d(key_a, key_b, assume_unique=True).size
        n_only_a, n_only_b = key_a.size - n_both, key_b.size - n_both
        detail = f"{n_only_a} only in {a.label}, {n_only_b} only in {b.label}"
        issue = mask_issue(n_only_a, key_a.size, n_only_b, key_b.size, detail)
        if issue is not None:
            issues.append(issue)
    return issues
