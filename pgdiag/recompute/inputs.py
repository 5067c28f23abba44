"""The samples a recompute reads: checked, ordered, flattened, with their temperatures and the part plan.

What: `read_inputs` collects the columns `pgdiag logprobs` needs from a run (step, sample_id, group_id,
segment_idx, seq_hash, input_ids, loss_mask and the optional temperature columns) with the reader and the row
rules every command runs (`pgdiag.data.runs.load_rows`, `pgdiag.data.validate.validate_rows`: E102, E103,
E201-E203, E208, E210-E213, one line naming the file, step and sample), sorts them in part-plan order
(step, group_id, sample_id, segment_idx) and flattens the token lists into one buffer with per-sample offsets.
`resolve_temperature` applies the `--temperature auto` rule and `plan_parts` cuts the rows into output parts.

Why a module of its own: these are the input rules of recompute (what is read, in which order, which rows go to
which file); `pgdiag.recompute.logprobs` only orchestrates compute and writing on top of them.

How: ``inputs = read_inputs(run, vocab_size)``; ``parts = plan_parts(inputs, 2048)``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import polars as pl

from pgdiag.data.flat import flat_list, subset_rows
from pgdiag.data.runs import Run, load_rows
from pgdiag.data.seqhash import input_fingerprint
from pgdiag.data.validate import validate_rows
from pgdiag.errors import InvalidInputError

# Defaults of `recompute_logprobs`, kept in this torch-free module so the CLI can show them without importing torch.
DEFAULT_BATCH_TOKENS = 32768
DEFAULT_PART_SAMPLES = 2048


@dataclass(frozen=True)
class RecomputeInputs:
    """The run's samples sorted by (step, group_id, sample_id, segment_idx); token arrays flat over samples."""

    source: str
    step: np.ndarray  # (S,) int64
    sample_id: np.ndarray  # (S,) object
    segment_idx: np.ndarray  # (S,) int32
    seq_hash: np.ndarray  # (S,) uint64
    offsets: np.ndarray  # (S+1,) int64
    input_ids: np.ndarray  # (T_total,) int64
    loss_mask: np.ndarray  # (T_total,) bool
    temperature: np.ndarray | None  # (T_total,) float64 per-token temperature, None when uniform
    routed_experts: np.ndarray | None = (
        None  # (T_total, L_sparse, k) int16 recorded routes, -1 = not recorded
    )

    def keys(self, rows: range) -> list[tuple[int, str, int, int]]:
        return [
            (int(self.step[r]), str(self.sample_id[r]), int(self.segment_idx[r]), int(self.seq_hash[r]))
            for r in rows
        ]


@dataclass(frozen=True)
class Part:
    """One output file: rows ``start:stop`` of the sorted inputs, all of one step."""

    step: int
    index: int
    start: int
    stop: int
    fingerprint: str

    @property
    def relpath(self) -> str:
        return f"step={self.step}/part-{self.index:05d}.parquet"

    def plan_entry(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "index": self.index,
            "n_samples": self.stop - self.start,
            "keys": self.fingerprint,
        }


def _where(inputs_source: str, step: np.ndarray, sample_id: np.ndarray, row: int) -> str:
    return f"{inputs_source}: step {int(step[row])}, sample {sample_id[row]}"


@dataclass(frozen=True)
class RouteShape:
    """What a recorded route must look like for this model: MoE layers, experts per token, expert count."""

    layers: int
    top_k: int
    num_experts: int


ROUTES_COLUMN = "routed_experts"


# A step without loss tokens is recomputed as all-null lists, not refused as `check` and `metrics` refuse it.
_NOT_RECOMPUTE_ERRORS = ("E209",)
_HINTS = {"E208": "the rollouts were made with another tokenizer or model; check --model"}


def read_inputs(run: Run, vocab_size: int, routes: RouteShape | None = None) -> RecomputeInputs:
    """The columns recompute needs, checked by the rules every command runs, sorted in part-plan order.

    The rows are read and validated as `check` reads them (`pgdiag.data.runs.load_rows`, then
    `pgdiag.data.validate.validate_rows` with the model's `vocab_size`): types (E103), structure and keys
    (E201, E202, E210-E213), loss positions (E203) and token ids (E208); the first error is raised.
    `routes`: read the optional ``routed_experts`` column (MoE models) and check it against this shape
    (E201 length, E218 expert id out of range); None or no such column leaves `routed_experts` None.
    """
    source = str(run.root if run.root is not None else (run.paths[0] if run.paths else "RUN"))
    optional = ("temperature", "temperature_tok", *((ROUTES_COLUMN,) if routes else ()))
    rows = load_rows(run, streams=(), scalars=optional)
    found = validate_rows(rows.table, ignore=_NOT_RECOMPUTE_ERRORS, vocab_size=vocab_size)
    errors = sorted((i for i in (*rows.issues, *found.issues) if i.severity == "error"), key=lambda i: i.code)
    if errors:
        first = errors[0]
        raise InvalidInputError(first.code, first.message, first.hint or _HINTS.get(first.code))
    table = rows.table
    if "segment_idx" not in table.frame.columns:
        table = replace(table, frame=table.frame.with_columns(pl.lit(0, dtype=pl.Int32).alias("segment_idx")))
    order = (
        table.frame.with_row_index("__row")
        .with_columns(pl.col("segment_idx").fill_null(0))
        .sort(["step", "group_id", "sample_id", "segment_idx"], maintain_order=True)["__row"]
        .to_numpy()
    )
    table = subset_rows(table, order)
    frame = table.frame
    ids, offsets = table.lists["input_ids"], table.lists["input_ids"].offsets
    step = frame["step"].cast(pl.Int64).to_numpy()
    sample_id = frame["sample_id"].cast(pl.String).to_numpy().astype(object)
    return RecomputeInputs(
        source=source,
        step=step,
        sample_id=sample_id,
        segment_idx=frame["segment_idx"].fill_null(0).cast(pl.Int32).to_numpy(),
        seq_hash=frame["seq_hash"].cast(pl.UInt64).to_numpy(),
        offsets=offsets,
        input_ids=ids.values.astype(np.int64),
        loss_mask=table.lists["loss_mask"].values.astype(bool),
        temperature=_token_temperatures(frame, offsets),
        routed_experts=_routes(frame, offsets, routes, source, step, sample_id) if routes else None,
    )


