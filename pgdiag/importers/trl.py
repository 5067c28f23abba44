"""Preset ``trl``: files written by `pgdiag.capture.trl` (TRL `GRPOTrainer`, checked against TRL 1.16.0).

Per row: ids = the last `prompt_lengths` tokens of left-padded `prompt_ids` + the first `completion_lengths`
tokens of right-padded `completion_ids`; loss_mask = `completion_mask` × `tool_mask` on the completion;
`sampling_per_token_logps` → rollout, `old_per_token_logps` → old, `ref_per_token_logps` → ref (response-aligned,
one column per completion token); `advantages` (B,) → `advantage` and, broadcast over loss_mask, `advantages`;
`rewards` → reward (NaN, TRL's mark of an unscorable completion, → null); `rewards_per_func` with
`meta.reward_func_names` → reward_components; `truncated` → finish_reason (``length``, else ``stop``).
Groups: ``contiguous:num_generations`` over the step's rank files in rank order, as TRL's own
``rewards.view(-1, num_generations)``. TRL's own ``completions_<step>.parquet`` holds text only (E702).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import polars as pl

from pgdiag.data.flat import FlatList
from pgdiag.errors import Code, UsageError
from pgdiag.importers import alignment
from pgdiag.importers.base import ImportedStep, ImportOptions, Preset, bad_layout
from pgdiag.importers.hookdump import (
    HookFile,
    hook_imported_step,
    hook_kept_sets,
    hook_sampling,
    int_lengths,
    read_hook_steps,
)

REQUIRED = (
    "prompt_ids",
    "completion_ids",
    "completion_mask",
    "tool_mask",
    "advantages",
    "prompt_lengths",
    "completion_lengths",
    "truncated",
)
STREAMS = {
    "sampling_per_token_logps": "rollout_logprobs",
    "old_per_token_logps": "old_logprobs",
    "ref_per_token_logps": "ref_logprobs",
}


def completions_table(src: Path) -> Path | None:
    """TRL's own completion table (`GRPOTrainer` with ``log_completions``: ``pandas.to_parquet`` of step,
    prompt, completion, rewards and advantage to ``<output_dir>/completions/completions_<step:05d>.parquet``,
    TRL 1.16.0 `grpo_trainer.py`) when `src` is one such file, their folder, or the output_dir holding it with no
    hook file; None otherwise."""
    if src.is_file():
        return src if src.suffix == ".parquet" else None
    if not src.is_dir():
        return None
    if any(src.glob("completions_*.parquet")):
        return src
    folder = src / "completions"
    if any(folder.glob("completions_*.parquet")) and not any(src.glob("step_*.pt")):
        return folder
    return None


def read(src: Path, options: ImportOptions) -> Iterator[ImportedStep]:
    """Yield one `ImportedStep` per hook step, rank files concatenated in rank order."""
    table = completions_table(src)
    if table is not None:
        raise UsageError(
            Code.TEXT_ONLY_SOURCE,
            f"{table}: TRL's completion table holds text (prompt, completion), no token ids or log-probs",
            "record the run with the pgdiag.capture.trl hook and import its dump folder (docs/import.md, 'TRL')",
        )
    for hook_step in read_hook_steps(src, "trl", REQUIRED, allow_unsafe=options.allow_unsafe_pickle):
        files = hook_step.files
        frames = [_rows(file) for file in files]
        meta = files[0].meta
        n_per_prompt = int(meta.get("n_samples_per_prompt", 0))
        if n_per_prompt < 1:
            raise bad_layout(files[0].path, "meta.n_samples_per_prompt", "a positive int (num_generations)")
        sampling = hook_sampling(
            meta, ("temperature", "top_p", "top_k", "min_p", "logprobs_mode", "tempered")
        )
        sampling["engine"] = "vllm" if meta.get("use_vllm") else "transformers"
        yield hook_imported_step(
            hook_step,
            frames,
            STREAMS,
            framework="trl",
            default_group_by=f"contiguous:{n_per_prompt}",
            sampling=sampling,
        )


def _rows(file: HookFile) -> pl.DataFrame:
    """One rank file's rows in canonical columns."""
    t = file.tensors
    prompt_ids, completion_ids = t["prompt_ids"].numpy(), t["completion_ids"].numpy()  # (B, Wp), (B, Wc)
    n_rows, width_c = completion_ids.shape
    if prompt_ids.ndim != 2 or completion_ids.ndim != 2:
        raise bad_layout(file.path, "tensors.prompt_ids", "(B, P) and (B, C) id blocks")
    prompt_lens = int_lengths(file, "prompt_lengths", prompt_ids.shape[1])
    completion_lens = int_lengths(file, "completion_lengths", width_c)
    seq_lens = prompt_lens + completion_lens
    where = {"source": str(file.path)}
    prompt = alignment.from_padded(
        prompt_ids, prompt_lens, start=prompt_ids.shape[1] - prompt_lens, field="prompt_ids", **where
    )
    completion = alignment.from_padded(completion_ids, completion_lens, field="completion_ids", **where)
    input_ids = _join(prompt, completion, seq_lens)

    def response(name: str, dtype: type) -> FlatList:
        block = t[name].numpy()
        if block.shape != (n_rows, width_c):
            raise bad_layout(
                file.path,
                f"tensors.{name}",
                f"shape {(n_rows, width_c)} like completion_ids, got {block.shape}",
            )
        cut = alignment.from_padded(block.astype(dtype), completion_lens, field=name, **where)
        return alignment.response_aligned(cut, prompt_lens, seq_lens, field=name, **where)

    mask_values = t["completion_mask"].numpy().astype(bool) & t["tool_mask"].numpy().astype(bool)
    if mask_values.shape != (n_rows, width_c):
        raise bad_layout(file.path, "tensors.completion_mask", f"shape {(n_rows, width_c)}")
    loss = alignment.response_aligned(
        alignment.from_padded(mask_values, completion_lens), prompt_lens, seq_lens
    )
    loss_mask = FlatList(loss.offsets, loss.values & loss.valid, None, None)
    advantage = t["advantages"].numpy().astype(np.float32)  # (B,)
    if advantage.shape != (n_rows,):
        raise bad_layout(file.path, "tensors.advantages", f"one value per row (shape ({n_rows},))")
    columns: dict[str, pl.Series] = alignment.sequence_columns(input_ids, loss_mask, prompt_lens)
    for name, column in STREAMS.items():
        if name in t:
            stream = alignment.null_off_mask(response(name, np.float32), loss_mask)
            columns[column] = alignment.to_series(column, stream, pl.List(pl.Float32))
    per_token_adv = np.repeat(advantage, seq_lens)
    columns["advantages"] = alignment.to_series(
        "advantages",
        FlatList(loss_mask.offsets, per_token_adv, loss_mask.values.copy(), None),
        pl.List(pl.Float32),
    )
    columns["advantage"] = pl.Series("advantage", advantage, dtype=pl.Float32)
    if "rewards" in t:
        reward = t["rewards"].numpy().astype(np.float32)
        columns["reward"] = pl.Series("reward", reward, dtype=pl.Float32, nan_to_null=True)
    if "rewards_per_func" in t:
        columns["reward_components"] = _components(file)
    truncated = t["truncated"].numpy().astype(bool)
    columns["finish_reason"] = pl.Series("finish_reason", np.where(truncated, "length", "stop"))
    kept = hook_kept_sets(file, prompt_lens, completion_lens)
    if kept is not None:  # the engine's kept sets (docs/schema.md, "Kept sets")
        columns["sampling_kept_ids"] = pl.Series("sampling_kept_ids", kept[0], dtype=pl.List(pl.Int32))
        columns["sampling_kept_offsets"] = pl.Series(
            "sampling_kept_offsets", kept[1], dtype=pl.List(pl.Int32)
        )
        if kept[2] is not None:
            columns["sampling_kept_logprobs"] = pl.Series(
                "sampling_kept_logprobs", kept[2], dtype=pl.List(pl.Float32)
            )
    return pl.DataFrame(list(columns.values()))


