"""The worst K tokens and sequences of an aligned pair, and the trace of the worst sequence (the worst-K files of docs/compare.md).

What: `worst_tokens` ranks matched tokens by |Δ| (Δ = lp_b − lp_a), `worst_seqs` ranks samples by |Σ Δ| (the
log of the sequence importance ratio, what sequence-level corrections act on), `worst_trace` returns both
streams along the worst sequence for the trace plot.
Why: a parity number needs an address: the step, sample and position to open in the rollout.
How: `np.argpartition` picks the top K in O(M) before a sort of K rows; per-sample sums are `np.add.reduceat`.
`decode` (optional, e.g. a tokenizer's ``decode``) renders each worst token's text and the ±8 tokens of loss
context around it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import polars as pl

from pgdiag.compare.align import AlignedPair
from pgdiag.errors import Code, UsageError

CONTEXT_TOKENS = 8


def token_decoder(tokenizer: Path) -> Callable[[Sequence[int]], str]:
    """Token ids -> text with the `tokenizers` package, from a tokenizer.json or the folder holding one."""
    path = tokenizer / "tokenizer.json" if tokenizer.is_dir() else tokenizer
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UsageError(
            Code.MISSING_PACKAGE, "--tokenizer needs the optional 'tokenizers' package"
        ) from None
    if not path.exists():
        raise UsageError(Code.INPUT_NOT_FOUND, f"{path}: no such tokenizer file")
    try:
        loaded = Tokenizer.from_file(str(path))
    except Exception as exc:  # the tokenizers library raises bare Exceptions on bad files (was exit 101)
        raise UsageError(
            Code.UNPARSABLE_OPTION,
            f"{path}: not a tokenizers tokenizer.json ({exc})",
            "--tokenizer takes a Hugging Face tokenizer.json or the folder holding one",
        ) from None
    return lambda ids: loaded.decode(list(ids), skip_special_tokens=False)


WORST_TOKENS_SCHEMA: dict[str, pl.DataType] = {
    "pair": pl.String(),
    "step": pl.Int64(),
    "sample_id": pl.String(),
    "pos": pl.Int64(),
    "resp_pos": pl.Int64(),
    "token_id": pl.Int64(),
    "lp_a": pl.Float64(),
    "lp_b": pl.Float64(),
    "dlogp": pl.Float64(),
    "token_text": pl.String(),
    "context": pl.String(),
}
WORST_SEQS_SCHEMA: dict[str, pl.DataType] = {
    "pair": pl.String(),
    "step": pl.Int64(),
    "sample_id": pl.String(),
    "n_tokens": pl.Int64(),
    "dlogp_sum": pl.Float64(),
    "dlogp_mean": pl.Float64(),
    "abs_dlogp_max": pl.Float64(),
    "reward": pl.Float64(),
    "env": pl.String(),
}


def _top_k(score: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest scores, largest first, ties by index (a full sort: callers pass per-sample
    scores or the few candidate tokens, never all M tokens)."""
    if k <= 0 or score.shape[0] == 0:
        return np.zeros(0, dtype=np.int64)
    return np.lexsort((np.arange(score.shape[0]), -score))[:k]


def _top_k_tokens(pair: AlignedPair, k: int) -> np.ndarray:
    """Token indices of the k largest |Δ|, largest first, without an (M,) temporary.

    With u = the k-th largest per-sample max |Δ|, at least k tokens reach u, so every top-k token lies in a
    sample whose max reaches u: only those samples' tokens are ranked.
    """
    rows, _, absmax = sequence_deltas(pair)
    if rows.size == 0 or k <= 0:
        return np.zeros(0, dtype=np.int64)
    threshold = absmax[_top_k(absmax, k)[-1]]
    candidates = rows[absmax >= threshold]
    take = np.concatenate([np.arange(pair.offsets[r], pair.offsets[r + 1]) for r in candidates.tolist()])
    return take[_top_k(np.abs(pair.delta[take]), k)]