def _routes(
    frame: pl.DataFrame,
    offsets: np.ndarray,
    shape: RouteShape,
    source: str,
    step: np.ndarray,
    sample_id: np.ndarray,
) -> np.ndarray | None:
    """(T_total, L, k) int16 from ``routed_experts``; a null row is an unrecorded sample (all -1)."""
    if ROUTES_COLUMN not in frame.columns:
        return None
    per_token = shape.layers * shape.top_k
    lengths = np.diff(offsets)
    flat = flat_list(frame[ROUTES_COLUMN].cast(pl.List(pl.Int64)))
    recorded = np.ones(frame.height, dtype=bool) if flat.row_valid is None else flat.row_valid.copy()
    bad = np.flatnonzero(recorded & (flat.lengths != lengths * per_token))
    if bad.size:
        r = int(bad[0])
        raise InvalidInputError(
            "E201",
            f"{_where(source, step, sample_id, r)}: {ROUTES_COLUMN} length {flat.lengths[r]} != input_ids "
            f"{lengths[r]} x {shape.layers} MoE layers x top-{shape.top_k}",
            "the routes were recorded for another model, or not for every token (pad with -1)",
        )
    values = flat.values if flat.valid is None else np.where(flat.valid, flat.values, -1)
    out_of_range = np.flatnonzero((values < -1) | (values >= shape.num_experts))
    if out_of_range.size:
        first = int(out_of_range[0])
        r = int(np.searchsorted(flat.offsets, first, side="right") - 1)
        raise InvalidInputError(
            "E218",
            f"{_where(source, step, sample_id, r)}, {ROUTES_COLUMN} element {first - flat.offsets[r]}: expert "
            f"{values[first]} outside [-1, {shape.num_experts})",
            "the routes were recorded for another model; check --model",
        )
    routes = np.full((int(offsets[-1]), shape.layers, shape.top_k), -1, dtype=np.int16)
    token_rows = np.repeat(recorded, lengths)  # (T_total,) tokens of recorded samples
    value_rows = np.repeat(recorded, flat.lengths)
    routes[token_rows] = values[value_rows].reshape(-1, shape.layers, shape.top_k)
    return routes


def _token_temperatures(frame: pl.DataFrame, offsets: np.ndarray) -> np.ndarray | None:
    """(T_total,) per-token temperature from `temperature_tok`, else the row `temperature`; None without either."""
    lengths = np.diff(offsets)
    row = None
    if "temperature" in frame.columns and frame["temperature"].null_count() < frame.height:
        row = np.repeat(frame["temperature"].cast(pl.Float64).fill_null(np.nan).to_numpy(), lengths)
    if "temperature_tok" not in frame.columns:
        return row
    flat = flat_list(frame["temperature_tok"].cast(pl.List(pl.Float64)))
    values = flat.values if flat.valid is None else np.where(flat.valid, flat.values, np.nan)  # (N_tok,)
    rows_ok = flat.lengths == lengths  # null or short lists fall back to the row temperature
    if flat.row_valid is not None:
        rows_ok &= flat.row_valid
    tok = np.full(int(offsets[-1]), np.nan)
    tok[np.repeat(rows_ok, lengths)] = values[np.repeat(rows_ok, flat.lengths)]
    if row is not None:
        tok = np.where(np.isnan(tok), row, tok)
    return tok if not np.all(np.isnan(tok)) else row


def resolve_temperature(
    run: Run, inputs: RecomputeInputs, temperature: float | str
) -> tuple[float | None, str, tuple[str, ...]]:
    """(value or None for per-token, source, warnings) following `--temperature auto`."""
    if temperature != "auto":
        return float(temperature), "option", ()
    if inputs.temperature is not None:
        on_loss = inputs.temperature[inputs.loss_mask]
        if on_loss.size and not np.isnan(on_loss).any():
            values = np.unique(on_loss)
            if values.size == 1:
                return float(values[0]), "column", ()
            return None, "column", ()
    sampling = (run.meta or {}).get("sampling") or {}
    if isinstance(sampling, dict) and isinstance(sampling.get("temperature"), (int, float)):
        return float(sampling["temperature"]), "sampling", ()
    return 1.0, "default", ("W409: no temperature in the rollouts or their metadata; recomputed at T=1.0",)


def with_uniform_temperature(inputs: RecomputeInputs) -> RecomputeInputs:
    """`inputs` without per-token temperatures (one temperature applies to every token)."""
    return replace(inputs, temperature=None)


def plan_parts(inputs: RecomputeInputs, part_samples: int) -> list[Part]:
    """Per step (inputs are sorted), consecutive chunks of `part_samples` rows."""
    parts: list[Part] = []
    steps, starts = np.unique(inputs.step, return_index=True)
    bounds = [*starts.tolist(), len(inputs.step)]
    for s, step in enumerate(steps.tolist()):
        for index, lo in enumerate(range(bounds[s], bounds[s + 1], part_samples)):
            hi = min(lo + part_samples, bounds[s + 1])
            keys = f"{input_fingerprint(inputs.keys(range(lo, hi))):016x}"
            parts.append(Part(step=int(step), index=index, start=lo, stop=hi, fingerprint=keys))
    return parts