def _join(prompt: FlatList, completion: FlatList, seq_lens: np.ndarray) -> FlatList:
    """Rows of prompt tokens followed by completion tokens."""
    zeros = np.zeros(len(seq_lens), dtype=np.int64)
    head = alignment.response_aligned(prompt, zeros, seq_lens)
    tail = alignment.response_aligned(completion, prompt.lengths, seq_lens)
    assert head.valid is not None and tail.valid is not None
    values = np.where(head.valid, head.values, tail.values)
    return FlatList(head.offsets, values, None, None)


def _components(file: HookFile) -> pl.Series:
    """reward_components: {reward function name: value} per row; NaN (function returned None) left out."""
    per_func = file.tensors["rewards_per_func"].numpy().astype(np.float32)  # (B, F)
    names = file.meta.get("reward_func_names")
    if not isinstance(names, list) or len(names) != per_func.shape[1]:
        raise bad_layout(file.path, "meta.reward_func_names", f"{per_func.shape[1]} names")
    rows = [
        [{"key": str(name), "value": float(v)} for name, v in zip(names, row, strict=True) if not np.isnan(v)]
        for row in per_func
    ]
    dtype = pl.List(pl.Struct({"key": pl.String, "value": pl.Float32}))
    return pl.Series("reward_components", rows, dtype=dtype)


PRESET = Preset("trl", "TRL GRPOTrainer hook files step_<S>[.rank<R>].pt", read)