def worst_tokens(
    pair: AlignedPair, k: int, *, decode: Callable[[Sequence[int]], str] | None = None
) -> pl.DataFrame:
    """The k matched tokens with the largest |Δ|, largest first."""
    d = pair.delta
    top = _top_k_tokens(pair, k)
    row = np.searchsorted(pair.offsets, top, side="right") - 1
    context: list[str | None] = [None] * top.shape[0]
    token_text: list[str | None] = [None] * top.shape[0]
    if decode is not None:
        for j, (t, r) in enumerate(zip(top.tolist(), row.tolist(), strict=True)):
            token_text[j] = decode([int(pair.token_id[t])])
            lo = max(int(pair.offsets[r]), t - CONTEXT_TOKENS)
            hi = min(int(pair.offsets[r + 1]), t + CONTEXT_TOKENS + 1)
            context[j] = decode(pair.token_id[lo:hi].tolist())
    return pl.DataFrame(
        {
            "pair": [pair.pair] * top.shape[0],
            "step": pair.step[row],
            "sample_id": [str(s) for s in pair.sample_id[row]],
            "pos": pair.pos[top].astype(np.int64),
            "resp_pos": pair.resp_pos[top].astype(np.int64),
            "token_id": pair.token_id[top].astype(np.int64),
            "lp_a": pair.lp_a[top],
            "lp_b": pair.lp_b[top],
            "dlogp": d[top],
            "token_text": token_text,
            "context": context,
        },
        schema=WORST_TOKENS_SCHEMA,
    )


def sequence_deltas(pair: AlignedPair) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows, Σ Δ, max |Δ|) over the non-empty matched samples."""
    counts = pair.n_loss
    rows = np.flatnonzero(counts > 0)
    if rows.size == 0:
        empty = np.zeros(0)
        return rows, empty, empty
    d = pair.delta
    starts = pair.offsets[:-1][rows]
    absmax = np.maximum(np.maximum.reduceat(d, starts), -np.minimum.reduceat(d, starts))  # no (M,) |Δ| copy
    return rows, np.add.reduceat(d, starts), absmax


def worst_seqs(pair: AlignedPair, k: int) -> pl.DataFrame:
    """The k samples with the largest |Σ Δ|, largest first."""
    rows, sums, absmax = sequence_deltas(pair)
    top = _top_k(np.abs(sums), k)
    picked = rows[top]
    n = pair.n_loss[picked]
    return pl.DataFrame(
        {
            "pair": [pair.pair] * picked.shape[0],
            "step": pair.step[picked],
            "sample_id": [str(s) for s in pair.sample_id[picked]],
            "n_tokens": n.astype(np.int64),
            "dlogp_sum": sums[top],
            "dlogp_mean": sums[top] / n,
            "abs_dlogp_max": absmax[top],
            "reward": None if pair.reward is None else pair.reward[picked],
            "env": None if pair.env is None else [str(e) for e in pair.env[picked]],
        },
        schema=WORST_SEQS_SCHEMA,
    )


def worst_trace(pair: AlignedPair) -> pl.DataFrame:
    """Both streams along the sample with the largest |Σ Δ|: (pair, step, sample_id, pos, resp_pos, lp_a, lp_b)."""
    rows, sums, _ = sequence_deltas(pair)
    schema = {
        "pair": pl.String(),
        "step": pl.Int64(),
        "sample_id": pl.String(),
        "pos": pl.Int64(),
        "resp_pos": pl.Int64(),
        "lp_a": pl.Float64(),
        "lp_b": pl.Float64(),
    }
    if rows.size == 0:
        return pl.DataFrame(schema=schema)
    r = int(rows[_top_k(np.abs(sums), 1)[0]])
    lo, hi = int(pair.offsets[r]), int(pair.offsets[r + 1])
    return pl.DataFrame(
        {
            "pair": [pair.pair] * (hi - lo),
            "step": np.full(hi - lo, pair.step[r], dtype=np.int64),
            "sample_id": [str(pair.sample_id[r])] * (hi - lo),
            "pos": pair.pos[lo:hi].astype(np.int64),
            "resp_pos": pair.resp_pos[lo:hi].astype(np.int64),
            "lp_a": pair.lp_a[lo:hi],
            "lp_b": pair.lp_b[lo:hi],
        },
        schema=schema,
    )
