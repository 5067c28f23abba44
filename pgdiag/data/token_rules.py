"""The rules over the tokens of structurally sound rows: loss positions (E203, W215, E209), token ids (E208),
the recorded kept sets (`data.kept`), per-token metadata lists (E207); each float column goes to
`data.stream_rules`.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from pgdiag.data.flat import METADATA_LISTS, FlatList, row_of
from pgdiag.data.issues import Issue, MessageParts
from pgdiag.data.kept import kept_issues
from pgdiag.data.loss_view import LossView
from pgdiag.data.rule_context import RuleContext
from pgdiag.data.stream_rules import stream_column_rules
from pgdiag.errors import Code


def token_rules(ctx: RuleContext, view: LossView) -> None:
    """Token rules (E203, E204, E205-E209, W214-W216); every row of the table must be structurally sound."""
    ids = ctx.table.lists["input_ids"]
    offsets = ids.offsets
    n_rows = ctx.table.n_rows
    row_start = view.row_start
    n_loss = np.diff(row_start)
    good = ~ctx.bad
    prompt_len = ctx.frame["prompt_len"].fill_null(1).to_numpy().astype(np.int64)
    prompt_end = offsets[:-1] + np.clip(prompt_len, 0, ids.lengths)
    early = (np.searchsorted(view.index, prompt_end) - row_start[:-1] > 0) & good
    if early.any() and ctx.on(Code.LOSS_WITHOUT_CONTEXT):
        rows = np.flatnonzero(early)
        first_loss = (
            view.index[row_start[rows[: ctx.loc.max_examples]]] - offsets[rows[: ctx.loc.max_examples]]
        )
        notes = [f"prompt_len {prompt_len[r]}" for r in rows[: ctx.loc.max_examples]]
        ctx.add(
            ctx.loc.issue(
                Code.LOSS_WITHOUT_CONTEXT,
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
    if ctx.on(Code.EMPTY_LOSS_MASK):
        text = "loss_mask: {n} samples with no loss tokens"
        ctx.flag(empty, Code.EMPTY_LOSS_MASK, "warning", text, hint="kept: they change seq-mean denominators")
    if ctx.on(Code.NO_LOSS_TOKENS) and "step" in ctx.frame.columns:
        steps = ctx.frame["step"].to_numpy()
        per_step = (
            pl.DataFrame({"step": steps[good], "n": n_loss[good]}).group_by("step").agg(pl.col("n").sum())
        )
        dry = per_step.filter(pl.col("n") == 0).sort("step")["step"].to_list()
        if dry:
            parts = MessageParts(
                "loss_mask: step {examples} has no loss tokens",
                examples=tuple((None, str(s)) for s in dry[: ctx.loc.max_examples]),
                max_examples=ctx.loc.max_examples,
                located=False,
                joiner=", ",
            )
            ctx.add(
                Issue(
                    Code.NO_LOSS_TOKENS,
                    "error",
                    len(dry),
                    parts.render(0),
                    step=int(dry[0]),
                    rule=parts.template,
                    parts=parts,
                )
            )
    if (
        ctx.on(Code.NO_LOSS_TOKENS)
        and view.index.size == 0
        and not any(i.code == Code.NO_LOSS_TOKENS for i in ctx.issues)
    ):
        ctx.add(
            Issue(Code.NO_LOSS_TOKENS, "error", 1, f"the selection ({n_rows} samples) has no loss tokens")
        )
    _token_ids(ctx, ids, good)
    if ctx.table.kept is not None:
        for found in kept_issues(
            ctx.table.kept,
            ids,
            issue=ctx.loc.issue,
            on=ctx.on,
            vocab_size=ctx.vocab_size,
            max_examples=ctx.loc.max_examples,
        ):
            ctx.add(found)  # type: ignore[arg-type]
    for column, flat in ctx.table.lists.items():
        if column in METADATA_LISTS:
            _finite_metadata(ctx, column, flat)
        elif column not in ("input_ids", "loss_mask"):
            stream_column_rules(ctx, column, flat, view)


def _finite_metadata(ctx: RuleContext, column: str, flat: FlatList) -> None:
    """E207 on a per-token metadata list (`METADATA_LISTS`): any non-null non-finite value, loss or not."""
    bad = ~np.isfinite(flat.values)
    if flat.valid is not None:
        bad &= flat.valid
    if ctx.on(Code.NON_FINITE) and bad.any():
        bad_index = np.flatnonzero(bad)
        rows = row_of(ctx.table.lists["input_ids"].offsets, bad_index)
        offsets = ctx.table.lists["input_ids"].offsets
        ctx.add(
            ctx.loc.issue(
                Code.NON_FINITE,
                "error",
                f"{column}: NaN or inf",
                rows,
                bad_index.size,
                pos=bad_index - offsets[rows],
            )
        )


def _token_ids(ctx: RuleContext, ids: FlatList, good: np.ndarray) -> None:
    """E208: a token id < 0 or >= vocab_size (sound rows only)."""
    if not ctx.on(Code.TOKEN_OUT_OF_VOCAB):
        return
    values = ids.values
    bad = values < 0
    if ctx.vocab_size is not None:
        bad |= values >= ctx.vocab_size
    if ids.valid is not None:
        bad &= ids.valid
    bad_index = np.flatnonzero(bad)
    if bad_index.size:
        rows = row_of(ids.offsets, bad_index)
        keep = good[rows]
        bad_index, rows = bad_index[keep], rows[keep]
    if bad_index.size:
        limit = f" or >= vocab_size {ctx.vocab_size}" if ctx.vocab_size is not None else ""
        ctx.add(
            ctx.loc.issue(
                Code.TOKEN_OUT_OF_VOCAB,
                "error",
                f"input_ids: token id < 0{limit}",
                rows,
                bad_index.size,
                pos=bad_index - ids.offsets[rows],
                notes=[f"token {values[i]}" for i in bad_index[: ctx.loc.max_examples]],
            )
        )
