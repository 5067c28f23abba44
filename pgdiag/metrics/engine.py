"""The native metric engine (`--key-style pgdiag`): one `StepMetrics` per optimizer step plus the `all` row.

What: `compute_native` splits a `TokenBatch` into steps (the `step` column, or `--docs-per-step`),
computes every family whose inputs exist on each step (policy needs new + old; loss needs advantages too;
mismatch needs stream a + b; entropy needs H; ref needs new + ref), and adds a `step = all` row on the pooled
tokens where `loss/*` and `grad/*` are the unweighted mean over steps.

Why this way: a run holds up to 10M tokens in ~20 steps and the `all` row pools them again, so the work is
split in two phases. The token phase (`build_batch_tables`, once per batch) builds the valid mask m'
computes exp(d) and every other per-token quantity once and turns them into per-sample
sums; the mismatch pair is built in a second thread meanwhile (numpy releases the GIL in its loops). The
reduce phase (`reduce_rows`) gives the metrics of any run of rows (a step, or all of them) from slices of
those tables, touching tokens only for quantiles and extrema; steps are reduced on two threads. A step
whose loss positions fail the finiteness test gets `status = nonfinite` and the exclusions are counted,
never hidden.

How: `compute_native(batch, settings)` → ``[(label, StepMetrics), ..., ("all", StepMetrics)]``. Stream names
in `settings` are already resolved; a None name means the family is not computed (noted in `notices`).
"""

from __future__ import annotations

import math
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
    KEPT_FAMILIES,
    FullVocabTables,
    KeptKlTables,
    KeptTables,
    add_kept_families,
    kept_families,
)
from pgdiag.metrics.loss import LossSums, ResolvedAggregation, add_loss_metrics, resolve_aggregation
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
from pgdiag.metrics.pooled import QuantileSettings, TablePool
from pgdiag.metrics.reduce import TokenReducer, take_rows
from pgdiag.metrics.settings import MetricSettings
from pgdiag.metrics.values import MetricValue

__all__ = [
    "NativeStream",
    "StepCut",
    "StepMetrics",
    "compute_native",
    "compute_step_native",
    "documents_by_sample_id",
    "resolve_aggregation",
    "split_steps",
    "straddling_groups",
]

STATUS_ORDER = ("ok", "partial", "nonfinite", "empty")  # a later status wins when two apply
REDUCE_THREADS = 2  # steps are reduced in parallel; the CPU target machine has 2 cores


@dataclass(frozen=True)
class StepMetrics:
    """The native metrics of one step: values, a status and human-readable notices.

    status: ``ok``; ``partial`` (final partial step of `--docs-per-step`); ``nonfinite`` (masked-in tokens
    failed the finiteness test and were excluded); ``empty`` (no loss positions).
    """

    values: tuple[MetricValue, ...]
    status: str
    notices: tuple[str, ...]

    def by_key(self) -> dict[str, MetricValue]:
        """The values indexed by key."""
        return {v.key: v for v in self.values}


@dataclass(frozen=True)
class StepCut:
    """Steps a caller cut over the whole run (`--docs-per-step` read in chunks, metrics/docsteps.py).

    The batch handed with it holds whole cut steps: its `step` is the cut step of every row and its `group`
    codes are run-wide (`group_names` of the whole run), so a group straddling a cut is one group again in the
    ``all`` row.
    """

    split_groups: np.ndarray  # (P_split,) run-wide codes of the groups in more than one cut step
    partial_last: bool  # the batch's last step is the run's final step of fewer than N documents


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


