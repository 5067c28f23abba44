"""Kept-mass metrics of a kept-set recompute (docs/metrics.md, "Truncation bias").

What: for a recompute written with kept sets (`pgdiag logprobs --kept-set`, columns ``kept_mass`` and
``logprobs_full``), per step and pooled:

    mismatch/kept_mass_mean     R(Σ_{j∈K} π(j))                 the kept mass under the model
    mismatch/kept_mass_p05      0.05 quantile over tokens
    mismatch/kept_mass_min      min over tokens
    mismatch/truncation_bias    R(−log kept mass)                the log-ratio a renormalised stream carries
    mismatch/full_bias          R(lp_full − lp_a)                Δ against the full-vocabulary log-probs
    mismatch/full_abs_mean      R(|lp_full − lp_a|)
    mismatch/kept_kl            R(KL(engine ‖ model) over K)      with the engine's kept log-probs recorded

The mismatch family itself compares stream a with the recompute's ``logprobs`` (renormalised over K when the
recompute scored over K); the two ``full_*`` keys are the full-vocabulary figures beside it, so a table shows
both. Tokens: the loss positions where the kept mass (and, for ``full_*``, both log-probs) is finite.

How: the family is one more table of the engine's fold (`KeptTables`: per-sample sums (S,) and the token masses
(N,)), built once per batch, reduced per step from row slices and pooled for the ``all`` row like the others.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from pgdiag.data.kept import KEPT_IDS, KEPT_OFFSETS
from pgdiag.data.semantics import footer_semantics, truncation_on
from pgdiag.data.validate import Issue
from pgdiag.errors import Code
from pgdiag.metrics.catalog import MetricSink
from pgdiag.metrics.pooled import QuantileSummary, extremum_of, quantiles_of
from pgdiag.metrics.reduce import SAMPLE_AXIS, TOKEN_AXIS, TokenReducer, take_rows

if TYPE_CHECKING:
    from pgdiag.data.batch import TokenBatch
    from pgdiag.data.runs import Run

KEPT_FAMILIES = ("kept", "full_vocab", "kept_kl")  # the engine's table fields of this module


@dataclass(frozen=True)
class KeptTables:
    """Kept masses (N_K,) of the tokens with a finite mass and their per-sample sums (S,)."""

    reducer: TokenReducer
    mass: np.ndarray | QuantileSummary = field(metadata=TOKEN_AXIS)
    sum_mass: np.ndarray = field(metadata=SAMPLE_AXIS)
    sum_neglog: np.ndarray = field(metadata=SAMPLE_AXIS)


@dataclass(frozen=True)
class FullVocabTables:
    """Per-sample sums (S,) of Δ_full = lp_full − lp_a and |Δ_full| on the tokens where both are finite."""

    reducer: TokenReducer
    sum_delta: np.ndarray = field(metadata=SAMPLE_AXIS)
    sum_abs: np.ndarray = field(metadata=SAMPLE_AXIS)


@dataclass(frozen=True)
class KeptKlTables:
    """Per-sample sums (S,) of the engine-vs-model KL over K on the tokens where it is finite."""

    reducer: TokenReducer
    sum_kl: np.ndarray = field(metadata=SAMPLE_AXIS)


def build_kept_kl_tables(
    kl: np.ndarray, offsets: np.ndarray, doc_of_sample: np.ndarray, reduction: str
) -> KeptKlTables:
    """Token phase of ``mismatch/kept_kl`` on (M,) per-token KLs (NaN where no set or no engine log-probs)."""
    valid = np.isfinite(kl)  # (M,)
    reducer = TokenReducer.build(valid, offsets, doc_of_sample, reduction)
    return KeptKlTables(reducer, reducer.sample_sums(kl[valid]))


def add_kept_kl_metrics(t: KeptKlTables, sink: MetricSink) -> None:
    """``mismatch/kept_kl``: R mean of KL(engine ‖ model) over K."""
    sink.add("mismatch/kept_kl", t.reducer.mean_of_sums(t.sum_kl), t.reducer.population)


def build_kept_tables(
    mass: np.ndarray, offsets: np.ndarray, doc_of_sample: np.ndarray, reduction: str
) -> KeptTables:
    """Token phase of the kept-mass keys on the (M,) loss-position masses (NaN where missing)."""
    valid = np.isfinite(mass) & (mass > 0)  # (M,)
    reducer = TokenReducer.build(valid, offsets, doc_of_sample, reduction)
    kept = np.clip(mass[valid], 0.0, 1.0)  # (N,)
    return KeptTables(reducer, kept, reducer.sample_sums(kept), reducer.sample_sums(-np.log(kept)))


def build_full_vocab_tables(
    full_vocab: np.ndarray, lp_a: np.ndarray, offsets: np.ndarray, doc_of_sample: np.ndarray, reduction: str
) -> FullVocabTables:
    """Token phase of ``mismatch/full_*`` on (M,) full-vocabulary log-probs and stream a."""
    pair = np.isfinite(full_vocab) & np.isfinite(lp_a)  # (M,)
    reducer = TokenReducer.build(pair, offsets, doc_of_sample, reduction)
    delta = full_vocab[pair] - lp_a[pair]  # (N,)
    return FullVocabTables(reducer, reducer.sample_sums(delta), reducer.sample_sums(np.abs(delta)))


def add_kept_metrics(t: KeptTables, sink: MetricSink) -> None:
    """The kept-mass keys: R means, the token 0.05 quantile and the minimum."""
    n_tok = t.reducer.n_tokens
    sink.add("mismatch/kept_mass_mean", t.reducer.mean_of_sums(t.sum_mass), t.reducer.population)
    (p05,) = quantiles_of(t.mass, (0.05,))
    sink.add("mismatch/kept_mass_p05", p05, n_tok)
    sink.add("mismatch/kept_mass_min", extremum_of(t.mass, "min"), n_tok)
    sink.add("mismatch/truncation_bias", t.reducer.mean_of_sums(t.sum_neglog), t.reducer.population)


def add_full_vocab_metrics(t: FullVocabTables, sink: MetricSink) -> None:
    """The full-vocabulary Δ beside the mismatch family."""
    sink.add("mismatch/full_bias", t.reducer.mean_of_sums(t.sum_delta), t.reducer.population)
    sink.add("mismatch/full_abs_mean", t.reducer.mean_of_sums(t.sum_abs), t.reducer.population)


def kept_families(
    batch: TokenBatch,
    tag: str | None,
    lp_a: np.ndarray | None,
    offsets: np.ndarray,
    doc_of_sample: np.ndarray,
    reduction: str,
) -> dict[str, KeptTables | FullVocabTables | KeptKlTables | None]:
    """The token phase of the kept-set recompute `tag`'s families over one batch (None where an input is missing),
    keyed as the engine's table fields (`KEPT_FAMILIES`)."""
    out: dict[str, KeptTables | FullVocabTables | KeptKlTables | None] = dict.fromkeys(KEPT_FAMILIES)
    if tag is None:
        return out
    if tag in batch.kept_kl:
        out["kept_kl"] = build_kept_kl_tables(batch.kept_kl[tag], offsets, doc_of_sample, reduction)
    if tag in batch.kept_mass:
        out["kept"] = build_kept_tables(batch.kept_mass[tag], offsets, doc_of_sample, reduction)
        if lp_a is not None:
            out["full_vocab"] = build_full_vocab_tables(
                batch.full_vocab[tag], lp_a, offsets, doc_of_sample, reduction
            )
    return out


