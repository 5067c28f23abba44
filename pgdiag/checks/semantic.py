"""Semantic checks of log-prob stream pairs and `check_run` (`pgdiag check`, docs/cli.md).

Why: a file can be valid and still be wrong in ways only the numbers reveal: a stream shifted by one
position, zero-filled values, a temperature applied on one side, processed (renormalised) engine log-probs,
stale weights after a resume. How: `check_frame` validates an in-memory frame (for
importers, before anything is written). `semantic_checks` works on one `TokenBatch` and two of its (M,) streams
a (sampling side) and b, with Δ = lp_b − lp_a on the loss positions where both are finite; statistics
(medians, fits) use at most 2M evenly strided tokens, counts use all of them. `compare` reuses it on two aligned
runs by putting both sides into one batch. `metadata_checks` reads footers (W403 by metadata, W405, W409,
W411). `check_run` runs the whole row validation (collecting issues, never raising for bad data) and then these checks
on every stream pair that includes ``rollout`` (or the pair given), plus the minimal two-run checks E301,
E303/W303 and E304.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import polars as pl

from pgdiag.data.batch import TokenBatch
from pgdiag.data.flat import FlatList, RowTable, flat_list
from pgdiag.data.runs import FILE_COLUMN, Run, batch_inputs, build_token_batch, load_rows
from pgdiag.data.schema import REQUIRED_COLUMNS, cast_problem, stream_column
from pgdiag.data.validate import CheckResult, Issue, check_result, missing_columns, validate_rows
from pgdiag.errors import InvalidInputError, UsageError

STAT_SAMPLE_TOKENS = 2_000_000
SHIFT_MIN_MEDIAN = 0.05
SLOPE_TOL = 0.05
SLOPE_MIN_R = 0.9
FIRST_TOKEN_RATIO = 5.0
FIRST_TOKEN_MIN_SEQS = 100
STALE_FACTOR = 3.0
STALE_MIN = 0.005
STALE_WINDOW = 5
EXTREME_DELTA = 20.0
MIN_STAT_TOKENS = 200  # fits, medians and sign fractions need this many valid tokens (W401, W403, E302)
MASK_ERROR_FRACTION = 0.01


def _stride(n: int) -> int:
    """Step between the tokens used for statistics, so that at most STAT_SAMPLE_TOKENS are used."""
    return max(1, -(-n // STAT_SAMPLE_TOKENS))


def _sample_sums(batch: TokenBatch, x: np.ndarray) -> np.ndarray:
    """(S,) sum of the token array `x` over each sample (via one cumulative sum; empty samples give 0)."""
    cumulative = np.zeros(x.shape[0] + 1, dtype=np.float64)
    np.cumsum(x, out=cumulative[1:])
    return cumulative[batch.offsets[1:]] - cumulative[batch.offsets[:-1]]


def _examples(batch: TokenBatch, token_index: np.ndarray, max_examples: int) -> tuple[str, dict[str, Any]]:
    """Location text of the first tokens of `token_index` and the first location as Issue fields."""
    token_index = np.asarray(token_index)[:max_examples]
    if token_index.size == 0:
        return "", {}
    rows = np.searchsorted(batch.offsets, token_index, side="right") - 1
    parts = [
        f"step {batch.step[r]}, sample {batch.sample_id[r]}, pos {batch.pos[t]}"
        for r, t in zip(rows.tolist(), token_index.tolist(), strict=True)
    ]
    first = {
        "step": int(batch.step[rows[0]]),
        "sample_id": str(batch.sample_id[rows[0]]),
        "pos": int(batch.pos[token_index[0]]),
    }
    return f" ({'; '.join(parts)})", first


def _median_abs(x: np.ndarray) -> float:
    return float(np.median(np.abs(x))) if x.size else float("nan")


def shift_check(batch: TokenBatch, a: str, b: str, valid: np.ndarray) -> Issue | None:
    """E302: b looks shifted by ±1 position against a (medians of |a_i − b_{i+k}|, k ∈ {−1, 0, +1}).

    Only pairs where position i+k is also a loss position of the same sample are used; medians run over
    at most STAT_SAMPLE_TOKENS evenly strided tokens.
    """
    lp_a, lp_b = batch.streams[a], batch.streams[b]
    stride = _stride(lp_a.shape[0])
    sub_valid = valid[::stride]
    m0 = _median_abs(lp_a[::stride][sub_valid] - lp_b[::stride][sub_valid])
    if not m0 > SHIFT_MIN_MEDIAN:
        return None
    starts = np.zeros(lp_a.shape[0] + 1, dtype=bool)
    starts[batch.offsets] = True
    here = np.arange(0, lp_a.shape[0] - 1, stride)  # token i; i + 1 is the next loss token
    adjacent = (
        (batch.pos[here + 1] == batch.pos[here] + 1) & ~starts[here + 1] & valid[here] & valid[here + 1]
    )
    here = here[adjacent]
    m_plus = _median_abs(lp_a[here] - lp_b[here + 1])  # b_{i+1} against a_i
    m_minus = _median_abs(lp_a[here + 1] - lp_b[here])  # b_{i-1} against a_i
    best, k = (m_plus, "+1") if not m_minus < m_plus else (m_minus, "-1")
    if not best < m0 / 2:
        return None
    return Issue(
        "E302",
        "error",
        int(np.count_nonzero(valid)),
        f"{stream_column(b)} looks shifted by {k} vs {stream_column(a)} (median |Δ| {best:.3g} at {k}, {m0:.3g} at 0)",
        hint="next-token vs token alignment: re-import with --shift",
    )


def first_token_ratio(batch: TokenBatch, delta_abs: np.ndarray, valid: np.ndarray) -> tuple[float, int]:
    """Mean |Δ| on the first loss token of each sample over the mean |Δ| of all valid tokens, and the number
    of samples whose first token is valid."""
    firsts = batch.offsets[:-1][batch.n_loss > 0]
    firsts = firsts[valid[firsts]]
    n_valid = int(np.count_nonzero(valid))
    overall = float(np.sum(delta_abs, where=valid)) / n_valid if n_valid else 0.0
    if firsts.size == 0 or overall == 0.0:
        return float("nan"), int(firsts.size)
    return float(delta_abs[firsts].mean()) / overall, int(firsts.size)


def _per_step_abs_mean(
    batch: TokenBatch, delta_abs: np.ndarray, valid: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Steps (sorted) and their mean |Δ| over valid tokens (`delta_abs` must be 0 where not valid)."""
    steps, step_code = np.unique(batch.step, return_inverse=True)
    sums = np.bincount(step_code, weights=_sample_sums(batch, delta_abs), minlength=steps.size)
    counts = np.bincount(
        step_code, weights=_sample_sums(batch, valid.astype(np.float64)), minlength=steps.size
    )
    with np.errstate(invalid="ignore", divide="ignore"):
        return steps, sums / counts


