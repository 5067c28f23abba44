"""The rules over one per-token float column at and outside the loss positions: nulls on loss tokens (E204),
next-token shift by nulls (E302, `NullShiftPart`), values off the mask (W214), NaN/inf (E207), and on the
log-prob streams positive values (E205) and zero fills (E206, W216, `ZeroFillPart`).
"""

from __future__ import annotations

import numpy as np

from pgdiag.data.flat import FlatList, row_of
from pgdiag.data.issues import as_template
from pgdiag.data.kept import position_sizes
from pgdiag.data.loss_view import LossView
from pgdiag.data.rule_context import RuleContext
from pgdiag.data.run_rules import NullShiftPart, ZeroFillPart, zero_fill_rows
from pgdiag.errors import Code

LOGPROB_POSITIVE_TOL = 1e-6


def stream_column_rules(ctx: RuleContext, column: str, flat: FlatList, view: LossView) -> None:
    """The rules of one per-token float column (a stream or another float list): E204, E302 by nulls, W214,
    E207; on streams also E205, E206, W216."""
    offsets = ctx.table.lists["input_ids"].offsets
    ids = ctx.table.lists["input_ids"].values
    at_loss = view.values[column]
    valid_at_loss = view.valid[column]
    n_loss_total = view.index.size
    n_null_loss = 0 if valid_at_loss is None else int(n_loss_total - np.count_nonzero(valid_at_loss))
    if n_null_loss and ctx.on(Code.NULL_ON_LOSS):
        where = np.flatnonzero(~valid_at_loss)
        flat_at = view.index[where]
        rows = view.rows_of(where)
        last = flat_at == offsets[rows + 1] - 1
        notes = [
            f"token {ids[f]}{', last' if is_last else ''}"
            for f, is_last in zip(flat_at[: ctx.loc.max_examples], last[: ctx.loc.max_examples], strict=True)
        ]
        ctx.add(
            ctx.loc.issue(
                Code.NULL_ON_LOSS,
                "error",
                f"{column} null on a loss position",
                rows,
                n_null_loss,
                pos=flat_at - offsets[rows],
                notes=notes,
                hint="appended EOS or unsampled token? drop it from loss_mask",
            )
        )
    if ctx.on(Code.SHIFTED) and column in ctx.table.stream_columns:
        _null_pattern_shift(ctx, column, flat, view, offsets, n_null_loss)
    n_valid = flat.values.shape[0] if flat.valid is None else int(np.count_nonzero(flat.valid))
    n_outside = n_valid - (n_loss_total - n_null_loss)
    if n_outside > 0 and ctx.on(Code.VALUE_OFF_LOSS):
        loss = ctx.table.lists["loss_mask"].values
        outside = ~loss if flat.valid is None else (flat.valid & ~loss)
        flat_at = np.flatnonzero(outside)[: ctx.loc.max_examples]
        rows = row_of(offsets, flat_at)
        ctx.add(
            ctx.loc.issue(
                Code.VALUE_OFF_LOSS,
                "warning",
                f"{as_template(column)} set on {{n:,}} non-loss positions (ignored)",
                rows,
                n_outside,
                pos=flat_at - offsets[rows],
                sums=(("n", n_outside),),
            )
        )
    if ctx.on(Code.NON_FINITE):
        # loss positions (null ones are NaN in `at_loss`, so test them as valid only), then any
        # non-null value outside the mask (rare: W214)
        bad = ~np.isfinite(at_loss)
        if n_null_loss:
            bad &= valid_at_loss
        bad_index = view.index[np.flatnonzero(bad)]
        if n_outside > 0:
            loss = ctx.table.lists["loss_mask"].values
            outside_bad = ~np.isfinite(flat.values) & ~loss
            if flat.valid is not None:
                outside_bad &= flat.valid
            bad_index = np.sort(np.concatenate([bad_index, np.flatnonzero(outside_bad)]))
        if bad_index.size:
            rows = row_of(offsets, bad_index)
            bad_values = flat.values[bad_index]
            n_nan = int(np.isnan(bad_values).sum())
            n_pos = int((bad_values == np.inf).sum())
            n_neg = int(bad_values.size - n_nan - n_pos)
            ctx.add(
                ctx.loc.issue(
                    Code.NON_FINITE,
                    "error",
                    f"{as_template(column)}: {{nan}} NaN, {{pos}} +inf, {{neg}} -inf",
                    rows,
                    bad_index.size,
                    pos=bad_index - offsets[rows],
                    sums=(("nan", n_nan), ("pos", n_pos), ("neg", n_neg)),
                )
            )
    if column in ctx.table.stream_columns:
        _logprob_values(ctx, column, at_loss, view, offsets)


