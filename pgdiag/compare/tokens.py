"""The exploded token table of a comparison (`--tokens-out`, docs/compare.md).

What: one row per matched loss token: run, step, sample_id, pos, resp_pos, token_id, lp_a, lp_b, dlogp, ratio,
k3, abs_dlogp, prob_a, entropy. Why: users filter and plot tokens in a notebook without re-aligning the runs,
and the token plots (`plot_hexbin`, `plot_dlogp_hist`) redraw from it. How: columns are built from the aligned
arrays (no Python loop over tokens) and written atomically as zstd Parquet with 1,048,576-row groups.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl

from pgdiag.compare.align import AlignedPair
from pgdiag.errors import UsageError

TOKEN_TABLE_SCHEMA_ID = "pgdiag.compare-tokens/v1"


def token_frame(pair: AlignedPair) -> pl.DataFrame:
    """The token table of `pair` as a polars frame."""
    sample = pair.token_sample()
    d = pair.delta
    with np.errstate(over="ignore"):
        ratio = np.exp(d)
        k3 = np.expm1(d) - d
    sample_ids = pl.Series("sample_id", [str(s) for s in pair.sample_id], dtype=pl.String)
    return pl.DataFrame(
        {
            "pair": pl.repeat(pair.pair, pair.n_tokens, eager=True, dtype=pl.String),
            "run": pl.repeat(pair.label_a, pair.n_tokens, eager=True, dtype=pl.String),
            "step": pair.step[sample],
            "sample_id": sample_ids.gather(sample),
            "pos": pair.pos.astype(np.int64),
            "resp_pos": pair.resp_pos.astype(np.int64),
            "token_id": pair.token_id.astype(np.int64),
            "lp_a": pair.lp_a,
            "lp_b": pair.lp_b,
            "dlogp": d,
            "ratio": ratio,
            "k3": k3,
            "abs_dlogp": np.abs(d),
            "prob_a": np.exp(pair.lp_a),
            "entropy": pair.entropy if pair.entropy is not None else np.full(pair.n_tokens, np.nan),
        }
    ).with_columns(pl.col("entropy").fill_nan(None))


def write_token_table(pair: AlignedPair, path: str | Path, *, overwrite: bool = False) -> Path:
    """Write the token table of `pair` to `path` (a .parquet file) atomically."""
    from pgdiag.data.writing import write_parquet

    path = Path(path)
    if path.suffix != ".parquet":
        raise UsageError("E503", f"--tokens-out {path}: give a .parquet file name")
    if path.exists() and not overwrite:
        raise UsageError("E502", f"{path} exists", "pass --overwrite to replace it")
    return write_parquet(token_frame(pair), path, metadata={"pgdiag.schema": TOKEN_TABLE_SCHEMA_ID})