def semantic_checks(
    batch: TokenBatch, a: str, b: str, *, max_examples: int = 5, sampling_side_is_engine: bool = True
) -> list[Issue]:
    """Data checks of the pair (a, b) of `batch.streams` on loss positions where both are finite.

    Returns issues E302 (shift), E206 (0.0 where the paired stream < −1), W401 (fit slope, or first-token
    ratio with one-signed Δ), W403 (a ≥ b on > 90 % of tokens with mean Δ < −0.01; only when
    `sampling_side_is_engine`), W406 (first-token ratio > 5 over ≥ 100 samples), W407 (per-step mean |Δ| > 3×
    the median of the 5 previous steps and > 0.005) and W410 (|Δ| > 20). Δ = lp_b − lp_a.
    """
    lp_a, lp_b = batch.streams[a], batch.streams[b]
    valid = np.isfinite(lp_a) & np.isfinite(lp_b)
    n_valid = int(np.count_nonzero(valid))
    issues: list[Issue] = []
    if n_valid == 0:
        return issues
    pair = f"{stream_column(b)} vs {stream_column(a)}"
    shift = shift_check(batch, a, b, valid) if n_valid >= MIN_STAT_TOKENS else None
    if shift is not None:
        issues.append(shift)
    for zero_side, other_side in ((a, b), (b, a)):
        zero = np.flatnonzero(batch.streams[zero_side] == 0.0)
        filled = zero[batch.streams[other_side][zero] < -1.0]
        if filled.size:
            where, first = _examples(batch, filled, max_examples)
            issues.append(
                Issue(
                    "E206",
                    "error",
                    int(filled.size),
                    f"{stream_column(zero_side)} 0.0 where {stream_column(other_side)} < -1 on {filled.size} "
                    f"tokens: zero-filled{where}",
                    hint="missing values written as 0? import them as null",
                    **first,
                )
            )
    delta = lp_b - lp_a  # (M,), 0 where not valid
    if n_valid < delta.shape[0]:
        delta[~valid] = 0.0
    delta_abs = np.abs(delta)
    stride = _stride(delta.shape[0])
    sub_valid = valid[::stride]
    xa, xb = lp_a[::stride][sub_valid], lp_b[::stride][sub_valid]
    slope = r = float("nan")
    if xa.size > 2 and np.std(xa) > 0 and np.std(xb) > 0:
        xa_c, xb_c = xa - xa.mean(), xb - xb.mean()
        slope = float((xa_c * xb_c).sum() / (xa_c * xa_c).sum())
        r = float((xa_c * xb_c).sum() / np.sqrt((xa_c * xa_c).sum() * (xb_c * xb_c).sum()))
    ratio, n_first = first_token_ratio(batch, delta_abs, valid)
    seq_delta = _sample_sums(batch, delta)[batch.n_loss > 0]
    one_sign = max(float((seq_delta > 0).mean()), float((seq_delta < 0).mean())) if seq_delta.size else 0.0
    enough = n_valid >= MIN_STAT_TOKENS
    if enough and abs(slope - 1.0) > SLOPE_TOL and r > SLOPE_MIN_R:
        issues.append(
            Issue(
                "W401",
                "warning",
                n_valid,
                f"{pair}: slope {slope:.3g}: one side looks tempered (implied T ≈ {1 / slope:.3g})",
                hint="check temperature on both sides",
            )
        )
    elif enough and ratio > FIRST_TOKEN_RATIO and one_sign > 0.8 and n_first >= FIRST_TOKEN_MIN_SEQS:
        issues.append(
            Issue(
                "W401",
                "warning",
                n_first,
                f"{pair}: first token carries {ratio:.3g}× the mean |Δ| and Δ has one sign in {100 * one_sign:.0f} % "
                "of sequences: temperature on one side?",
                hint="check temperature on both sides",
            )
        )
    if ratio > FIRST_TOKEN_RATIO and n_first >= FIRST_TOKEN_MIN_SEQS:
        issues.append(
            Issue(
                "W406", "warning", n_first, f"{pair}: first response token carries {ratio:.3g}× the mean |Δ|"
            )
        )
    if sampling_side_is_engine and enough:
        frac_ge = int(np.count_nonzero((delta <= 0.0) & valid)) / n_valid
        mean_delta = float(delta.sum()) / n_valid
        if frac_ge > 0.9 and mean_delta < -0.01:
            issues.append(
                Issue(
                    "W403",
                    "warning",
                    n_valid,
                    f"{stream_column(a)} ≥ {stream_column(b)} on {100 * frac_ge:.0f} % of tokens (mean Δ {mean_delta:.3g}, "
                    f"implied kept mass {np.exp(mean_delta):.2f}): processed log-probs with top-p?",
                    hint="log raw log-probs (vLLM --logprobs-mode raw_logprobs)",
                )
            )
    steps, step_mean = _per_step_abs_mean(batch, delta_abs, valid)
    for k in range(1, steps.size):
        before = step_mean[max(0, k - STALE_WINDOW) : k]
        before = before[np.isfinite(before)]
        if before.size and step_mean[k] > STALE_FACTOR * np.median(before) and step_mean[k] > STALE_MIN:
            issues.append(
                Issue(
                    "W407",
                    "warning",
                    1,
                    f"{pair}: step {steps[k]}: mean |Δ| {step_mean[k]:.3g} vs {np.median(before):.3g} before "
                    "(resume or weight sync?)",
                    step=int(steps[k]),
                )
            )
    extreme = np.flatnonzero(delta_abs > EXTREME_DELTA)
    if extreme.size:
        where, first = _examples(batch, extreme, max_examples)
        issues.append(
            Issue(
                "W410",
                "warning",
                int(extreme.size),
                f"{pair}: {extreme.size} tokens with |Δ| > 20 (counted, not clamped){where}",
                **first,
            )
        )
    return issues


