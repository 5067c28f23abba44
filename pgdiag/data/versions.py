"""Policy versions of the loss tokens, and their lag behind the trainer (docs/whatif.md, "Staleness").

lag = version of the proximal weights (the trainer's at the row's step) − version of the sampling weights, so 0
is on-policy. The sampling version is `policy_version_tok` at the token's position where the run has it (Fast-LLM,
PipelineRL-style per-token versions), else the row's `policy_version`. The proximal version is the row's `step`
minus the import preset's offset (`LAG_OFFSETS`), which removes the framework's off-by-one:

    canonical  0   pgdiag's own convention: policy_version is the step whose weights sampled the row
    verl       1   verl 1dda039 `verl/trainer/ppo/v1/trainer_base.py`: staleness = (global_steps − 1) −
                   min_global_steps; the importer maps min_global_steps to policy_version and the step directory
                   (global_steps) to step

Presets not listed use 0, and `lag_offset` says so (`verified: False`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl

from pgdiag.data.batch import TokenBatch
from pgdiag.data.runs import Run

LAG_OFFSETS = {"canonical": 0, "verl": 1}
LAG_LABELS = ("<0", "0", "1", "2", "3", "4+", "unknown")  # the buckets of `lag_buckets`, in order


@dataclass(frozen=True)
class TokenLag:
    """Per loss token: the sampling version and the lag (NaN where the run has no version for the token)."""

    sampling_version: np.ndarray  # (M,) float64
    lag: np.ndarray  # (M,) float64
    offset: int
    preset: str
    verified: bool  # the preset's offset was read from its framework's code
    per_token: bool  # versions came from policy_version_tok


def _preset(run: Run) -> str:
    source = run.meta.get("source") if isinstance(run.meta, dict) else None
    return str(source.get("preset", "canonical")) if isinstance(source, dict) else "canonical"


def token_lag(run: Run, batch: TokenBatch) -> TokenLag | None:
    """The lag of every loss token of `batch` (read from `run`), None when the run has no version column."""
    names = set(run.lazy.collect_schema().names())
    cols = [c for c in ("policy_version", "policy_version_tok") if c in names]
    if not cols:
        return None
    keys = ["step", "sample_id"] + (["segment_idx"] if "segment_idx" in names else [])
    frame = run.lazy.select(
        pl.col("step").cast(pl.Int64, strict=False),
        pl.col("sample_id").cast(pl.String, strict=False),
        *([pl.col("segment_idx").cast(pl.Int32, strict=False).fill_null(0)] if "segment_idx" in keys else []),
        *[pl.col(c) for c in cols],
    ).collect()
    order = pl.DataFrame(
        {
            "step": batch.step.astype(np.int64),
            "sample_id": batch.sample_id.astype(str),
            **({"segment_idx": batch.segment_idx.astype(np.int32)} if "segment_idx" in keys else {}),
        }
    ).with_row_index("_row")
    joined = order.join(frame.unique(subset=keys, keep="first"), on=keys, how="left").sort("_row")
    tok_sample = batch.token_sample()
    version = np.full(batch.n_tokens, np.nan)
    if "policy_version" in cols:
        per_row = joined["policy_version"].cast(pl.Float64).fill_null(np.nan).to_numpy()
        version = per_row[tok_sample]
    per_token = False
    if "policy_version_tok" in cols:
        lists = joined["policy_version_tok"].to_list()
        pos = batch.pos.astype(np.int64)
        for i, values in enumerate(lists):
            if values is None:
                continue
            lo, hi = batch.offsets[i], batch.offsets[i + 1]
            at = pos[lo:hi]
            ok = at < len(values)
            picked = np.asarray(
                [values[p] if values[p] is not None else np.nan for p in at[ok]], dtype=np.float64
            )
            version[lo:hi][ok] = picked
            per_token = True
    preset = _preset(run)
    offset = LAG_OFFSETS.get(preset, 0)
    proximal = batch.step[tok_sample].astype(np.float64) - offset
    return TokenLag(version, proximal - version, offset, preset, preset in LAG_OFFSETS, per_token)


def lag_buckets(lag: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """(label, token mask) per lag value 0, 1, 2, 3 and `4+`, negative lags as `<0`, unknown as `unknown`; only
    the buckets that hold tokens."""
    out: list[tuple[str, np.ndarray]] = []
    known = np.isfinite(lag)
    for label, mask in (
        ("<0", known & (lag < 0)),
        *((str(k), known & (lag == k)) for k in range(4)),
        ("4+", known & (lag >= 4)),
        ("unknown", ~known),
    ):
        if mask.any():
            out.append((label, mask))
    return out
