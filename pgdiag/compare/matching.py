"""Which samples of two runs pair up: by id, by sequence hash within a step, or by sequence hash over all steps.

What: `match_samples(a, b, join=...)` returns the rows of the matched samples of two `TokenBatch`es in side a's
order and the join it resolved: ``id`` joins on (step, sample_id, segment_idx); ``hash`` on (step, seq_hash,
rank) where rank orders identical sequences of one step by sample_id; ``hash-any-step`` on (seq_hash, rank) over
all steps (`pgdiag.data.pieces.rank_join`); ``auto`` falls back from id to hash when fewer than half of side a's
ids match. `content_hash` stands in for `seq_hash` on batches built in memory: a hash of each sample's loss
tokens, their positions and its length, computed vectorised.

Why apart: the pairing rule is the one decision of a comparison that `compare --join` exposes;
`pgdiag.compare.align` checks and lines up the tokens of the pairs it finds.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import polars as pl

from pgdiag.compare.settings import JOINS
from pgdiag.data.batch import TokenBatch
from pgdiag.data.pieces import rank_join
from pgdiag.errors import Code, UsageError

JOIN_KEYS = {
    "id": "(step, sample_id, segment_idx)",
    "hash": "(step, seq_hash)",
    "hash-any-step": "(seq_hash)",
    "auto": "(step, sample_id)",
}


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on uint64 (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def content_hash(batch: TokenBatch) -> np.ndarray:
    """(S,) uint64 hash of each sample's loss tokens, their positions and its length (order-independent sum)."""
    with np.errstate(over="ignore"):
        tok = batch.token_id.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        per_token = _mix64(tok ^ _mix64(batch.pos.astype(np.uint64) + np.uint64(1)))  # (M,)
        out = _mix64(batch.seq_len.astype(np.uint64) + np.uint64(0x632BE59BD9B4E019))  # (S,)
        counts = batch.n_loss
        nonempty = counts > 0
        if batch.n_tokens:
            sums = np.add.reduceat(per_token, batch.offsets[:-1][nonempty])
            out[nonempty] = out[nonempty] + sums
    return out


def _key_frame(batch: TokenBatch, hashes: np.ndarray, index_name: str) -> pl.DataFrame:
    return pl.DataFrame(
        {
            index_name: np.arange(batch.n_samples, dtype=np.int64),
            "step": batch.step.astype(np.int64),
            "sample_id": pl.Series(batch.sample_id.tolist(), dtype=pl.String),
            "segment_idx": batch.segment_idx.astype(np.int32),
            "hash": hashes.astype(np.uint64),
        }
    )


def match_samples(
    a: TokenBatch,
    b: TokenBatch,
    *,
    join: str,
    hashes: Callable[[], tuple[np.ndarray, np.ndarray]],
) -> tuple[np.ndarray, np.ndarray, str]:
    """(rows of a, rows of b, resolved join) of the matched samples, in side a's row order.

    `hashes()` gives the per-sample hashes of a and b; it is called only when a hash join runs.
    """
    if join not in JOINS:
        raise UsageError(
            Code.BAD_OPTION_VALUE, f"unknown --join {join!r}", f"choose one of {', '.join(JOINS)}"
        )
    resolved = join
    if join in ("auto", "id"):
        on = ["step", "sample_id", "segment_idx"]
        no_hash = np.zeros(0, dtype=np.uint64)
        fa = _key_frame(a, np.zeros(a.n_samples, dtype=np.uint64) if a.n_samples else no_hash, "ia")
        fb = _key_frame(b, np.zeros(b.n_samples, dtype=np.uint64) if b.n_samples else no_hash, "ib")
        matched = fa.join(fb.drop("hash"), on=on, how="inner")
        resolved = "hash" if join == "auto" and 2 * matched.height < a.n_samples else "id"
    if resolved in ("hash", "hash-any-step"):
        hash_a, hash_b = hashes()
        fa, fb = _key_frame(a, hash_a, "ia"), _key_frame(b, hash_b, "ib")
        matched = rank_join(fa, fb, ["step", "hash"] if resolved == "hash" else ["hash"])
    matched = matched.sort("ia")
    return matched["ia"].to_numpy(), matched["ib"].to_numpy(), resolved
