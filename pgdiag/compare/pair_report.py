"""The report of one compared pair: its summary rows (`parity_rows`, `diagnosed_rows`), checks and `Comparison`.

What: turns a `pooled.PooledParity` (every piece of one pair folded in) into the tidy rows of docs/compare.md
(token and sequence scope, breakdowns, the Δ histogram, the signature rows) and the finished `Comparison`
(report, worst tables, trace, plot tokens). Why: two-run, one-run and N-way compare report a pair the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from pgdiag.checks.signatures import Signatures, signature_issues
from pgdiag.compare.align import AlignedPair
from pgdiag.compare.alignment_issues import Deferred
from pgdiag.compare.exact import EXACT_GATES, ExactResult
from pgdiag.compare.parity import unit_and_reduction
from pgdiag.compare.pooled import PooledParity
from pgdiag.compare.settings import DEFAULT_PROFILE, CompareSettings
from pgdiag.data.issues import issues_frame
from pgdiag.data.validate import Issue
from pgdiag.report.gates import gate_policy
from pgdiag.report.report import CHECKS_SCHEMA, Report, ReportRow, summary_frame

_DLOGP_STEPS = (1e-6, 1e-4, 1e-3, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 20.0)  # nats


DLOGP_EDGES = (-np.inf, *(-x for x in reversed(_DLOGP_STEPS)), 0.0, *_DLOGP_STEPS, np.inf)  # Δ histogram bins


def _rows(
    pair: str,
    scope: str,
    breakdown: str,
    table: dict[str, np.ndarray],
    bucket_index: int,
    bucket: str,
    lo: float | None,
    hi: float | None,
    n_key: str,
) -> list[ReportRow]:
    n = int(table[n_key][bucket_index])
    rows = []
    for stat, values in table.items():
        if stat in ("tokens", "samples"):
            continue
        unit, reduction = unit_and_reduction(stat, scope)
        key = "count/mismatch_abs_delta_gt_20" if stat == "abs_delta_gt_20" else f"mismatch/{stat}"
        rows.append(
            ReportRow(
                pair, scope, breakdown, bucket, key, float(values[bucket_index]), unit, reduction, n, lo, hi
            )
        )
    return rows


def parity_rows(pooled: PooledParity, name: str) -> tuple[list[ReportRow], dict[str, float | None]]:
    """Every summary row of one pair from its pooled pieces; also the `all` token stats by name."""
    rows: list[ReportRow] = []
    tokens = pooled.token_table()
    rows += _rows(name, "token", "all", tokens, 0, "all", None, None, "tokens")
    n_tok = pooled.n_tokens
    rows.append(ReportRow.overall(name, "count/mismatch_tokens", n_tok, "count", "sum", n_tok))
    rows.append(ReportRow.overall(name, "count/mismatch_invalid", pooled.n_invalid, "count", "sum", n_tok))
    seqs = pooled.sequence_table()
    rows += _rows(name, "sequence", "all", seqs, 0, "all", None, None, "samples")
    n_seq = int(seqs["samples"][0])
    rows.append(ReportRow(name, "sequence", "all", "all", "count/samples", n_seq, "count", "sum", n_seq))
    for breakdown in pooled.by:
        for label, lo, hi, table in pooled.bucket_rows(breakdown):
            rows += _rows(name, "token", breakdown, table, 0, label, lo, hi, "tokens")
    rows += _dlogp_rows(name, pooled.hist, pooled.n_zero, n_tok)
    stats = {k: (None if not np.isfinite(v[0]) else float(v[0])) for k, v in tokens.items()}
    return rows, stats


def _dlogp_rows(name: str, counts: np.ndarray, n_zero: int, n_tokens: int) -> list[ReportRow]:
    """Token counts per Δ bin (breakdown `dlogp`): the histogram behind the dlogp-hist plot, over all tokens."""
    edges = np.asarray(DLOGP_EDGES)
    rows = []
    for k in range(edges.shape[0] - 1):
        lo, hi = float(edges[k]), float(edges[k + 1])
        rows.append(
            ReportRow(
                name,
                "token",
                "dlogp",
                f"[{lo:g},{hi:g})",
                "count/tokens",
                int(counts[k]),
                "count",
                "sum",
                n_tokens,
                lo,
                hi,
            )
        )
    rows.append(
        ReportRow(name, "token", "dlogp", "0", "count/tokens", n_zero, "count", "sum", n_tokens, 0.0, 0.0)
    )
    return rows


def _checks_frame(issues: Sequence[Issue], reader_checks: Sequence[pl.DataFrame | None]) -> pl.DataFrame:
    own = issues_frame(issues)
    frames = [f.select(list(CHECKS_SCHEMA)).cast(CHECKS_SCHEMA) for f in reader_checks if f is not None]
    return pl.concat([*frames, own], how="vertical")


@dataclass(frozen=True)
class Comparison:
    """A finished comparison: the report, the worst sequence's trace and the tokens that token plots read.

    `pair` holds every aligned token when the runs were read in one piece (in-memory batches, one piece of
    steps, `keep_tokens=True`), else None: a comparison read step by step keeps
    `tokens`, every k-th matched token's (pair, lp_a, lp_b) (k = 1 up to 4,000,000 tokens,
    `pooled.SAMPLE_CAP`), which the token plots draw. docs/compare.md says which reads are whole.
    `tokens_file` is the token table written with `tokens_out` (else None).
    """

    report: Report
    pair: AlignedPair | None
    tokens: AlignedPair | pl.DataFrame  # what token plots read
    worst_trace: pl.DataFrame
    tokens_file: Path | None = None

    def trace(self) -> pl.DataFrame:
        """Both streams along the worst sequence (`worst.worst_trace`)."""
        return self.worst_trace


def diagnosed_rows(
    pooled: PooledParity, name: str, label_a: str, label_b: str, stream_a: str
) -> tuple[list[ReportRow], Signatures]:
    """The summary rows of one pair (`parity_rows`) with the signature rows (first-token ratio, τ hint), and
    the signatures' findings."""
    rows, stats = parity_rows(pooled, name)
    signature = pooled.signature
    assert signature is not None
    diagnosis = signature_issues(
        signature,
        name=name,
        name_a=label_a,
        name_b=label_b,
        sampling_side_is_engine=stream_a == "rollout",
        fit=(stats.get("fit_slope"), stats.get("pearson_r")),
    )
    n = pooled.n_tokens
    if diagnosis.first_token_ratio is not None:
        rows.append(
            ReportRow.overall(
                name, "mismatch/first_token_ratio", diagnosis.first_token_ratio, "ratio", "token-mean", n
            )
        )
    if diagnosis.slope is not None:
        rows.append(ReportRow.overall(name, "mismatch/tau_hint", diagnosis.slope, "1", "fit", n))
    return rows, diagnosis


