"""The two phases of the native engine on one batch: `build_batch_tables` (token phase) and `reduce_rows`.

What: the token phase builds, once per batch, the valid mask m', exp(d) and every other per-token quantity of
each family whose inputs exist, as per-sample sums (`BatchTables`); the mismatch pair is built in a second
thread meanwhile (numpy releases the GIL in its loops). The reduce phase gives the `StepMetrics` of any run of
rows (a step, or all of them) from slices of those tables, touching tokens only for quantiles and extrema. A
step whose loss positions fail the finiteness test gets `status = nonfinite` and the exclusions are counted.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np

from pgdiag.data.batch import TokenBatch
from pgdiag.errors import Code, UsageError
from pgdiag.metrics.advantage import (
    AdvantageTables,
    EntropyTables,
    add_advantage_metrics,
    add_counts,
    add_entropy_metrics,
    add_group_metrics,
    build_advantage_tables,
    build_entropy_tables,
    finite_fraction_notice,
)
from pgdiag.metrics.catalog import MetricSink
from pgdiag.metrics.kept import (
    FullVocabTables,
    KeptKlTables,
    KeptTables,
    add_kept_families,
    kept_families,
)
from pgdiag.metrics.loss import LossSums, ResolvedAggregation, add_loss_metrics
from pgdiag.metrics.mismatch import (
    MismatchTables,
    add_mismatch_counts,
    add_mismatch_metrics,
    build_mismatch_tables,
)
from pgdiag.metrics.policy import (
    PolicyTables,
    RefTables,
    add_policy_counts,
    add_policy_metrics,
    add_ref_metrics,
    build_policy_tables,
    build_ref_tables,
)
from pgdiag.metrics.reduce import TokenReducer, take_rows
from pgdiag.metrics.settings import MetricSettings
from pgdiag.metrics.step_metrics import StepMetrics


@dataclass(frozen=True)
class BatchTables:
    """The token phase of every family over one batch whose steps are contiguous row ranges.

    Each family table holds per-sample sums (S,) plus the token arrays its token statistics need; a step
    is reduced from the slice of its rows (`reduce_rows`), so no token is transformed twice.
    """

    base: TokenReducer  # valid tokens m' of the policy, loss and advantage families
    offsets: np.ndarray  # (S + 1,) loss positions per sample
    group: np.ndarray  # (S,) group codes
    reward: np.ndarray | None  # (S,)
    policy: PolicyTables | None
    loss: LossSums | None
    ref: RefTables | None
    advantage: AdvantageTables | None
    entropy: EntropyTables | None
    mismatch: MismatchTables | None
    notices: tuple[str, ...]
    kept: KeptTables | None = None  # kept mass of a kept-set recompute (`metrics.kept`)
    full_vocab: FullVocabTables | None = None  # stream a against that recompute's full-vocabulary log-probs
    kept_kl: KeptKlTables | None = None  # the engine's kept log-probs against the model over K


def build_batch_tables(batch: TokenBatch, settings: MetricSettings) -> BatchTables:
    """Run the token phase of every family whose inputs exist in `batch`."""
    notices: list[str] = []
    offsets = batch.offsets
    doc_of_sample = batch.documents()  # (S,)
    # 0. the mismatch pair has its own valid set (m ∧ finite(lp_a) ∧ finite(lp_b)): built in a second thread
    # while this one builds the policy side (numpy releases the GIL inside its loops)
    lp_a = _stream(batch, settings.stream_a, "stream-a")
    lp_b = _stream(batch, settings.stream_b, "stream-b")
    with ThreadPoolExecutor(max_workers=1) as pool:
        mismatch_future = None
        if lp_a is not None and lp_b is not None:
            pair_valid = np.isfinite(lp_a) & np.isfinite(lp_b)  # (M,)
            mismatch_future = pool.submit(
                build_mismatch_tables, lp_a, lp_b, pair_valid, offsets, doc_of_sample, settings
            )
            notices.append(
                "mismatch/tau_fit: needs_recompute (side b's logits are only seen by pgdiag logprobs)"
            )
        tables = _build_policy_side(batch, settings, offsets, doc_of_sample, notices)
        mismatch = None if mismatch_future is None else mismatch_future.result()
    kept = kept_families(batch, settings.kept, lp_a, offsets, doc_of_sample, settings.metric_reduction)
    return replace(tables, mismatch=mismatch, notices=tuple(notices), **kept)  # type: ignore[arg-type]


def _build_policy_side(
    batch: TokenBatch,
    settings: MetricSettings,
    offsets: np.ndarray,
    doc_of_sample: np.ndarray,
    notices: list[str],
) -> BatchTables:
    """Token phase of the policy, loss, ref, advantage and entropy families (mismatch left None)."""
    lp_new = _stream(batch, settings.new, "new")
    lp_old = _stream(batch, settings.old, "old")
    advantages = batch.advantages
    # 1. valid tokens m' of the policy, loss and advantage families
    policy_pair = lp_new is not None and lp_old is not None
    valid = np.ones(batch.n_tokens, dtype=bool)  # (M,)
    for values in (lp_new, lp_old, advantages) if policy_pair else (advantages,):
        if values is not None:
            valid &= np.isfinite(values)
    all_valid = bool(valid.all())
    base = TokenReducer.build(valid, offsets, doc_of_sample, settings.metric_reduction)

    def take(values: np.ndarray) -> np.ndarray:
        return values if all_valid else values[valid]

    adv_valid = None if advantages is None else take(advantages)  # (N,)
    advantage = None if adv_valid is None else build_advantage_tables(adv_valid, base)
    # 2. policy pair with the loss sums, and the reference KL
    policy = loss = ref = None
    if policy_pair:
        with np.errstate(invalid="ignore"):
            position_d = None if all_valid else lp_new - lp_old  # (M,)
        policy, loss = build_policy_tables(
            take(lp_new), take(lp_old), advantage, adv_valid, position_d, offsets, settings, base
        )
        if loss is None:
            notices.append("loss/* and binding clip fractions need advantages")
        elif settings.divisor is None:
            notices.append("loss/constant is null: pass --divisor L")
    else:
        notices.append("policy family not computed: needs the new and old streams")
    lp_ref = _stream(batch, settings.ref, "ref")
    if lp_new is not None and lp_ref is not None:
        ref = build_ref_tables(take(lp_new), take(lp_ref), base)
    # 3. entropy
    entropy = None
    if settings.entropy is not None:
        entropy = build_entropy_tables(take(_entropy(batch, settings.entropy)), base)
    return BatchTables(
        base=base,
        offsets=offsets,
        group=np.asarray(batch.group),
        reward=batch.reward,
        policy=policy,
        loss=loss,
        ref=ref,
        advantage=advantage,
        entropy=entropy,
        mismatch=None,
        notices=(),
    )


def reduce_rows(
    tables: BatchTables,
    lo: int,
    hi: int,
    settings: MetricSettings,
    resolved: ResolvedAggregation,
    groups_split: int,
) -> StepMetrics:
    """The `StepMetrics` of samples lo..hi (one step, or the whole batch) from the batch tables."""
    sink = MetricSink(settings.metric_reduction)
    notices = list(tables.notices)
    if settings.key_style != "pgdiag":
        notices.append(
            f"native metrics computed; --key-style {settings.key_style} keys come from the style engine"
        )
    base = tables.base.rows(lo, hi)
    n_positions = int(tables.offsets[hi] - tables.offsets[lo])
    _, group_of_sample = np.unique(tables.group[lo:hi], return_inverse=True)
    group_of_sample = group_of_sample.astype(np.int64).reshape(-1)  # (S,) codes 0..P-1
    n_groups = int(group_of_sample.max()) + 1 if group_of_sample.shape[0] else 0
    if tables.policy is not None:
        policy = take_rows(tables.policy, lo, hi)
        add_policy_counts(policy, n_positions, sink)
        add_policy_metrics(policy, settings, sink)
        if tables.loss is not None:
            add_loss_metrics(
                take_rows(tables.loss, lo, hi), group_of_sample, n_groups, settings, resolved, sink
            )
    if tables.ref is not None:
        add_ref_metrics(take_rows(tables.ref, lo, hi), sink)
    sum_adv = None
    if tables.advantage is not None:
        advantage = take_rows(tables.advantage, lo, hi)
        add_advantage_metrics(advantage, sink)
        sum_adv = advantage.sum_adv
    reward = None if tables.reward is None else tables.reward[lo:hi]
    add_group_metrics(sum_adv, reward, base, group_of_sample, n_groups, settings.zero_std_atol, sink)
    if tables.entropy is not None:
        entropy = take_rows(tables.entropy, lo, hi)
        left_out = base.n_tokens - entropy.reducer.n_tokens
        if left_out:
            notices.append(finite_fraction_notice("entropy/*", left_out, base.n_tokens))
        add_entropy_metrics(entropy, sink)
    mismatch_invalid = 0
    if tables.mismatch is not None:
        mismatch = take_rows(tables.mismatch, lo, hi)
        add_mismatch_counts(mismatch, sink)
        add_mismatch_metrics(mismatch, settings, sink)
        mismatch_invalid = n_positions - mismatch.reducer.n_tokens
    add_kept_families(tables, lo, hi, sink)
    add_counts(n_positions, base, group_of_sample, n_groups, groups_split, sink)
    n_invalid = n_positions - base.n_tokens
    if n_invalid:
        notices.append(finite_fraction_notice("count/tokens_invalid", n_invalid, n_positions))
    if n_positions == 0:
        status = "empty"
    elif n_invalid or mismatch_invalid:
        status = "nonfinite"
    else:
        status = "ok"
    return StepMetrics(tuple(sink.values), status, tuple(notices))


def _stream(batch: TokenBatch, name: str | None, role: str) -> np.ndarray | None:
    """The (M,) log-probs of stream `name`, None when the role is unused."""
    if name is None:
        return None
    return _member(batch, batch.streams, name, f"stream {name!r} (--{role}) is not in the batch", "streams")


def _entropy(batch: TokenBatch, tag: str) -> np.ndarray:
    """The (M,) entropies of recompute tag `tag`."""
    return _member(batch, batch.entropy, tag, f"no entropy for recompute tag {tag!r}", "tags with entropy")


def _member(
    batch: TokenBatch, arrays: Mapping[str, np.ndarray], key: str, missing: str, listed: str
) -> np.ndarray:
    """`arrays[key]` (M,); E111 `UsageError` (`missing`, then the keys there are, as `listed`) when absent."""
    if key not in arrays:
        present = ", ".join(sorted(arrays)) or "none"
        raise UsageError(Code.STREAM_NOT_FOUND, f"{batch.label}: {missing}", f"{listed}: {present}")
    return arrays[key]
