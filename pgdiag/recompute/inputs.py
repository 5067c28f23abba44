"""The samples a recompute reads: checked, ordered, flattened, with their temperatures and the part plan.

What: `read_inputs` collects the columns `pgdiag logprobs` needs from a run (step, sample_id, group_id,
segment_idx, seq_hash, input_ids, loss_mask and the optional temperature columns) with the reader and the row
rules every command runs (`pgdiag.data.load.load_rows`, `pgdiag.data.validate.validate_rows`: E102, E103,
E201-E203, E208, E210-E213, one line naming the file, step and sample), sorts them in part-plan order
(step, group_id, sample_id, segment_idx) and flattens the token lists into one buffer with per-sample offsets.
`resolve_temperature` applies the `--temperature auto` rule and `plan_parts` cuts the rows into output parts.

Why a module of its own: these are the input rules of recompute (what is read, in which order, which rows go to
which file); `pgdiag.recompute.logprobs` only orchestrates compute and writing on top of them.

How: ``inputs = read_inputs(run, vocab_size)``; ``parts = plan_parts(inputs, 2048)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import polars as pl

from pgdiag.data.flat import flat_list, row_of, subset_rows
from pgdiag.data.kept import KeptColumns
from pgdiag.data.load import load_rows
from pgdiag.data.runs import FILE_COLUMN, Run
from pgdiag.data.seqhash import input_fingerprint
from pgdiag.data.validate import validate_rows
from pgdiag.errors import Code, InvalidInputError
from pgdiag.recompute.kept_rules import SAMPLING_COLUMNS, sample_sampling

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
    kept: KeptColumns | None = None  # the recorded kept sets (CSR per sample), when read
    sampling: dict[str, np.ndarray] | None = None  # (S,) per-sample top_k / top_p / min_p, when read

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


def _where(frame: pl.DataFrame, row: int) -> str:
    """``FILE, step S, sample ID`` of row `row` of a frame read by `load_rows` (which adds ``__file``)."""
    return f"{frame[FILE_COLUMN][row]}, step {frame['step'][row]}, sample {frame['sample_id'][row]}"


@dataclass(frozen=True)
class RouteShape:
    """What a recorded route must look like for this model: MoE layers, experts per token, expert count."""

    layers: int
    top_k: int
    num_experts: int


ROUTES_COLUMN = "routed_experts"


# A step without loss tokens is recomputed as all-null lists, not refused as `check` and `metrics` refuse it.
_NOT_RECOMPUTE_ERRORS = (Code.NO_LOSS_TOKENS,)
_HINTS = {Code.TOKEN_OUT_OF_VOCAB: "the rollouts were made with another tokenizer or model; check --model"}


def read_inputs(
    run: Run,
    vocab_size: int,
    routes: RouteShape | None = None,
    *,
    temperatures: bool = True,
    kept: bool = False,
    sampling: bool = False,
) -> RecomputeInputs:
    """The columns recompute needs, checked by the rules every command runs, sorted in part-plan order.

    The rows are read and validated as `check` reads them (`pgdiag.data.load.load_rows`, then
    `pgdiag.data.validate.validate_rows` with the model's `vocab_size`): types (E103), structure and keys
    (E201, E202, E210-E213), loss positions (E203) and token ids (E208); the first error is raised.
    `routes`: read the optional ``routed_experts`` column (MoE models) and check it against this shape
    (E201 length, E218 expert id out of range); None or no such column leaves `routed_experts` None.
    `temperatures`: read the per-token temperatures (`--temperature auto`; E219 when unusable); False (an
    explicit temperature) leaves the temperature columns unread. `kept`: read and check the recorded kept
    sets (E220-E223); `sampling`: read the per-row top_k / top_p / min_p (for ``--kept-set reconstruct``).
    """
    source = str(run.root if run.root is not None else (run.paths[0] if run.paths else "RUN"))
    optional = (
        *(("temperature", "temperature_tok") if temperatures else ()),
        *((ROUTES_COLUMN,) if routes else ()),
        *(SAMPLING_COLUMNS if sampling else ()),
    )
    rows = load_rows(run, streams=(), scalars=optional, kept=kept)  # only the columns the run has
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
    mask = table.lists["loss_mask"].values.astype(bool)  # (T_total,)
    return RecomputeInputs(
        source=source,
        step=frame["step"].cast(pl.Int64).to_numpy(),
        sample_id=frame["sample_id"].cast(pl.String).to_numpy().astype(object),
        segment_idx=frame["segment_idx"].fill_null(0).cast(pl.Int32).to_numpy(),
        seq_hash=frame["seq_hash"].cast(pl.UInt64).to_numpy(),
        offsets=offsets,
        input_ids=ids.values.astype(np.int64),
        loss_mask=mask,
        temperature=_token_temperatures(frame, offsets, mask) if temperatures else None,
        routed_experts=_routes(frame, offsets, routes) if routes else None,
        kept=table.kept,
        sampling=_row_sampling(run, frame) if sampling else None,
    )


def _row_sampling(run: Run, frame: pl.DataFrame) -> dict[str, np.ndarray]:
    """(S,) top_k / top_p / min_p of every sample (row columns, else the run's defaults; see `recompute.kept`)."""
    columns = {
        name: frame[name].cast(pl.Float64).fill_null(np.nan).to_numpy()
        for name in SAMPLING_COLUMNS
        if name in frame.columns
    }
    return sample_sampling(run, columns, frame.height)


def _routes(frame: pl.DataFrame, offsets: np.ndarray, shape: RouteShape) -> np.ndarray | None:
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
            Code.LENGTH_MISMATCH,
            f"{_where(frame, r)}: {ROUTES_COLUMN} length {flat.lengths[r]} != input_ids "
            f"{lengths[r]} x {shape.layers} MoE layers x top-{shape.top_k}",
            "the routes were recorded for another model, or not for every token (pad with -1)",
        )
    values = flat.values if flat.valid is None else np.where(flat.valid, flat.values, -1)
    out_of_range = np.flatnonzero((values < -1) | (values >= shape.num_experts))
    if out_of_range.size:
        first = int(out_of_range[0])
        r = int(row_of(flat.offsets, first))
        raise InvalidInputError(
            Code.EXPERT_OUT_OF_RANGE,
            f"{_where(frame, r)}, {ROUTES_COLUMN} element {first - flat.offsets[r]}: expert "
            f"{values[first]} outside [-1, {shape.num_experts})",
            "the routes were recorded for another model; check --model",
        )
    routes = np.full((int(offsets[-1]), shape.layers, shape.top_k), -1, dtype=np.int16)
    token_rows = np.repeat(recorded, lengths)  # (T_total,) tokens of recorded samples
    value_rows = np.repeat(recorded, flat.lengths)
    routes[token_rows] = values[value_rows].reshape(-1, shape.layers, shape.top_k)
    return routes


def _token_temperatures(frame: pl.DataFrame, offsets: np.ndarray, loss_mask: np.ndarray) -> np.ndarray | None:
    """(T_total,) temperature of every token from the run's columns (`--temperature auto`), or None when
    neither ``temperature_tok`` nor ``temperature`` holds a value. The rule (docs/recompute.md):

    a sample's ``temperature_tok`` list, when not null, gives its tokens' temperatures and must have one value
    per token; a sample whose list is null (or a run without the column) takes its row ``temperature``; a sample
    with neither, while others have one, is refused. Every loss position's temperature must be a number > 0
    (finite). Each violation is E219 naming the file, step, sample, column and position.
    """
    lengths = np.diff(offsets)  # (S,)
    n_rows = frame.height
    row_has = np.zeros(n_rows, dtype=bool)
    row_temperature = np.full(n_rows, np.nan)
    if "temperature" in frame.columns:
        row_has = frame["temperature"].is_not_null().to_numpy()
        row_temperature = frame["temperature"].cast(pl.Float64).fill_null(np.nan).to_numpy()
    list_has = np.zeros(n_rows, dtype=bool)
    listed = None
    if "temperature_tok" in frame.columns:
        listed = flat_list(frame["temperature_tok"].cast(pl.List(pl.Float64)))
        list_has = np.ones(n_rows, dtype=bool) if listed.row_valid is None else listed.row_valid.copy()
    if not (list_has.any() or row_has.any()):
        return None
    neither = np.flatnonzero(~list_has & ~row_has)
    if neither.size:
        raise InvalidInputError(
            Code.BAD_TEMPERATURE,
            f"{_where(frame, int(neither[0]))}: no temperature_tok list and no temperature, while other samples "
            f"have one ({neither.size} such samples)",
            "fill the missing temperatures, or pass --temperature T to use one for every token",
        )
    temperature = np.repeat(row_temperature, lengths)  # (T_total,)
    column = np.repeat(np.where(list_has, "temperature_tok", "temperature"), lengths)  # (T_total,)
    null = np.zeros(temperature.shape[0], dtype=bool)  # (T_total,) a null element of a temperature_tok list
    if listed is not None:
        wrong = np.flatnonzero(list_has & (listed.lengths != lengths))
        if wrong.size:
            r = int(wrong[0])
            raise InvalidInputError(
                Code.BAD_TEMPERATURE,
                f"{_where(frame, r)}: temperature_tok has {listed.lengths[r]} values for {lengths[r]} tokens "
                f"({wrong.size} such samples)",
                "temperature_tok holds one temperature per token of input_ids; or pass --temperature T",
            )
        from_list = np.repeat(list_has, lengths)  # (T_total,)
        temperature[from_list] = listed.values[np.repeat(list_has, listed.lengths)]
        if listed.valid is not None:
            null[from_list] = ~listed.valid[np.repeat(list_has, listed.lengths)]
    bad = np.flatnonzero(loss_mask & (null | ~(np.isfinite(temperature) & (temperature > 0))))
    if bad.size:
        first = int(bad[0])
        r = int(row_of(offsets, first))
        value = "null" if null[first] else f"{temperature[first]:g}"
        raise InvalidInputError(
            Code.BAD_TEMPERATURE,
            f"{_where(frame, r)}, {column[first]} pos {first - offsets[r]}: temperature {value} on a loss "
            f"position is not a number > 0 ({bad.size} such tokens)",
            "fix the temperatures, or pass --temperature T to use one for every token",
        )
    return temperature


def resolve_temperature(
    run: Run, inputs: RecomputeInputs, temperature: float | str
) -> tuple[float | None, str, tuple[str, ...]]:
    """(value or None for per-token, source, warnings) following `--temperature auto` (docs/recompute.md).

    An explicit `temperature` wins; else the run's columns (one value when every loss token shares it);
    else ``pgdiag.sampling.temperature``, which must be a number > 0 (E219); else 1.0 with warning W409.
    """
    if temperature != "auto":
        return float(temperature), "option", ()
    if inputs.temperature is not None:
        values = np.unique(inputs.temperature[inputs.loss_mask])
        if values.size <= 1:
            return float(values[0]) if values.size else 1.0, "column", ()
        return None, "column", ()
    sampling = (run.meta or {}).get("sampling") or {}
    value = sampling.get("temperature") if isinstance(sampling, dict) else None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not (math.isfinite(value) and value > 0):
            where = run.paths[0] if run.paths else inputs.source
            raise InvalidInputError(
                Code.BAD_TEMPERATURE,
                f"{where}: pgdiag.sampling.temperature {value!r} is not a number > 0",
                "pass --temperature T, the temperature the engine sampled at",
            )
        return float(value), "sampling", ()
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