def metadata_checks(
    meta: Mapping[str, Any], streams: Sequence[str], recompute_settings: Mapping[str, Mapping]
) -> list[Issue]:
    """Footer checks: W402 (temperature), W403 (processed with truncation), W405 (retokenized), W408 (TRL
    without old), W409 (unknown semantics), W411 (dtypes).

    `meta` is a decoded rollouts footer; `recompute_settings` maps recompute tags to their ``settings``.
    """
    issues: list[Issue] = []
    stream_meta = meta.get("streams") or {}
    sampling = meta.get("sampling") or {}
    truncated = (
        (sampling.get("top_p") not in (None, 1, 1.0))
        or (sampling.get("top_k") not in (None, 0, -1))
        or (sampling.get("min_p") not in (None, 0, 0.0))
    )
    if (meta.get("source") or {}).get("retokenized") is True:
        issues.append(
            Issue("W405", "warning", 1, "ids were re-tokenized from text; expect drift against engine ids")
        )
    dtypes: dict[str, str] = {}
    for stream in streams:
        info = stream_meta.get(stream) or stream_meta.get(stream_column(stream))
        if stream in recompute_settings:
            settings = recompute_settings[stream]
            if settings.get("temperature_source") == "default":
                issues.append(Issue("W409", "warning", 1, f"{stream}: recompute fell back to T = 1"))
            sampled_t, recompute_t = sampling.get("temperature"), settings.get("temperature")
            if (
                isinstance(sampled_t, int | float)
                and isinstance(recompute_t, int | float)
                and sampled_t != recompute_t
            ):
                issues.append(
                    Issue(
                        "W402",
                        "warning",
                        1,
                        f"rollout sampled at T={sampled_t:g} but {stream} used T={recompute_t:g}",
                        hint="recompute with --temperature auto or the sampling temperature",
                    )
                )
            if settings.get("head_dtype"):
                dtypes[stream] = str(settings["head_dtype"])
            continue
        if not isinstance(info, Mapping):
            continue
        unknown = [key for key in ("tempered", "logprobs_mode") if info.get(key) == "unknown"]
        if unknown:
            issues.append(
                Issue(
                    "W409",
                    "warning",
                    1,
                    f"{stream_column(stream)}: {' and '.join(unknown)} unknown",
                    hint="pass --tempered / --logprobs-mode at import",
                )
            )
        mode = info.get("logprobs_mode") or sampling.get("logprobs_mode")
        if mode == "processed" and truncated:
            issues.append(
                Issue(
                    "W403",
                    "warning",
                    1,
                    f"{stream_column(stream)}: processed log-probs with top-p/top-k/min-p truncation",
                    hint="log raw log-probs to compare with a trainer",
                )
            )
        if info.get("head_dtype"):
            dtypes[stream] = str(info["head_dtype"])
    tempered = {s: (stream_meta.get(s) or {}).get("tempered") for s in streams if s not in recompute_settings}
    known = {s: t for s, t in tempered.items() if isinstance(t, bool)}
    sampled_t = sampling.get("temperature")
    if isinstance(sampled_t, int | float) and sampled_t != 1 and len(set(known.values())) > 1:
        text = ", ".join(f"{stream_column(s)} tempered={t}" for s, t in known.items())
        issues.append(
            Issue(
                "W402", "warning", 1, f"sampled at T={sampled_t:g} but streams disagree on tempering: {text}"
            )
        )
    if (meta.get("source") or {}).get("framework") == "trl" and "old" not in streams:
        issues.append(
            Issue(
                "W408",
                "warning",
                1,
                "old_logprobs absent: with one iteration only sampling log-probs describe the behaviour policy",
            )
        )
    if len(set(dtypes.values())) > 1:
        text = " vs ".join(f"{s} head {d}" for s, d in dtypes.items())
        issues.append(Issue("W411", "warning", 1, f"precision mismatch: {text}"))
    return issues


