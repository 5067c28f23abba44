"""Policy versions of the loss tokens, and their lag behind the trainer (docs/whatif.md, "Staleness").

lag = version of the proximal weights (the trainer's at the row's step) − version of the sampling weights, so 0
is on-policy. The sampling version is `policy_version_tok` at the token's position where the run has it (Fast-LLM,
PipelineRL-style per-token versions), else the row's `policy_version`. The proximal version is the row's `step`
minus the import preset's offset (`LAG_OFFSETS`), which removes the framework's off-by-one. Each offset was read
from the framework's code (the version it records, and the trainer's version at the step the preset imports):

    canonical   0   pgdiag's own convention: policy_version is the step whose weights sampled the row
    verl        1   verl 1dda039 `verl/trainer/ppo/v1/trainer_base.py`: staleness = (global_steps − 1) −
                    min_global_steps; the importer maps min_global_steps to policy_version and the step directory
                    (global_steps) to step
    slime      −1   slime 624b824a: `Sample.weight_versions` holds SGLang's `weight_version` (`slime/utils/types.py`),
                    which `update_weights` increments before each push (`update_weight_from_tensor.py`,
                    `update_weight_from_distributed.py`); `train.py` / `train_async.py` push once before rollout 0,
                    then after training each rollout, so rollout r trains on version r + 1 (the importer's step is
                    `rollout_id`, its policy_version the sample's first weight version)
    miles      −1   miles 31f1ca96: the same counter and loop (`miles/utils/types.py`,
                    `update_weight_from_tensor.py`, `train.py`, `train_async.py`)

Presets whose step is not a trainer version get no lag (`LAG_UNKNOWN`, every token `unknown`, with the reason):
PipelineRL 58d39345 and Fast-LLM 7d61a1ba record versions in samples / documents trained (`finetune_loop.py`
`last_broadcasted_version = samples`; `policy_gradient.py` staleness = documents_seen − model_version), while the
preset's step is the group's smallest version (PipelineRL) or the capture's step file (Fast-LLM). prime-rl, NeMo-RL
and SkyRL dumps record no sampling version. Any other preset uses 0, and `verified` says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl

from pgdiag.data.batch import TokenBatch
from pgdiag.data.runs import Run

LAG_OFFSETS = {"canonical": 0, "verl": 1, "slime": -1, "miles": -1}
LAG_UNKNOWN = {
    "pipelinerl": "PipelineRL versions count samples trained, and the preset's step is a sampling version",
    "fast-llm": "Fast-LLM versions count documents trained, and the capture's step is a step file",
}
LAG_LABELS = ("<0", "0", "1", "2", "3", "4+", "unknown")  # every lag bucket, in order
LAG_LO = (-np.inf, 0.0, 1.0, 2.0, 3.0, 4.0, np.nan)  # (7,) lower edge of each bucket
LAG_HI = (0.0, 1.0, 2.0, 3.0, 4.0, np.inf, np.nan)  # (7,) upper edge (half-open)


@dataclass(frozen=True)
class TokenLag:
    """Per loss token: the sampling version and the lag (NaN where the run has no version for the token)."""

    sampling_version: np.ndarray  # (M,) float64
    lag: np.ndarray  # (M,) float64
    offset: int
    preset: str
    verified: bool  # the preset's offset was read from its framework's code
    per_token: bool  # versions came from policy_version_tok
    unknown_reason: str | None = None  # why the preset gives no lag (`LAG_UNKNOWN`), else None


def run_preset(run: Run) -> str:
    """The import preset recorded in the run's metadata (``canonical`` when none is)."""
    source = run.meta.get("source") if isinstance(run.meta, dict) else None
    return str(source.get("preset", "canonical")) if isinstance(source, dict) else "canonical"


def has_versions(run: Run) -> bool:
    """Whether `run` has a `policy_version` or `policy_version_tok` column."""
    names = set(run.lazy.collect_schema().names())
    return bool(names & {"policy_version", "policy_version_tok"})