def _null_pattern_shift(
    ctx: RuleContext, column: str, flat: FlatList, view: LossView, offsets: np.ndarray, n_null_loss: int
) -> None:
    """E302 by nulls: in every sample the stream is null on the last loss token and set just before the
    first one, the signature of next-token-aligned values stored one position early (judged over the run:
    `NullShiftPart`)."""
    n_loss = np.diff(view.row_start)
    rows = np.flatnonzero(n_loss > 0)
    if not n_null_loss or flat.valid is None:  # no null on a loss token: the pattern breaks in every row
        none = (None, None, None)
        ctx.pending.append(NullShiftPart(column, int(rows.size), not rows.size, (), none, 0))
        return
    first = view.index[view.row_start[rows]]
    last_token = view.row_start[rows + 1] - 1
    null_last = ~view.valid[column][last_token]
    before_ok = first > offsets[rows]
    set_before = np.zeros(rows.size, dtype=bool)
    set_before[before_ok] = flat.valid[first[before_ok] - 1]
    holds = bool((null_last & set_before).all())
    part = NullShiftPart(
        column,
        n_rows=int(rows.size),
        holds=holds,
        examples=ctx.loc.examples(rows) if holds else (),
        first=ctx.loc.first(rows) if holds else (None, None, None),
        max_examples=ctx.loc.max_examples,
    )
    ctx.pending.append(part)
    verdict = part.issue()
    if verdict is not None:
        ctx.add(verdict)


def _logprob_values(
    ctx: RuleContext, column: str, at_loss: np.ndarray, view: LossView, offsets: np.ndarray
) -> None:
    """E205 (positive log-probs) and this table's share of the zero-fill rules E206, W216 (`ZeroFillPart`)."""
    positive = at_loss > LOGPROB_POSITIVE_TOL
    n_positive = int(np.count_nonzero(positive))
    if n_positive and ctx.on(Code.POSITIVE_LOGPROB):
        where = np.flatnonzero(positive)
        rows = view.rows_of(where)
        ctx.add(
            ctx.loc.issue(
                Code.POSITIVE_LOGPROB,
                "error",
                f"{as_template(column)}: {{n}} positive values (max {{max:.3g}})",
                rows,
                n_positive,
                pos=view.index[where] - offsets[rows],
                sums=(("n", n_positive),),
                maxima=(("max", float(at_loss[where].max())),),
            )
        )
    if not (ctx.on(Code.ZERO_FILLED) or ctx.on(Code.ISOLATED_ZEROS)):
        return
    at_loss = _without_singletons(ctx, column, at_loss, view)
    filled = zero_fill_rows(at_loss, view.row_start)
    zero, all_zero_rows = filled.zero, filled.all_zero_rows
    tiny = np.flatnonzero((at_loss > 0.0) & ~positive)
    zero_rows = view.rows_of(zero)
    tiny_rows = view.rows_of(tiny)
    zero_pos = view.index[zero] - offsets[zero_rows]
    tiny_pos = view.index[tiny] - offsets[tiny_rows]
    part = ZeroFillPart(
        column,
        n_zero=int(zero.size),
        n_loss=int(at_loss.shape[0]),
        n_tiny=int(tiny.size),
        n_all_zero_rows=int(all_zero_rows.size),
        zero=ctx.loc.examples(zero_rows, pos=zero_pos),
        rows=ctx.loc.examples(all_zero_rows),
        tiny=ctx.loc.examples(tiny_rows, pos=tiny_pos),
        first_zero=ctx.loc.first(zero_rows, zero_pos),
        first_row=ctx.loc.first(all_zero_rows),
        first_tiny=ctx.loc.first(tiny_rows, tiny_pos),
        max_examples=ctx.loc.max_examples,
        e206=ctx.on(Code.ZERO_FILLED),
        w216=ctx.on(Code.ISOLATED_ZEROS),
    )
    ctx.pending.append(part)
    verdict = part.issue()
    if verdict is not None:
        ctx.add(verdict)


def _without_singletons(ctx: RuleContext, column: str, at_loss: np.ndarray, view: LossView) -> np.ndarray:
    """`at_loss` with the sampling stream's values where the recorded kept set holds one token replaced by
    -1: a renormalised log-prob there is exactly 0.0 by right, so the zero-fill rules (E206, W216) skip it."""
    if ctx.table.kept is None or column != "rollout_logprobs":
        return at_loss
    sizes = position_sizes(ctx.table.kept, ctx.table.lists["input_ids"].offsets)[view.index]  # (M,)
    single = sizes == 1
    if not single.any():
        return at_loss
    out = at_loss.copy()
    out[single & (at_loss >= 0.0)] = -1.0
    return out