class NativeStream:
    """The native engine over a run read in chunks of whole consecutive steps (docs/metrics.md).

    `add(batch)` builds the tables of one chunk, reduces each of its steps exactly as a whole-run read does
    (per-step rows are bit-identical) and keeps for the ``all`` row only the per-sample tables (S,) and token
    summaries (`metrics.pooled`); `finish()` gives the ``all`` row from those. Chunks must come in step order
    and never split a step. With `--docs-per-step` a chunk is either the whole run (``cut`` None: the steps are
    cut here) or whole steps cut over the run by the caller (`add(batch, cut)`, `metrics.docsteps`).
    """

    def __init__(
        self, settings: MetricSettings, quantiles: QuantileSettings | None = None, *, pooled: bool = True
    ) -> None:
        self.settings = settings
        self.pooled = pooled  # False: keep nothing for the ``all`` row (`finish` is not called)
        self.quantiles = quantiles or QuantileSettings()
        self.resolved = resolve_aggregation(settings.aggregation, settings)
        self.steps: list[tuple[str, StepMetrics]] = []
        self._families: dict[str, TablePool] = {}
        self._base: list[TokenReducer] = []
        self._n_positions: list[np.ndarray] = []  # (S_c,) loss positions per sample, per chunk
        self._groups: list[np.ndarray] = []  # (S_c,) run-wide pooled group codes, per chunk
        self._rewards: list[np.ndarray | None] = []
        self._notices: list[str] = []
        self._n_groups = 0
        self._groups_split = 0

    def add(self, batch: TokenBatch, cut: StepCut | None = None) -> list[tuple[str, StepMetrics]]:
        """The per-step rows of one chunk (step order), pooling its tables for the ``all`` row; `cut` when the
        caller cut the batch's steps over the whole run (`StepCut`)."""
        settings = self.settings
        if cut is not None:
            step_index = np.asarray(batch.step, dtype=np.int64)  # (S,) cut steps, ascending
            pooled, split_groups, partial_last = batch, cut.split_groups, cut.partial_last
        else:
            step_index = step_index_of(batch, settings)  # (S,)
            pooled = _pooled_batch(batch, settings, step_index)
            if step_index.shape[0] > 1 and np.any(np.diff(step_index) < 0):
                order = np.argsort(step_index, kind="stable")
                pooled, step_index = pooled.select(order), step_index[order]
            split_groups = straddling_groups(pooled.group, step_index)  # (P_split,) group codes
            partial_last = False
            if settings.docs_per_step is not None and batch.n_samples:
                partial_last = (int(_doc_by_sample_id(batch)[-1]) + 1) % settings.docs_per_step != 0
        tables = build_batch_tables(pooled, settings)
        bounds = np.flatnonzero(np.diff(step_index)) + 1
        starts = (
            np.concatenate([[0], bounds]).astype(np.int64) if step_index.shape[0] else np.zeros(0, np.int64)
        )
        ends = np.concatenate([bounds, [step_index.shape[0]]]).astype(np.int64) if starts.shape[0] else starts
        ranges = [(int(lo), int(hi)) for lo, hi in zip(starts, ends, strict=True)]
        splits = [
            int(np.count_nonzero(np.isin(np.unique(pooled.group[lo:hi]), split_groups))) for lo, hi in ranges
        ]
        with ThreadPoolExecutor(max_workers=REDUCE_THREADS) as pool:
            reduced = list(
                pool.map(
                    lambda i: reduce_rows(tables, *ranges[i], settings, self.resolved, splits[i]),
                    range(len(ranges)),
                )
            )
        rows: list[tuple[str, StepMetrics]] = []
        for position, ((lo, _), metrics) in enumerate(zip(ranges, reduced, strict=True)):
            label = str(int(step_index[lo]))
            if partial_last and position == len(ranges) - 1:
                metrics = mark_partial(metrics, label)
            rows.append((label, metrics))
        if self.pooled:
            self._pool(tables, pooled.group, run_wide=cut is not None)
        if cut is None:
            self._groups_split += int(split_groups.shape[0])
        else:  # the run-wide count, the same in every chunk
            self._groups_split = int(split_groups.shape[0])
        self.steps.extend(rows)
        return rows

    def _pool(self, tables: BatchTables, group: np.ndarray, *, run_wide: bool) -> None:
        """Keep the per-sample tables and token summaries of one chunk for the ``all`` row; `group` holds the
        chunk's own codes (numbered after the earlier chunks') or, `run_wide`, codes of the whole run."""
        self._base.append(tables.base)
        self._n_positions.append(np.diff(tables.offsets))
        codes = np.asarray(group, dtype=np.int64)  # (S_c,) 0..P_c−1, ordered by (step, group id)
        n_codes = int(codes.max()) + 1 if codes.shape[0] else 0
        if run_wide:
            self._groups.append(codes)
            self._n_groups = max(self._n_groups, n_codes)
        else:
            self._groups.append(codes + self._n_groups)
            self._n_groups += n_codes
        self._rewards.append(tables.reward)
        self._notices.extend(n for n in tables.notices if n not in self._notices)
        for name in _FAMILIES:
            table = getattr(tables, name)
            if table is not None:
                self._families.setdefault(name, TablePool(self.quantiles)).add(table)

    @property
    def quantiles_exact(self) -> bool:
        """True when every token quantile of the ``all`` row is exact (`QuantileSettings.exact_limit`)."""
        return all(pool.exact for pool in self._families.values())

    def finish(self) -> tuple[str, StepMetrics]:
        """The ``all`` row: pooled samples' metrics, loss/grad keys the unweighted mean over the steps."""
        if not self._base:
            raise ValueError(
                "NativeStream.finish needs a pooled stream and at least one chunk (an empty batch is one)"
            )
        n_positions = np.concatenate(self._n_positions)
        offsets = np.zeros(n_positions.shape[0] + 1, dtype=np.int64)  # (S + 1,)
        np.cumsum(n_positions, out=offsets[1:])
        rewards = None if any(r is None for r in self._rewards) else np.concatenate(self._rewards)
        families = {name: pool.pooled() for name, pool in self._families.items()}
        tables = BatchTables(
            base=TokenReducer.concat(self._base),
            offsets=offsets,
            group=np.concatenate(self._groups),
            reward=rewards,
            policy=families.get("policy"),
            loss=families.get("loss"),
            ref=families.get("ref"),
            advantage=families.get("advantage"),
            entropy=families.get("entropy"),
            mismatch=families.get("mismatch"),
            notices=tuple(self._notices),
            **{name: families.get(name) for name in KEPT_FAMILIES},  # type: ignore[arg-type]
        )
        n_samples = int(n_positions.shape[0])
        pooled = reduce_rows(tables, 0, n_samples, self.settings, self.resolved, self._groups_split)
        return "all", _average_loss_over_steps(pooled, [m for _, m in self.steps])