def token_lag(run: Run, batch: TokenBatch) -> TokenLag | None:
    """The lag of every loss token of `batch` (read from `run`), None when the run has no version column."""
    return token_lag_at(
        run, batch.step, batch.sample_id, batch.segment_idx, batch.token_sample(), batch.pos.astype(np.int64)
    )


def token_lag_at(
    run: Run,
    step: np.ndarray,
    sample_id: np.ndarray,
    segment_idx: np.ndarray,
    token_row: np.ndarray,
    pos: np.ndarray,
) -> TokenLag | None:
    """The lag of M tokens given by their row (`token_row` (M,) into the (S,) keys `step`, `sample_id`,
    `segment_idx`) and position `pos` (M,) in `input_ids`, read from `run` (a run, or one piece of it); None when
    the run has no version column."""
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
            "step": np.asarray(step, dtype=np.int64),
            "sample_id": np.asarray(sample_id).astype(str),
            **({"segment_idx": np.asarray(segment_idx, dtype=np.int32)} if "segment_idx" in keys else {}),
        }
    ).with_row_index("_row")
    joined = order.join(frame.unique(subset=keys, keep="first"), on=keys, how="left").sort("_row")
    token_row = np.asarray(token_row, dtype=np.int64)
    version = np.full(token_row.shape[0], np.nan)  # (M,)
    if "policy_version" in cols:
        per_row = joined["policy_version"].cast(pl.Float64).fill_null(np.nan).to_numpy()  # (S,)
        version = per_row[token_row]
    per_token = False
    if "policy_version_tok" in cols:
        per_token = _token_versions(joined["policy_version_tok"].to_list(), token_row, pos, version)
    preset = run_preset(run)
    unknown = LAG_UNKNOWN.get(preset)
    offset = LAG_OFFSETS.get(preset, 0)
    proximal = np.asarray(step, dtype=np.float64)[token_row] - offset  # (M,)
    lag = np.full(token_row.shape[0], np.nan) if unknown else proximal - version
    return TokenLag(version, lag, offset, preset, preset in LAG_OFFSETS, per_token, unknown)


def _token_versions(lists: list, token_row: np.ndarray, pos: np.ndarray, version: np.ndarray) -> bool:
    """Write `policy_version_tok[row][pos]` into `version` (M,) where the row has a list; True when any had."""
    found = False
    order = np.argsort(token_row, kind="stable")  # tokens grouped by row, in their order within the row
    rows, starts = np.unique(token_row[order], return_index=True)
    ends = np.append(starts[1:], order.shape[0])
    for row, lo, hi in zip(rows.tolist(), starts.tolist(), ends.tolist(), strict=True):
        values = lists[row]
        if values is None:
            continue
        at = order[lo:hi]  # (m,) tokens of this row
        p = pos[at]
        ok = p < len(values)
        picked = [values[q] if values[q] is not None else np.nan for q in p[ok].tolist()]
        version[at[ok]] = np.asarray(picked, dtype=np.float64)
        found = True
    return found


def lag_codes(lag: np.ndarray) -> np.ndarray:
    """(M,) index into `LAG_LABELS` of every lag (M,): `<0`, 0, 1, 2, 3, `4+`, `unknown` (NaN)."""
    codes = np.full(lag.shape[0], len(LAG_LABELS) - 1, dtype=np.intp)
    known = np.isfinite(lag)
    clipped = np.clip(np.floor(lag[known]), -1, 4).astype(np.intp)  # −1 → `<0`, 4 → `4+`
    codes[known] = clipped + 1
    return codes


def lag_buckets(lag: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """(label, token mask) per lag value 0, 1, 2, 3 and `4+`, negative lags as `<0`, unknown as `unknown`; only
    the buckets that hold tokens."""
    codes = lag_codes(lag)
    return [(label, codes == k) for k, label in enumerate(LAG_LABELS) if np.any(codes == k)]
