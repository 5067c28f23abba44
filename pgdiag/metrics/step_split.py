"""How the rows of a batch fall into steps: the `step` column, or steps of N documents (`--docs-per-step`).

What: `step_index_of` (the step of every row), `split_steps` (one batch per step, in step order, with its
status), `documents_by_sample_id` (the documents `--docs-per-step` counts), `pooled_batch` (the batch of the
``all`` row, groups keyed by step), `straddling_groups` (groups cut by a step boundary) and `StepCut` (steps a
caller cut over the whole run).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from pgdiag.data.batch import TokenBatch
from pgdiag.metrics.settings import MetricSettings


@dataclass(frozen=True)
class StepCut:
    """Steps a caller cut over the whole run (`--docs-per-step` read in chunks, metrics/docsteps.py).

    The batch handed with it holds whole cut steps: its `step` is the cut step of every row and its `group`
    codes are run-wide (`group_names` of the whole run), so a group straddling a cut is one group again in the
    ``all`` row.
    """

    split_groups: np.ndarray  # (P_split,) run-wide codes of the groups in more than one cut step
    partial_last: bool  # the batch's last step is the run's final step of fewer than N documents


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
        docs = doc_by_sample_id(batch)
        n_docs_last = (int(docs[-1]) + 1) % settings.docs_per_step
    labels = np.unique(step_index)
    for position, step in enumerate(labels):
        rows = np.flatnonzero(step_index == step)
        step_batch = _rows(stepped, rows)
        partial = settings.docs_per_step is not None and position == len(labels) - 1 and n_docs_last != 0
        out.append((str(int(step)), step_batch, "partial" if partial else "ok"))
    return out


def doc_by_sample_id(batch: TokenBatch) -> np.ndarray:
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
    return doc_by_sample_id(batch) // settings.docs_per_step


def _rows(batch: TokenBatch, rows: np.ndarray) -> TokenBatch:
    """The samples `rows` (ascending); a contiguous run becomes views instead of copies."""
    if rows.shape[0] == 0 or rows[-1] - rows[0] + 1 != rows.shape[0]:
        return batch.select(rows)
    return batch.slice(int(rows[0]), int(rows[-1]) + 1)


def pooled_batch(batch: TokenBatch, settings: MetricSettings, step_index: np.ndarray) -> TokenBatch:
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
