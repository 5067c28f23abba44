"""The tokens `pgdiag explain` attributes: the pair's two streams, the recompute matrix's streams and the sampling
grid, lined up token by token, handed to the cause accumulators in pieces of whole steps.

What: `ExplainPiece` holds the loss tokens of consecutive steps (M tokens): where they are (step, sample,
response position, policy lag) and every value the causes read. `token_pieces` reads the token run (the
budget's samples, `explain.tokens`) with the reader every command uses (`pgdiag.data.load.read_token_batch`:
the same row rules, E207 on a non-finite value), joins the grid rows on (step, sample_id, segment_idx, pos),
and cuts the result into pieces of whole steps (`pgdiag.data.pieces.plan_step_pieces`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import polars as pl

from pgdiag.data.load import read_token_batch
from pgdiag.data.pieces import plan_step_pieces
from pgdiag.data.runs import Run, restrict_steps
from pgdiag.errors import Code, InvalidInputError
from pgdiag.explain.grid import GridValues

_KEYS = ["step", "sample_id", "segment_idx", "pos"]


@dataclass(frozen=True)
class ExplainPiece:
    """Loss tokens of consecutive whole steps (M tokens, S samples)."""

    step: np.ndarray  # (M,) int64
    sample: np.ndarray  # (M,) int64 sample index, unique over the run
    resp_pos: np.ndarray  # (M,) int64 position in the response (0 = first response token)
    lag: np.ndarray  # (M,) int64 policy lag of the sample (−1: the run records no policy_version)
    a: np.ndarray  # (M,) float64 log-probs of side a (the sampling side)
    b: np.ndarray  # (M,) float64 log-probs of side b
    configs: dict[str, np.ndarray]  # recompute configuration -> (M,) float64 log-probs
    grid: np.ndarray  # (M, n_T, n_K) float32 sampling-grid log-probs (`explain.grid`)
    entropy: np.ndarray  # (M,) float32 reference entropy at T = 1
    certain: np.ndarray  # (M,) bool: the reference gives the token probability ≈ 1

    @property
    def n_tokens(self) -> int:
        return int(self.step.shape[0])


def grid_keys(
    step: np.ndarray, sample_id: np.ndarray, segment_idx: np.ndarray, loss_mask: Sequence[np.ndarray]
) -> pl.DataFrame:
    """The (step, sample_id, segment_idx, pos) of every grid row (loss positions t >= 1, sample order)."""
    rows = {k: [] for k in _KEYS}
    for s, mask in enumerate(loss_mask):
        pos = np.flatnonzero(np.asarray(mask, dtype=bool))
        pos = pos[pos >= 1]
        rows["step"].append(np.full(pos.shape[0], int(step[s]), dtype=np.int64))
        rows["sample_id"].append(np.full(pos.shape[0], str(sample_id[s]), dtype=object))
        rows["segment_idx"].append(np.full(pos.shape[0], int(segment_idx[s]), dtype=np.int32))
        rows["pos"].append(pos.astype(np.int32))
    return pl.DataFrame(
        {
            "step": np.concatenate(rows["step"]) if rows["step"] else np.zeros(0, np.int64),
            "sample_id": pl.Series(
                np.concatenate(rows["sample_id"]).tolist() if rows["sample_id"] else [], dtype=pl.String
            ),
            "segment_idx": np.concatenate(rows["segment_idx"])
            if rows["segment_idx"]
            else np.zeros(0, np.int32),
            "pos": np.concatenate(rows["pos"]) if rows["pos"] else np.zeros(0, np.int32),
        }
    ).with_row_index("grid_row")


def policy_lag(run: Run) -> pl.DataFrame | None:
    """(step, sample_id, segment_idx, lag) with lag = the step's newest policy_version − the sample's; None when
    the run has no ``policy_version`` column."""
    schema = run.lazy.collect_schema()
    if "policy_version" not in schema:
        return None
    keys = ["step", "sample_id"] + (["segment_idx"] if "segment_idx" in schema else [])
    frame = run.lazy.select(*keys, pl.col("policy_version").cast(pl.Int64)).collect()
    frame = frame.with_columns(
        (pl.col("policy_version").max().over("step") - pl.col("policy_version")).fill_null(-1).alias("lag")
    )
    if "segment_idx" not in frame.columns:
        frame = frame.with_columns(pl.lit(0, dtype=pl.Int32).alias("segment_idx"))
    return frame.select(
        "step", pl.col("sample_id").cast(pl.String), pl.col("segment_idx").cast(pl.Int32), "lag"
    )


def token_pieces(
    run: Run,
    pair: tuple[str, str],
    configs: Sequence[str],
    grid: GridValues,
    keys: pl.DataFrame,
    *,
    max_rows: int = 16_384,
) -> Iterator[ExplainPiece]:
    """The budget's tokens in pieces of whole steps (module docstring); `keys` from `grid_keys`."""
    lag = policy_lag(run)
    sample_base = 0
    for step_piece in plan_step_pieces([run], max_rows).pieces:  # the one piece planner every command uses
        part = run if step_piece.steps is None else restrict_steps(run, step_piece.steps)
        batch = read_token_batch(
            part, streams=[*pair, *configs], advantages=False, reward=False, ignore=(Code.ZERO_FILLED,)
        ).batch  # exact zeros are a signature here (explain.signatures.zeros_rule), not a refusal
        sample = batch.token_sample()  # (M,)
        frame = pl.DataFrame(
            {
                "step": batch.step[sample].astype(np.int64),
                "sample_id": pl.Series(batch.sample_id[sample].astype(str).tolist(), dtype=pl.String),
                "segment_idx": batch.segment_idx[sample].astype(np.int32),
                "pos": batch.pos.astype(np.int32),
            }
        ).with_row_index("token")
        joined = frame.join(keys, on=_KEYS, how="left")
        if joined["grid_row"].null_count():
            first = joined.filter(pl.col("grid_row").is_null()).row(0, named=True)
            raise InvalidInputError(
                Code.STALE_RECOMPUTE,
                f"{run.label}: step {first['step']}, sample {first['sample_id']}, pos {first['pos']} has no "
                "sampling-grid value (the token run changed while explain ran)",
            )
        if lag is not None:
            joined = joined.join(lag, on=["step", "sample_id", "segment_idx"], how="left")
        joined = joined.sort("token")
        rows = joined["grid_row"].to_numpy().astype(np.int64)
        lags = joined["lag"].fill_null(-1).to_numpy() if lag is not None else np.full(len(rows), -1)
        yield ExplainPiece(
            step=batch.step[sample].astype(np.int64),
            sample=sample + sample_base,
            resp_pos=(batch.pos - batch.prompt_len[sample]).astype(np.int64),
            lag=lags.astype(np.int64),
            a=np.asarray(batch.streams[pair[0]], dtype=np.float64),
            b=np.asarray(batch.streams[pair[1]], dtype=np.float64),
            configs={c: np.asarray(batch.streams[c], dtype=np.float64) for c in configs},
            grid=grid.logprobs[rows],
            entropy=grid.entropy[rows],
            certain=grid.certain[rows],
        )
        sample_base += batch.n_samples