def mask_issue(n_only_a: int, n_a: int, what: str) -> Issue | None:
    """E303 (over 1 % of a's loss positions not loss positions of b) or W303 (any)."""
    if n_only_a == 0 or n_a == 0:
        return None
    fraction = n_only_a / n_a
    code, severity = ("E303", "error") if fraction > MASK_ERROR_FRACTION else ("W303", "warning")
    return Issue(
        code,
        severity,
        n_only_a,
        f"loss masks differ on {100 * fraction:.2g} % of positions ({what}; tool tokens trained on one side?)",
    )


def _recompute_settings(run: Run) -> dict[str, Mapping]:
    import pyarrow.parquet as pq

    from pgdiag.data.schema import decode_footer

    out: dict[str, Mapping] = {}
    for tag, directory in run.recompute.items():
        parts = sorted(directory.rglob("*.parquet"))
        parts = [p for p in parts if not p.name.startswith(("_", "."))]
        if parts:
            meta = decode_footer(pq.read_schema(parts[0]).metadata).get("recompute") or {}
            out[tag] = meta.get("settings") or {} if isinstance(meta, Mapping) else {}
    return out


def _cross_run_issues(run: Run, other: Run, max_examples: int) -> list[Issue]:
    """E304 (no sample matched by (step, sample_id, segment_idx)), E301 (matched, different tokens), E303/W303."""
    keys = ["step", "sample_id", "segment_idx"]

    def frame(r: Run) -> pl.DataFrame:
        schema = r.lazy.collect_schema()
        seg = (
            pl.col("segment_idx").fill_null(0).cast(pl.Int32)
            if "segment_idx" in schema
            else pl.lit(0, pl.Int32)
        )
        return r.lazy.select(
            pl.col("step").cast(pl.Int64),
            pl.col("sample_id").cast(pl.String),
            seg.alias("segment_idx"),
            pl.col("seq_hash").cast(pl.UInt64),
            pl.col("loss_mask"),
        ).collect()

    left, right = frame(run), frame(other)
    joined = left.join(right, on=keys, how="inner", suffix="_b")
    issues: list[Issue] = []
    if joined.height == 0:
        steps_a = f"{left['step'].min()}-{left['step'].max()}" if left.height else "none"
        steps_b = f"{right['step'].min()}-{right['step'].max()}" if right.height else "none"
        issues.append(
            Issue(
                "E304",
                "error",
                left.height,
                f"0 of {left.height} samples matched by (step, sample_id); steps {steps_a} vs {steps_b}?",
            )
        )
        return issues
    differ = joined.filter(pl.col("seq_hash") != pl.col("seq_hash_b")).sort(keys)
    if differ.height:
        shown = "; ".join(
            f"step {s}, sample {i}"
            for s, i in differ.select("step", "sample_id").head(max_examples).iter_rows()
        )
        issues.append(
            Issue(
                "E301",
                "error",
                differ.height,
                f"{differ.height} matched samples differ in tokens ({shown})",
                step=int(differ["step"][0]),
                sample_id=str(differ["sample_id"][0]),
            )
        )
    same = joined.filter(pl.col("seq_hash") == pl.col("seq_hash_b"))
    if same.height:
        mask_a = same["loss_mask"].explode().fill_null(False).to_numpy()
        mask_b = same["loss_mask_b"].explode().fill_null(False).to_numpy()
        if mask_a.shape == mask_b.shape:
            issue = mask_issue(
                int((mask_a & ~mask_b).sum()), int(mask_a.sum()), f"{run.label} vs {other.label}"
            )
            if issue is None:
                issue = mask_issue(
                    int((mask_b & ~mask_a).sum()), int(mask_b.sum()), f"{other.label} vs {run.label}"
                )
            if issue is not None:
                issues.append(issue)
    return issues


