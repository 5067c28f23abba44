"""The rules over whole rows of one `RowTable`: structure (E213, E201, E202), scalar columns (E210, E211, W217,
E207 on scalars) and the stored sequence hash (E212). Rows with structural errors are marked in `ctx.bad`, so the
token rules (`data.token_rules`) skip them.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from pgdiag.data.flat import row_of
from pgdiag.data.issues import Issue, MessageParts
from pgdiag.data.rule_context import RuleContext, null_mask
from pgdiag.data.seqhash import seq_hashes
from pgdiag.errors import Code


def structure_rules(ctx: RuleContext) -> None:
    """E213 (null key, ids or mask), E201 (list length differs from input_ids), E202 (prompt_len outside
    [1, T]); marks those rows bad."""
    ids = ctx.table.lists["input_ids"]
    mask = ctx.table.lists["loss_mask"]
    for column in ("run", "step", "sample_id", "prompt_len", "seq_hash"):
        if column not in ctx.frame.columns:
            continue
        nulls = null_mask(ctx.frame, column)
        if nulls.any():
            ctx.bad |= nulls
            if ctx.on(Code.NULL_REQUIRED):
                ctx.flag(nulls, Code.NULL_REQUIRED, "error", f"{column} is null")
    for column, flat in (("input_ids", ids), ("loss_mask", mask)):
        null_rows = np.zeros(ctx.table.n_rows, dtype=bool)
        if flat.row_valid is not None:
            null_rows |= ~flat.row_valid
        if flat.valid is not None:
            bad_elems = np.flatnonzero(~flat.valid)
            null_rows[row_of(flat.offsets, bad_elems)] = True
        if null_rows.any():
            ctx.bad |= null_rows
            if ctx.on(Code.NULL_REQUIRED):
                ctx.flag(null_rows, Code.NULL_REQUIRED, "error", f"{column} has nulls")
    lengths = ids.lengths
    for column, flat in ctx.table.lists.items():
        if column == "input_ids":
            continue
        wrong = flat.lengths != lengths
        if flat.row_valid is not None:
            wrong |= ~flat.row_valid
        if wrong.any():
            ctx.bad |= wrong
            if ctx.on(Code.LENGTH_MISMATCH):
                rows = np.flatnonzero(wrong)
                notes = [
                    "null list"
                    if flat.row_valid is not None and not flat.row_valid[r]
                    else f"length {flat.lengths[r]} != input_ids {lengths[r]}"
                    for r in rows[: ctx.loc.max_examples]
                ]
                ctx.add(
                    ctx.loc.issue(
                        Code.LENGTH_MISMATCH,
                        "error",
                        f"{column}: list length differs from input_ids",
                        rows,
                        rows.size,
                        notes=notes,
                    )
                )
    prompt_len = ctx.frame["prompt_len"].to_numpy() if "prompt_len" in ctx.frame.columns else None
    if prompt_len is not None:
        outside = ~null_mask(ctx.frame, "prompt_len") & ((prompt_len < 1) | (prompt_len > lengths))
        if outside.any():
            ctx.bad |= outside
            if ctx.on(Code.BAD_PROMPT_LEN):
                rows = np.flatnonzero(outside)
                notes = [f"prompt_len {prompt_len[r]}, T {lengths[r]}" for r in rows[: ctx.loc.max_examples]]
                ctx.add(
                    ctx.loc.issue(
                        Code.BAD_PROMPT_LEN,
                        "error",
                        "prompt_len outside [1, T]",
                        rows,
                        rows.size,
                        notes=notes,
                    )
                )


def scalar_rules(ctx: RuleContext) -> None:
    """E210 (duplicate key), E211 (no group_id), W217 (uneven groups in a step), E207 on reward, advantage and
    temperature."""
    frame = ctx.frame
    keys = [c for c in ("run", "step", "sample_id") if c in frame.columns]
    if ctx.on(Code.DUPLICATE_SAMPLE) and len(keys) == 3:
        key_frame = frame.select(
            *keys, pl.col("segment_idx").fill_null(0) if "segment_idx" in frame.columns else pl.lit(0)
        )
        dup = key_frame.is_duplicated().to_numpy()
        ctx.flag(dup, Code.DUPLICATE_SAMPLE, "error", "duplicate (run, step, sample_id, segment_idx)")
    if ctx.on(Code.MISSING_GROUP) and "group_id" in frame.columns:
        group = frame["group_id"].cast(pl.String)
        missing = (group.is_null() | (group.str.len_chars() == 0)).to_numpy()
        ctx.flag(
            missing,
            Code.MISSING_GROUP,
            "error",
            "{n} samples without group_id",
            hint="re-import with --group-by prompt",
        )
    if ctx.on(Code.UNEQUAL_GROUPS) and {"group_id", "step"} <= set(frame.columns):
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
                examples=tuple((None, str(s)) for s in uneven["step"].to_list()[: ctx.loc.max_examples]),
                max_examples=ctx.loc.max_examples,
                located=False,
                joiner=", ",
                more="; {n} more steps",
            )
            ctx.add(
                Issue(
                    Code.UNEQUAL_GROUPS,
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
        if ctx.on(Code.NON_FINITE) and column in frame.columns:
            values = frame[column].cast(pl.Float64).to_numpy()
            nonfinite = np.isnan(values) & ~null_mask(frame, column) | np.isinf(values)
            ctx.flag(nonfinite, Code.NON_FINITE, "error", f"{column}: NaN or inf")


def seq_hash_rule(ctx: RuleContext) -> None:
    """E212: the stored seq_hash differs from the hash of input_ids (structurally sound rows only)."""
    if not ctx.on(Code.SEQ_HASH_MISMATCH) or "seq_hash" not in ctx.frame.columns:
        return
    ids = ctx.table.lists["input_ids"]
    computed = seq_hashes(ids.values.astype(np.int32, copy=False), ids.offsets)
    stored = ctx.frame["seq_hash"].fill_null(0).cast(pl.UInt64).to_numpy()
    wrong = (computed != stored) & ~ctx.bad
    ctx.flag(
        wrong,
        Code.SEQ_HASH_MISMATCH,
        "error",
        "seq_hash differs from the hash of input_ids",
        hint="ids edited after import? re-import to refresh seq_hash",
    )
