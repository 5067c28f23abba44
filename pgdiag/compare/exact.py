"""`compare --exact`: bitwise agreement of two log-prob streams, as a fold over aligned pieces.

Runs that claim true on-policy (verl#7688, NeMo-RL#3743, SkyRL#2201: "not an epsilon threshold") need a gate
that fails on *any* nonzero Δ and says where the first one is. `ExactAgreement.add(pair)` takes each aligned
piece (`pgdiag.compare.align.AlignedPair`, pieces in step order) and `finish()` returns the counts:

* tokens compared, tokens with any nonzero Δ (finite values whose float32 bits differ, or a non-finite value on
  one side only, or two different non-finite values); equal −inf and NaN on both sides count as equal;
* the first divergent token (step, sample, position, token id, both values, its ULP distance);
* a histogram of the distance in ULPs: the float32 bit patterns mapped to ordered integers (negative floats
  mirrored below zero, so adjacent floats are adjacent integers and −0.0 = +0.0), distance = |key_a − key_b|,
  counted in power-of-two buckets ``0``, ``1``, ``2-3``, ``4-7``, …

Both streams must hold float32 values: a value that float32 cannot represent exactly (a float64 stream) is
refused with E103, since its bits say nothing about the engine's. Token ids and loss masks must match too: ids
that differ are E301 (raised by the alignment, as in every comparison), masks that differ on any position are
counted (`mask_mismatch`, from W303) and fail the gate.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pgdiag.errors import Code, InvalidInputError
from pgdiag.report.report import ReportRow

ULP_BUCKETS = 33  # 0, then floor(log2(d)) + 1 for d in [1, 2^32)
EXACT_GATES = ("exact/n_nonzero>0", "exact/mask_mismatch>0")  # the `exact` gate (profile `exact`, `--exact`)


def check_float32_storage(run: Any, stream: str) -> None:
    """E103 when a file of `run` (a `pgdiag.data.runs.Run`) stores `stream` other than as float32 (the reader
    rounds a float64 column to float32, so the stored bits could not be compared); in-memory batches pass."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pgdiag.data.schema import stream_column

    paths = getattr(run, "paths", ())
    column = stream_column(stream)
    recompute = getattr(run, "recompute", {}) or {}
    if stream in recompute:
        paths, column = sorted(Path(recompute[stream]).glob("step=*/*.parquet")), "logprobs"
    for path in paths:
        schema = pq.read_schema(path)
        if column not in schema.names:
            continue
        kind = schema.field(column).type
        value = kind.value_type if pa.types.is_list(kind) or pa.types.is_large_list(kind) else kind
        if value != pa.float32():
            raise InvalidInputError(
                Code.LOSSY_CAST,
                f"{path}: column {column} is stored as {kind}; --exact compares float32 bits",
                "store both streams as float32 (the schema's type) and compare again",
            )


def ordered_key(values: np.ndarray) -> np.ndarray:
    """(M,) int64 ordered-integer keys of float32 `values`: monotone in the value, adjacent floats differ by 1,
    −0.0 and +0.0 share key 0."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.int32).astype(np.int64)
    return np.where(bits < 0, -(bits & 0x7FFFFFFF), bits)


def ulp_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(M,) int64 |key(a) − key(b)| of two float32 arrays (finite values)."""
    return np.abs(ordered_key(a) - ordered_key(b))


def ulp_bucket_label(index: int) -> str:
    """``0``, ``1``, ``2-3``, ``4-7``, … for bucket `index` of the ULP histogram."""
    if index == 0:
        return "0"
    lo = 1 << (index - 1)
    return str(lo) if lo == 1 else f"{lo}-{2 * lo - 1}"


@dataclass(frozen=True)
class FirstDivergence:
    """The first token (in step order, then side a's sample and position order) whose values differ."""

    step: int
    sample_id: str
    pos: int
    token_id: int
    value_a: float
    value_b: float
    ulp: int | None  # None when a side is non-finite

    def as_dict(self) -> dict[str, Any]:
        """Every field, in order; the two values JSON-safe (`_json_float`)."""
        return {**asdict(self), "value_a": _json_float(self.value_a), "value_b": _json_float(self.value_b)}


@dataclass(frozen=True)
class ExactResult:
    """What `ExactAgreement.finish` returns."""

    n_tokens: int
    n_nonzero: int
    n_nonfinite_equal: int  # tokens non-finite on both sides with the same value (NaN/NaN, −inf/−inf)
    max_ulp: int | None  # over finite tokens; None when there are none
    histogram: tuple[int, ...]  # (ULP_BUCKETS,) finite tokens per ULP bucket
    first: FirstDivergence | None
    mask_mismatch: int = 0  # loss positions of one side only (W303's count), set by the comparison

    @property
    def identical(self) -> bool:
        return self.n_nonzero == 0 and self.mask_mismatch == 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "identical": self.identical,
            "n_tokens": self.n_tokens,
            "n_nonzero": self.n_nonzero,
            "n_nonfinite_equal": self.n_nonfinite_equal,
            "mask_mismatch": self.mask_mismatch,
            "max_ulp": self.max_ulp,
            "ulp_histogram": {
                ulp_bucket_label(i): int(c) for i, c in enumerate(self.histogram) if c or i == 0
            },
            "first": None if self.first is None else self.first.as_dict(),
        }