_FAMILIES = ("policy", "loss", "ref", "advantage", "entropy", "mismatch", *KEPT_FAMILIES)


def compute_native(
    batch: TokenBatch, settings: MetricSettings, quantiles: QuantileSettings | None = None
) -> list[tuple[str, StepMetrics]]:
    """Per-step rows in step order plus the ``all`` row (pooled tokens; loss/grad keys averaged over steps)
    of a batch already in memory: one chunk of `NativeStream`. Its token quantiles are exact up to
    `quantiles.exact_limit` (default: at least the batch's tokens, so always exact)."""
    if quantiles is None:
        limit = max(QuantileSettings().exact_limit, batch.n_tokens)
        quantiles = QuantileSettings(exact_limit=limit)
    stream = NativeStream(settings, quantiles)
    stream.add(batch)
    return [*stream.steps, stream.finish()]


def compute_step_native(batch: TokenBatch, settings: MetricSettings, *, groups_split: int = 0) -> StepMetrics:
    """Every native metric of one step (docs/metrics.md) whose inputs exist in `batch`.

    `groups_split` is `count/groups_split` (groups straddling a step boundary), known only to the caller
    that cut the steps; `compute_native` passes it.
    """
    resolved = resolve_aggregation(settings.aggregation, settings)
    tables = build_batch_tables(batch, settings)
    return reduce_rows(tables, 0, batch.n_samples, settings, resolved, groups_split)


def split_steps(batch: TokenBatch, settings: MetricSettings) -> list[tuple[str, TokenBatch, str]]:
    """(step label, step batch, status) in step order.

    Without `--docs-per-step` the steps are the sorted values of the `step` column. With it, rows are cut in
    their order into consecutive steps of N documents (consecutive rows sharing a sample_id form one
    document; the `step` column is ignored and replaced by the step index); a final step with fewer than N
    documents has status ``partial``.
    """
    if batch.n_samples == 0:
        return []
    step_index = step_index_of(batch, settings)
    stepped = batch if settings.docs_per_step is None else batch.with_steps(step_index)
    out: list[tuple[str, TokenBatch, str]] = []
    n_docs_last = 0
    if settings.docs_per_step is not None:
        docs = _doc_by_sample_id(batch)
        n_docs_last = (int(docs[-1]) + 1) % settings.docs_per_step
    labels = np.unique(step_index)
    for position, step in enumerate(labels):
        rows = np.flatnonzero(step_index == step)
        step_batch = _rows(stepped, rows)
        partial = settings.docs_per_step is not None and position == len(labels) - 1 and n_docs_last != 0
        out.append((str(int(step)), step_batch, "partial" if partial else "ok"))
    return out


def _stream(batch: TokenBatch, name: str | None, role: str) -> np.ndarray | None:
    """The (M,) log-probs of stream `name`, None when the role is unused."""
    if name is None:
        return None
    if name not in batch.streams:
        present = ", ".join(sorted(batch.streams)) or "none"
        raise UsageError(
            Code.STREAM_NOT_FOUND,
            f"{batch.label}: stream {name!r} (--{role}) is not in the batch",
            f"streams: {present}",
        )
    return batch.streams[name]


