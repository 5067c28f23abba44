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

Where: `metrics.tables` (the two phases), `metrics.step_split` (which rows are a step), `metrics.step_metrics`
(the result type). How: `compute_native(batch, settings)` → ``[(label, StepMetrics), ..., ("all", StepMetrics)]``. Stream names
in `settings` are already resolved; a None name means the family is not computed (noted in `notices`).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from pgdiag.data.batch import TokenBatch
from pgdiag.metrics.kept import KEPT_FAMILIES
from pgdiag.metrics.loss import resolve_aggregation
from pgdiag.metrics.pooled import QuantileSettings, TablePool
from pgdiag.metrics.reduce import TokenReducer
from pgdiag.metrics.settings import MetricSettings
from pgdiag.metrics.step_metrics import StepMetrics, average_loss_over_steps, mark_partial
from pgdiag.metrics.step_split import (
    StepCut,
    doc_by_sample_id,
    documents_by_sample_id,
    pooled_batch,
    split_steps,
    step_index_of,
    straddling_groups,
)
from pgdiag.metrics.tables import BatchTables, build_batch_tables, reduce_rows

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

REDUCE_THREADS = 2  # steps are reduced in parallel; the CPU target machine has 2 cores


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
            pooled = pooled_batch(batch, settings, step_index)
            if step_index.shape[0] > 1 and np.any(np.diff(step_index) < 0):
                order = np.argsort(step_index, kind="stable")
                pooled, step_index = pooled.select(order), step_index[order]
            split_groups = straddling_groups(pooled.group, step_index)  # (P_split,) group codes
            partial_last = False
            if settings.docs_per_step is not None and batch.n_samples:
                partial_last = (int(doc_by_sample_id(batch)[-1]) + 1) % settings.docs_per_step != 0
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
        return "all", average_loss_over_steps(pooled, [m for _, m in self.steps])


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
