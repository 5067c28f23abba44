"""Preset ``openrlhf``: files written by `pgdiag.capture.openrlhf` (OpenRLHF 0.11 `PPOTrainer`).

OpenRLHF stores **next-token columns**: column c of `action_mask`, `rollout_log_probs`, `action_log_probs`,
`base_action_log_probs` and `advantages` scores token c + 1 of `sequences` (A = T_pad - 1). Per row: T =
`total_length`, ids = `sequences[:T]` (right-padded only); `action_mask` → loss_mask (multi-turn
`action_ranges` give several spans; prompt and environment-feedback tokens have mask 0); `rollout_log_probs` →
rollout, `action_log_probs` → old, `base_action_log_probs` → ref, `advantages`; prompt_len = `prompt_lengths`
(the first action token); `rewards` → reward; `truncated` → finish_reason. Groups: ``c<step>:<index // n>``
from the `index` list (with ``dynamic_batch_enable`` a group's rows are not contiguous).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import polars as pl

from pgdiag.data.flat import FlatList
from pgdiag.importers import alignment
from pgdiag.importers.base import ImportedStep, ImportOptions, Preset, bad_layout
from pgdiag.importers.hookdump import HookFile, hook_imported_step, hook_sampling, read_hook_steps

REQUIRED = ("sequences", "action_mask", "total_length", "prompt_lengths")
STREAMS = {
    "rollout_log_probs": "rollout_logprobs",
    "action_log_probs": "old_logprobs",
    "base_action_log_probs": "ref_logprobs",
}


def read(src: Path, options: ImportOptions) -> Iterator[ImportedStep]:
    """Yield one `ImportedStep` per hook step."""
    for hook_step in read_hook_steps(src, "openrlhf", REQUIRED, allow_unsafe=options.allow_unsafe_pickle):
        frames = [_rows(file, hook_step.step) for file in hook_step.files]
        sampling = hook_sampling(
            hook_step.files[0].meta, ("temperature", "top_p", "top_k", "logprobs_mode", "tempered")
        )
        yield hook_imported_step(
            hook_step, frames, STREAMS, framework="openrlhf", default_group_by="field", sampling=sampling
        )


def _rows(file: HookFile, step: int) -> pl.DataFrame:
    t = file.tensors
    where = {"source": str(file.path)}
    sequences = t["sequences"].numpy()  # (B, T_pad)
    n_rows, width = sequences.shape
    total = t["total_length"].numpy().astype(np.float64)
    seq_lens = total.astype(np.int64)
    bad = np.flatnonzero((seq_lens != total) | (seq_lens < 1) | (seq_lens > width))
    if bad.size:
        r = int(bad[0])
        raise bad_layout(file.path, "tensors.total_length", f"an integer in 1..{width}", row=r)
    input_ids = alignment.from_padded(sequences, seq_lens, field="sequences", **where)

    def columns(name: str) -> FlatList:
        block = t[name].numpy()
        if block.ndim != 2 or block.shape[0] != n_rows or block.shape[1] != width - 1:
            raise bad_layout(
                file.path,
                f"tensors.{name}",
                f"next-token columns of shape {(n_rows, width - 1)} (T_pad - 1), got {tuple(block.shape)}",
            )
        return alignment.next_token(block, seq_lens, field=name, **where)

    mask = columns("action_mask")
    loss_mask = FlatList(mask.offsets, mask.values.astype(bool) & mask.valid, None, None)
    prompt_lens = t["prompt_lengths"].numpy().astype(np.int64)
    prompt_lens = np.where(prompt_lens > 0, prompt_lens, seq_lens)
    out: dict[str, pl.Series] = alignment.sequence_columns(input_ids, loss_mask, prompt_lens)
    for name, column in STREAMS.items():
        if name in t:
            values = columns(name)
            values = FlatList(values.offsets, values.values.astype(np.float32), values.valid, None)
            out[column] = alignment.to_series(
                column, alignment.null_off_mask(values, loss_mask), pl.List(pl.Float32)
            )
    if "advantages" in t:
        adv = columns("advantages")
        adv = FlatList(adv.offsets, adv.values.astype(np.float32), adv.valid, None)
        out["advantages"] = alignment.to_series(
            "advantages", alignment.null_off_mask(adv, loss_mask), pl.List(pl.Float32)
        )
    if "rewards" in t:
        out["reward"] = pl.Series("reward", t["rewards"].numpy().astype(np.float32), nan_to_null=True)
    if "truncated" in t:
        truncated = t["truncated"].numpy().astype(bool)
        out["finish_reason"] = pl.Series("finish_reason", np.where(truncated, "length", "stop"))
    out["group_id"] = _group_ids(file, step, n_rows)
    return pl.DataFrame(list(out.values()))


def _group_ids(file: HookFile, step: int, n_rows: int) -> pl.Series:
    """``c<step>:<index // n_samples_per_prompt>``: `index` is each sample's position in generation order."""
    index = file.lists.get("index")
    per_prompt = file.meta.get("n_samples_per_prompt")
    if not isinstance(per_prompt, int) or per_prompt < 1:
        raise bad_layout(file.path, "meta.n_samples_per_prompt", "a positive int")
    if not isinstance(index, list) or len(index) != n_rows or not all(isinstance(i, int) for i in index):
        raise bad_layout(file.path, "lists.index", f"{n_rows} ints (Experience.index)")
    groups = np.asarray(index, dtype=np.int64) // per_prompt
    return pl.Series("group_id", [f"c{step}:{g}" for g in groups.tolist()], dtype=pl.String)


PRESET = Preset("openrlhf", "OpenRLHF hook files step_<S>.pt", read)