def check_frame(
    frame: pl.DataFrame,
    *,
    source: str = "<frame>",
    ignore: Sequence[str] = (),
    max_examples: int = 5,
    vocab_size: int | None = None,
    strict: bool = False,
) -> CheckResult:
    """Row validation of an in-memory rollouts frame (e.g. before `write_rollouts` in an import).

    `source` names the data in messages in place of a file. Stream columns are every ``*_logprobs`` column.
    """
    ignored = set(ignore)
    issues = missing_columns(frame.columns, [c for c in REQUIRED_COLUMNS if c != "seq_hash"])
    issues += [
        Issue("E103", "error", 1, f"{source}: {problem}")
        for c in frame.columns
        if (problem := cast_problem(c, frame.schema[c])) is not None
    ]
    if issues:
        return check_result([i for i in issues if i.code not in ignored], strict=strict)
    stream_cols = tuple(c for c in frame.columns if c.endswith("_logprobs"))
    list_cols = [
        "input_ids",
        "loss_mask",
        *stream_cols,
        *(["advantages"] if "advantages" in frame.columns else []),
    ]
    lists = {}
    for column in list_cols:
        values = frame[column]
        if isinstance(values.dtype, pl.Array):
            values = values.cast(pl.List(values.dtype.inner))
        raw = flat_list(values)
        if column == "input_ids" and raw.values.size and raw.values.dtype.itemsize > 4:
            low, high = int(raw.values.min()), int(raw.values.max())
            if low < np.iinfo(np.int32).min or high > np.iinfo(np.int32).max:
                problem = Issue("E103", "error", 1, f"{source}: input_ids: value {high} does not fit int32")
                return check_result([problem] if "E103" not in ignored else [], strict=strict)
        numpy_type = (
            np.int32 if column == "input_ids" else (np.bool_ if column == "loss_mask" else np.float32)
        )
        lists[column] = FlatList(
            raw.offsets, raw.values.astype(numpy_type, copy=False), raw.valid, raw.row_valid
        )
    scalars = frame.drop(list_cols).with_columns(pl.lit(source).alias(FILE_COLUMN))
    found = validate_rows(
        RowTable(scalars, lists, stream_cols),
        ignore=ignored,
        max_examples=max_examples,
        vocab_size=vocab_size,
    )
    return check_result([i for i in found.issues if i.code not in ignored], strict=strict)