def add_kept_families(tables: object, lo: int, hi: int, sink: MetricSink) -> None:
    """The reduce phase of the families `kept_families` built, on samples lo..hi of the engine's `tables`."""
    kept, full, kl = (getattr(tables, name) for name in KEPT_FAMILIES)
    if kept is not None:
        add_kept_metrics(take_rows(kept, lo, hi), sink)
    if full is not None:
        add_full_vocab_metrics(take_rows(full, lo, hi), sink)
    if kl is not None:
        add_kept_kl_metrics(take_rows(kl, lo, hi), sink)


def truncation_warning(run: Run, kept_tag: str | None, bias: float | None) -> Issue | None:
    """W413 when the run's sampling truncated (top-p / top-k / min-p in ``pgdiag.sampling``) and it records no
    kept set: the kept mass is a hidden bias of the behaviour policy; its size (mean −log kept mass) when a
    kept-set recompute reconstructed K (`kept_tag`, `bias` its ``all`` row's ``mismatch/truncation_bias``)."""
    sampling = (run.meta or {}).get("sampling") or {}
    if not isinstance(sampling, dict) or not truncation_on(sampling):
        return None
    schema = run.lazy.collect_schema()
    if KEPT_IDS in schema and KEPT_OFFSETS in schema:
        return None
    semantics = footer_semantics(run.meta or {}, "rollout")
    shows = (
        "; the rollout stream is renormalised over K, so the gap shows as mismatch"
        if semantics.renormalised
        else "; the rollout stream is full-vocabulary, so it agrees with the trainer and hides it"
    )
    if bias is not None and kept_tag is not None:
        size = f"{bias:.4g} nats a token (mean -log kept mass, K reconstructed by recompute {kept_tag})"
        hint = None
    else:
        size = "of unknown size"
        hint = (
            "pgdiag logprobs RUN --model CKPT reconstructs K and reports it (--kept-set, docs/recompute.md)"
        )
    text = (
        f"{run.label}: sampling truncated by top-p/top-k/min-p but no kept set recorded: the kept mass biases "
        f"the ratios against the behaviour policy by {size}{shows}"
    )
    return Issue(Code.HIDDEN_KEPT_MASS, "warning", 1, text, hint=hint)