@dataclass
class ExactAgreement:
    """Fold of `compare --exact` over aligned pieces: `add(pair)` per piece, `finish()` once."""

    n_tokens: int = 0
    n_nonzero: int = 0
    n_nonfinite_equal: int = 0
    max_ulp: int = -1
    histogram: np.ndarray = field(default_factory=lambda: np.zeros(ULP_BUCKETS, dtype=np.int64))
    first: FirstDivergence | None = None

    def add(self, pair: Any) -> None:
        """Count one aligned piece (an `AlignedPair` holding every matched token, non-finite ones included:
        the comparison aligns with E207 ignored and ``keep_nonfinite``)."""
        lp_a = np.asarray(pair.lp_a, dtype=np.float64)  # (M,)
        lp_b = np.asarray(pair.lp_b, dtype=np.float64)  # (M,)
        for values, side in ((lp_a, pair.label_a), (lp_b, pair.label_b)):
            as32 = values.astype(np.float32)
            lossy = np.isfinite(values) & (as32.astype(np.float64) != values)
            if lossy.any():
                t = int(np.flatnonzero(lossy)[0])
                row = int(pair.token_row[t])
                raise InvalidInputError(
                    Code.LOSSY_CAST,
                    f"{side}: --exact needs float32 log-probs, but step {int(pair.step[row])}, sample "
                    f"{pair.sample_id[row]}, pos {int(pair.pos[t])} holds {values[t]!r}, which float32 "
                    "cannot represent",
                    "store both streams as float32 (the schema's type) and compare again",
                )
        finite = np.isfinite(lp_a) & np.isfinite(lp_b)  # (M,)
        same_nonfinite = ~finite & ((lp_a == lp_b) | (np.isnan(lp_a) & np.isnan(lp_b)))
        distance = np.zeros(lp_a.shape[0], dtype=np.int64)
        distance[finite] = ulp_distance(lp_a[finite], lp_b[finite])
        buckets = np.zeros(int(finite.sum()), dtype=np.int64)
        nonzero_finite = distance[finite] > 0
        buckets[nonzero_finite] = np.floor(np.log2(distance[finite][nonzero_finite])).astype(np.int64) + 1
        self.histogram += np.bincount(buckets, minlength=ULP_BUCKETS)[:ULP_BUCKETS]
        if finite.any():
            self.max_ulp = max(self.max_ulp, int(distance[finite].max()))
        diverges = (finite & (distance > 0)) | (~finite & ~same_nonfinite)  # (M,)
        self.n_tokens += int(lp_a.shape[0])
        self.n_nonzero += int(diverges.sum())
        self.n_nonfinite_equal += int(same_nonfinite.sum())
        if self.first is None and diverges.any():
            t = int(np.flatnonzero(diverges)[0])
            row = int(pair.token_row[t])
            self.first = FirstDivergence(
                step=int(pair.step[row]),
                sample_id=str(pair.sample_id[row]),
                pos=int(pair.pos[t]),
                token_id=int(pair.token_id[t]),
                value_a=float(lp_a[t]),
                value_b=float(lp_b[t]),
                ulp=int(distance[t]) if finite[t] else None,
            )

    def finish(self, mask_mismatch: int = 0) -> ExactResult:
        return ExactResult(
            n_tokens=self.n_tokens,
            n_nonzero=self.n_nonzero,
            n_nonfinite_equal=self.n_nonfinite_equal,
            max_ulp=None if self.max_ulp < 0 else self.max_ulp,
            histogram=tuple(int(c) for c in self.histogram),
            first=self.first,
            mask_mismatch=mask_mismatch,
        )


def _json_float(value: float) -> float | str:
    """A float for JSON: NaN and ±inf as the strings ``nan``, ``inf``, ``-inf``."""
    if np.isfinite(value):
        return value
    return "nan" if np.isnan(value) else ("inf" if value > 0 else "-inf")


def exact_rows(result: ExactResult, name: str) -> list[ReportRow]:
    """The `exact/*` rows of `compare --exact` (the `exact` gate reads `n_nonzero` and `mask_mismatch`)."""
    n = result.n_tokens
    rows = [
        ReportRow.overall(name, "exact/n_nonzero", result.n_nonzero, "count", "count", n),
        ReportRow.overall(name, "exact/frac_nonzero", result.n_nonzero / n if n else None, "fraction",
            "token-mean", n,
        ),
        ReportRow.overall(name, "exact/mask_mismatch", result.mask_mismatch, "count", "count", n),
        ReportRow.overall(name, "exact/max_ulp", result.max_ulp, "ulp", "max", n),
        ReportRow.overall(name, "exact/n_nonfinite_equal", result.n_nonfinite_equal, "count", "count", n
        ),
    ]  # fmt: skip
    for index, count in enumerate(result.histogram):
        if count or index == 0:
            rows.append(
                ReportRow(
                    name, "token", "ulp", ulp_bucket_label(index), "exact/tokens", count, "count", "count", n
                )
            )
    return rows