def _single_run_issues(
    run: Run, streams: Sequence[str] | None, ignored: set[str], max_examples: int, vocab_size: int | None
) -> tuple[list[Issue], bool]:
    """Validation and data-check issues of one run, and whether it loaded well enough for cross-run checks."""
    pair_streams = list(streams) if streams is not None else list(run.streams)
    if streams is not None and len(pair_streams) != 2:
        raise UsageError("E112", f"--streams needs two names, got {pair_streams}", "pass --streams A,B")
    try:
        rows = load_rows(
            run,
            streams=list(dict.fromkeys(pair_streams)),
            entropy=run.entropy_streams,
            scalars=["advantage", "reward", "env"],
            lists=["advantages"],
        )
    except InvalidInputError as exc:
        return [Issue(exc.code, "error", 1, exc.message, hint=exc.hint)], False
    found = validate_rows(rows.table, ignore=ignored, max_examples=max_examples, vocab_size=vocab_size)
    issues = rows.issues + found.issues
    sound = found.bad_rows is None
    frame, view, keep = batch_inputs(rows, found)
    loaded_streams, loaded_entropy = rows.streams, rows.entropy
    del rows, found  # drop the list buffers before the float64 arrays are allocated
    batch = build_token_batch(
        run, frame, view, streams=loaded_streams, entropy=loaded_entropy, sample_row=keep, env=True
    )
    del view
    if streams is not None:
        pairs = [(pair_streams[0], pair_streams[1])]
    else:
        pairs = [("rollout", s) for s in pair_streams if s != "rollout"] if "rollout" in pair_streams else []
    for a, b in pairs:
        issues += semantic_checks(
            batch, a, b, max_examples=max_examples, sampling_side_is_engine=a == "rollout"
        )
    if {"old", "new"} <= set(batch.streams) and np.array_equal(
        batch.streams["old"], batch.streams["new"], equal_nan=True
    ):
        issues.append(
            Issue(
                "W408",
                "warning",
                batch.n_tokens,
                "old_logprobs identical to new_logprobs: one iteration only?",
            )
        )
    issues += metadata_checks(run.meta, pair_streams, _recompute_settings(run))
    return issues, sound


def check_run(
    run: Run,
    other: Run | None = None,
    *,
    streams: Sequence[str] | None = None,
    ignore: Sequence[str] = (),
    max_examples: int = 5,
    vocab_size: int | None = None,
    strict: bool = False,
) -> CheckResult:
    """Run row validation and the data checks on `run`, and on `other` plus minimal cross-run checks.

    Bad data never raises here: every finding is an issue of the result (messages name the file, so the
    two runs' issues are told apart). `streams=[a, b]` restricts the semantic checks to that pair; by default
    every pair (rollout, s) is checked. Codes in `ignore` are dropped. Usage errors (no such stream,
    incomplete recompute dataset) still raise.
    """
    ignored = set(ignore)
    issues, sound = _single_run_issues(run, streams, ignored, max_examples, vocab_size)
    if other is not None:
        other_issues, other_sound = _single_run_issues(other, streams, ignored, max_examples, vocab_size)
        issues += other_issues
        if sound and other_sound:
            issues += _cross_run_issues(run, other, max_examples)
    return check_result([i for i in issues if i.code not in ignored], strict=strict)