def pair_comparison(
    pooled: PooledParity,
    held: Deferred | None,
    pair: AlignedPair | None,
    rows: list[ReportRow],
    issues: list[Issue],
    reader_checks: list[pl.DataFrame],
    *,
    labels: tuple[str, str],
    streams: tuple[str, str],
    settings: CompareSettings,
    diagnosis: Signatures,
    tau_fit: float | None,
    side_meta: dict[str, Any] | None = None,
    exact: ExactResult | None = None,
) -> Comparison:
    """The `Comparison` of one pooled pair: its summary rows, checks (`issues` after the reader's), meta, worst
    tables and trace. `pair` is the aligned pair of a one-piece read (else None: `held` has the counts);
    `side_meta`: the side-by-side metric sets' meta (`--metrics`), stored as ``side_metrics``."""
    la, lb = labels
    sa, sb = streams
    name = f"{la}:{sa} vs {lb}:{sb}"
    checks = _checks_frame(issues, reader_checks)
    assert pair is not None or held is not None
    n_samples_a = pair.n_samples_a if pair is not None else held.n_a
    n_samples_b = pair.n_samples_b if pair is not None else held.n_b
    meta = {
        "pairs": [name],
        "gate_policy": gate_policy(
            default_family="mismatch",
            fail_on=EXACT_GATES if exact is not None else (),
            default_profile=None if exact is not None else DEFAULT_PROFILE,  # --exact: its own gates
        ),
        "labels": {"a": la, "b": lb},
        "streams": {"a": sa, "b": sb},
        "join": pair.join if pair is not None else held.join,
        "by": list(pooled.by),
        "eps_low": settings.clip.eps_low,
        "eps_high": settings.clip.eps_high,
        "worst_k": settings.worst_k,
        "ignored": sorted(settings.checks.ignore),
        "inputs": {
            "n_samples": {la: n_samples_a, lb: n_samples_b},
            "n_matched_samples": pooled.n_samples,
            "n_tokens": pooled.n_tokens,
            "steps": sorted(pooled.steps),
        },
        "diagnosis": {
            name: {
                "tau_hint": diagnosis.slope,
                "tau_fit": tau_fit,
                "tau_source": "logits (--model)" if tau_fit is not None else "fit_slope (logprob-only hint)",
                "first_token_ratio": diagnosis.first_token_ratio,
            }
        },
        **({"side_metrics": side_meta} if side_meta else {}),
        **({"exact": {name: exact.as_dict()}} if exact is not None else {}),
    }
    worst_tok, worst_seq = pooled.worst()
    report = Report(
        kind="compare",
        summary=summary_frame(rows),
        meta=meta,
        checks=checks,
        worst_tokens=worst_tok,
        worst_seqs=worst_seq,
    )
    trace = pooled.trace
    assert trace is not None
    return Comparison(report, pair, pair if pair is not None else pooled.plot_tokens(name), trace)