def _entropy(batch: TokenBatch, tag: str) -> np.ndarray:
    """The (M,) entropies of recompute tag `tag`."""
    if tag not in batch.entropy:
        present = ", ".join(sorted(batch.entropy)) or "none"
        raise UsageError(
            Code.STREAM_NOT_FOUND,
            f"{batch.label}: no entropy for recompute tag {tag!r}",
            f"tags with entropy: {present}",
        )
    return batch.entropy[tag]


def _doc_by_sample_id(batch: TokenBatch) -> np.ndarray:
    """(S,) document index by consecutive equal sample_id, ignoring the step column."""
    return documents_by_sample_id(batch.sample_id)


def documents_by_sample_id(sample_id: np.ndarray) -> np.ndarray:
    """(S,) document index of rows in read order: consecutive rows with equal `sample_id` (S,) are one document
    (what `--docs-per-step` counts; the step column is ignored)."""
    if sample_id.shape[0] == 0:
        return np.zeros(0, dtype=np.int64)
    same = sample_id[1:] == sample_id[:-1]
    return np.concatenate([[0], np.cumsum(~same)]).astype(np.int64)


def step_index_of(batch: TokenBatch, settings: MetricSettings) -> np.ndarray:
    """(S,) step of every row: the `step` column, or document index // --docs-per-step."""
    if settings.docs_per_step is None:
        return np.asarray(batch.step, dtype=np.int64)
    return _doc_by_sample_id(batch) // settings.docs_per_step


def _rows(batch: TokenBatch, rows: np.ndarray) -> TokenBatch:
    """The samples `rows` (ascending); a contiguous run becomes views instead of copies."""
    if rows.shape[0] == 0 or rows[-1] - rows[0] + 1 != rows.shape[0]:
        return batch.select(rows)
    return batch.slice(int(rows[0]), int(rows[-1]) + 1)


def _pooled_batch(batch: TokenBatch, settings: MetricSettings, step_index: np.ndarray) -> TokenBatch:
    """The batch of the ``all`` row.

    With the step column, groups are prompts within a step, so the pooled row keys them by (step, group).
    With `--docs-per-step` the step column is ignored: groups keep their ids (a straddling group is whole
    again) and the steps are the cut indices.
    """
    if settings.docs_per_step is not None:
        return batch.with_steps(step_index)
    if batch.n_samples == 0:
        return batch
    _, step_code = np.unique(step_index, return_inverse=True)
    key = step_code.astype(np.int64) * (int(batch.group.max()) + 1) + batch.group.astype(np.int64)
    _, first, pooled_group = np.unique(key, return_index=True, return_inverse=True)
    names = batch.group_names[batch.group[first]] if batch.group_names.shape[0] else batch.group_names
    return replace(batch, group=pooled_group.astype(np.int64).reshape(-1), group_names=names)


def straddling_groups(group: np.ndarray, step_index: np.ndarray) -> np.ndarray:
    """Group codes whose samples fall in more than one step."""
    if group.shape[0] == 0:
        return np.zeros(0, dtype=np.int64)
    pairs = np.unique(np.stack([group.astype(np.int64), step_index.astype(np.int64)]), axis=1)
    codes, steps_per_group = np.unique(pairs[0], return_counts=True)
    return codes[steps_per_group > 1]


def _average_loss_over_steps(pooled: StepMetrics, steps: list[StepMetrics]) -> StepMetrics:
    """Replace the ``mode``-reduced values of the pooled row (`loss/*`, `grad/*`, a style's loss keys) by their
    unweighted mean over the steps with a value."""
    per_step = [s.by_key() for s in steps]
    values = []
    for value in pooled.values:
        if value.reduction == "mode" or value.key.startswith(("loss/", "grad/")):
            found = [row[value.key].value for row in per_step if value.key in row]
            numbers = [v for v in found if v is not None]
            if not numbers:
                mean = None
            elif all(math.isfinite(v) for v in numbers):
                mean = math.fsum(numbers) / len(numbers)
            else:
                mean = sum(numbers) / len(numbers)  # ±inf propagates; inf − inf is NaN, stored as null
            value = MetricValue(value.key, mean, value.unit, value.reduction, len(numbers))
        values.append(value)
    return replace(pooled, values=tuple(values))


def mark_partial(metrics: StepMetrics, label: str) -> StepMetrics:
    """`metrics` of the final step of `--docs-per-step` when it holds fewer than N documents."""
    return replace(
        metrics,
        status=_worse(metrics.status, "partial"),
        notices=(*metrics.notices, f"step {label}: final partial step of --docs-per-step"),
    )


def _worse(a: str, b: str) -> str:
    """The more severe of two statuses."""
    return a if STATUS_ORDER.index(a) >= STATUS_ORDER.index(b) else b
