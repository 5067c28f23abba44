"""Issues located on tokens, shared by every command: where a pair's tokens sit, and the pair zero-fill rule.

`TokenLocations` is any object with `offsets` (S+1,), `pos` (M,), `step` (S,), `sample_id` (S,) and
`token_sample()` (M,) (a `TokenBatch`, or `compare.align.AlignedPair`); `locate_parts` names tokens as
"step s, sample x, pos p". `zero_fill_issues` is E206 on a pair of streams, the one rule `check`, `compare` and
`metrics` run (it sits here, below all three stages, so each calls this one).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from pgdiag.data.flat import row_of
from pgdiag.data.validate import Issue, MessageParts, as_template, zero_against_other, zero_fill_rows
from pgdiag.errors import Code


class TokenLocations(Protocol):
    """Where the M tokens of a pair sit: sample offsets, positions, and each sample's step and id."""

    offsets: np.ndarray  # (S + 1,)
    pos: np.ndarray  # (M,)
    step: np.ndarray  # (S,)
    sample_id: np.ndarray  # (S,)

    def token_sample(self) -> np.ndarray: ...  # (M,) sample owning each token


def locate_parts(
    where: TokenLocations, tokens: np.ndarray, max_examples: int = 1
) -> tuple[tuple[str, ...], dict[str, Any]]:
    """`locate` before joining: one "step s, sample x, pos p" per example (merged across pieces of a run)."""
    tokens = np.asarray(tokens)[:max_examples]
    if tokens.size == 0:
        return (), {}
    rows = row_of(where.offsets, tokens)
    parts = tuple(
        f"step {where.step[r]}, sample {where.sample_id[r]}, pos {where.pos[t]}"
        for r, t in zip(rows.tolist(), tokens.tolist(), strict=True)
    )
    first = {
        "step": int(where.step[rows[0]]),
        "sample_id": str(where.sample_id[rows[0]]),
        "pos": int(where.pos[tokens[0]]),
    }
    return parts, first


def zero_fill_issues(
    lp_a: np.ndarray,
    lp_b: np.ndarray,
    where: TokenLocations,
    *,
    name_a: str,
    name_b: str,
    single_stream: bool = True,
    max_examples: int = 1,
    label: str | None = None,
    legit_a: np.ndarray | None = None,
    legit_b: np.ndarray | None = None,
) -> list[Issue]:
    """E206 per side: exact 0.0 where the other side is < −1 and, with `single_stream`, the one-stream rule of
    the reader (`data.validate.zero_fill_rows`: > 1 % exact 0.0, or a sample of ≥ 2 loss values all 0.0).

    `check` and `metrics` pass ``single_stream=False``: the reader has already applied that rule to each column.
    `label` (a run's), when given, starts the message. `legit_a` / `legit_b` (M,) bool mark the tokens where
    an exact 0.0 of that side is right (the sampling stream renormalised over a recorded one-token kept set,
    `TokenBatch.one_token_sets`): they are not zeros for either rule.
    """
    prefix = "" if label is None else f"{as_template(label)}: "
    issues = []
    sides = ((lp_a, lp_b, name_a, name_b, legit_a), (lp_b, lp_a, name_b, name_a, legit_b))
    for values, other, name, other_name, legit in sides:
        if legit is not None and legit.any():
            values = np.where(legit & (values == 0.0), -1.0, values)  # a right 0.0 is no zero of either rule
        zero = np.flatnonzero(values == 0.0)
        if zero.size == 0:
            continue
        against = zero_against_other(values, other)
        rows = zero_fill_rows(values, where.offsets) if single_stream else None
        if rows is not None and rows.fraction_filled:
            reason, tokens = f"{100 * rows.fraction:.3g} % exact 0.0 on loss positions", zero
        elif rows is not None and rows.all_zero_rows.size:
            reason = f"{rows.all_zero_rows.size} samples whose loss values are all exactly 0.0"
            tokens = where.offsets[rows.all_zero_rows]
        elif against.size:
            reason, tokens = f"0.0 where {as_template(other_name)} < -1 on {{n}} tokens", against
        else:
            continue
        shown, first = locate_parts(where, tokens, max_examples)
        parts = MessageParts(
            f"{prefix}{as_template(name)} {reason if tokens is against else as_template(reason)}: zero-filled? "
            "({examples})",
            sums=(("n", int(tokens.size)),) if tokens is against else (),
            examples=tuple((None, text) for text in shown),
            max_examples=max_examples,
            located=False,
        )
        issues.append(
            Issue(
                Code.ZERO_FILLED,
                "error",
                int(tokens.size),
                parts.render(0),
                hint="missing values written as 0? import them as null, or --ignore E206",
                rule=parts.template,
                parts=parts,
                **first,
            )
        )
    return issues
