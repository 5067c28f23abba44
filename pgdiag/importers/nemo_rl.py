"""Preset ``nemo-rl``: NeMo-RL's per-step training dump ``<log_dir>/train_data_step<N>.jsonl``.

NeMo-RL's GRPO loop (``nemo_rl/algorithms/grpo.py``) logs the training batch every step, unless
``env.should_log_nemo_gym_responses``, through ``Logger.log_batched_dict_as_jsonl``
(``nemo_rl/utils/logger.py``): one line per sample, produced by a micro-batch iterator of size 1, so **every
value is a length-1 list** (``"rewards": [1.0]``, ``"token_ids": [[...]]``) except the appended ``"idx"``.
Fields used (checked against NVIDIA-NeMo/RL 7ea279ab):

* ``token_ids`` rows right-padded to the batch maximum (rounded up to ``make_sequence_length_divisible_by``):
  ids = ``token_ids[:input_lengths]``; every per-token field is cut the same way;
* loss_mask = ``token_loss_mask`` (1 on generated assistant tokens) x ``sample_loss_mask`` (the sample's
  ``loss_multiplier``); prompt_len = the first true ``token_loss_mask``;
* ``generation_logprobs`` -> rollout (0.0 on prompt and tool tokens), ``prev_logprobs`` -> old (zeros with
  ``force_on_policy_ratio``: W701 drops it), ``advantages`` (broadcast over every position, masked here);
* reward = ``filtered_rewards`` when present (dynamic sampling, where ``rewards`` is the unfiltered total),
  else ``rewards``; no reference stream is logged;
* sample id ``"{N}:{idx}"``, group ``prompt`` (the dump keeps no prompt ids), step N from the file name (the
  1-based step NeMo-RL logs metrics under).

Files are read one at a time with polars' JSON reader and cut with numpy over the flat buffers.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import polars as pl

from pgdiag.data.flat import FlatList, flat_list
from pgdiag.errors import Code, UsageError
from pgdiag.importers import alignment
from pgdiag.importers.base import DegenerateStream, ImportedStep, ImportOptions, Preset, bad_layout
from pgdiag.importers.ids import first_loss_positions

FILE_PATTERN = re.compile(r"train_data_step(\d+)\.jsonl")
_TOKEN_FIELDS = {
    "token_ids": pl.Int64,
    "token_loss_mask": pl.Float64,
    "generation_logprobs": pl.Float64,
    "prev_logprobs": pl.Float64,
    "advantages": pl.Float64,
}
_ROW_FIELDS = {
    "input_lengths": pl.Int64,
    "sample_loss_mask": pl.Float64,
    "rewards": pl.Float64,
    "filtered_rewards": pl.Float64,
}
_REQUIRED = ("token_ids", "token_loss_mask", "generation_logprobs", "input_lengths", "sample_loss_mask")
W701 = DegenerateStream(
    Code.STREAM_ALL_ZEROS,
    "old_logprobs",
    None,
    "prev_logprobs is exactly 0.0 on every loss position (grpo force_on_policy_ratio=true logs zeros)",
)


def step_files(src: Path) -> list[tuple[int, Path]]:
    """(N, path) of every ``train_data_step<N>.jsonl`` under `src` (or `src` itself), in step order."""
    if src.is_file():
        match = FILE_PATTERN.fullmatch(src.name)
        if match is None:
            raise bad_layout(src, "file name", "train_data_step<N>.jsonl")
        return [(int(match.group(1)), src)]
    found = []
    for path in src.rglob("train_data_step*.jsonl"):
        match = FILE_PATTERN.fullmatch(path.name)
        if match is not None and not path.name.startswith("."):
            found.append((int(match.group(1)), path))
    if not found:
        raise UsageError(Code.INPUT_NOT_FOUND, f"{src}: no train_data_step<N>.jsonl file found")
    steps = [n for n, _ in found]
    if len(set(steps)) != len(steps):
        dup = next(n for n in steps if steps.count(n) > 1)
        raise bad_layout(src, "file names", f"one train_data_step{dup}.jsonl, found several")
    return sorted(found)


def check_complete(path: Path) -> None:
    """E703 when `path` does not end in a newline (NeMo-RL writes in place: a cut file has a torn last line)."""
    with open(path, "rb") as handle:
        handle.seek(0, 2)
        size = handle.tell()
        if size == 0:
            raise bad_layout(path, "file", "at least one line (empty file)")
        handle.seek(size - 1)
        if handle.read(1) != b"\n":
            raise bad_layout(path, "last line", "a newline at the end (file cut while written?)")


def _read(path: Path) -> pl.DataFrame:
    check_complete(path)
    schema = {name: pl.List(pl.List(dtype)) for name, dtype in _TOKEN_FIELDS.items()}
    schema.update({name: pl.List(dtype) for name, dtype in _ROW_FIELDS.items()})
    schema["idx"] = pl.Int64
    try:
        frame = pl.read_ndjson(path, schema=schema)
    except pl.exceptions.PolarsError as exc:
        raise bad_layout(path, "line", f"one JSON object per line with NeMo-RL's fields ({exc})") from exc
    for name in _REQUIRED:
        if frame[name].null_count():
            row = int(frame[name].is_null().arg_max() or 0)
            raise bad_layout(path, name, "a value on every line", row=row)
    for name in frame.columns:
        if name == "idx" or not frame[name].null_count() < frame.height:
            continue
        lengths = frame[name].list.len()
        bad = (lengths != 1) & lengths.is_not_null()
        if bad.any():
            row = int(bad.arg_max() or 0)
            raise bad_layout(
                path, name, f"a length-1 list (NeMo-RL micro-batch of 1), got {lengths[row]}", row=row
            )
    return frame


def _cut(padded: FlatList, seq_lens: np.ndarray, path: Path, name: str) -> FlatList:
    """The first `seq_lens[r]` elements of every padded row (the right padding removed by recorded length)."""
    short = np.flatnonzero(padded.lengths < seq_lens)
    if short.size:
        r = int(short[0])
        raise bad_layout(
            path, name, f"at least input_lengths = {seq_lens[r]} values, got {padded.lengths[r]}", row=r
        )
    offsets = alignment.offsets_of(seq_lens)
    take = np.repeat(padded.offsets[:-1], seq_lens) + (
        np.arange(offsets[-1], dtype=np.int64) - np.repeat(offsets[:-1], seq_lens)
    )
    valid = None if padded.valid is None else padded.valid[take]
    return FlatList(offsets, padded.values[take], valid, None)


def read_step(step: int, path: Path) -> ImportedStep:
    """One ``train_data_step<N>.jsonl`` as an `ImportedStep`."""
    frame = _read(path)
    seq_lens = frame["input_lengths"].list.first().to_numpy().astype(np.int64)
    if (seq_lens < 1).any():
        r = int(np.flatnonzero(seq_lens < 1)[0])
        raise bad_layout(path, "input_lengths", "a positive length", row=r)
    flats = {}
    widths = None
    for name in _TOKEN_FIELDS:
        if frame[name].null_count() == frame.height:
            continue
        padded = flat_list(frame[name].list.first())
        if widths is None:
            widths = padded.lengths
        elif (padded.lengths != widths).any():
            r = int(np.flatnonzero(padded.lengths != widths)[0])
            raise bad_layout(
                path, name, f"as many values as token_ids ({widths[r]}), got {padded.lengths[r]}", row=r
            )
        flats[name] = _cut(padded, seq_lens, path, name)
        frame = frame.drop(name)
    token_mask = flats["token_loss_mask"].values != 0
    sample_mask = frame["sample_loss_mask"].list.first().to_numpy() != 0
    loss = token_mask & np.repeat(sample_mask, seq_lens)
    mask_flat = FlatList(flats["token_ids"].offsets, token_mask, None, None)
    prompt_len = first_loss_positions(mask_flat)
    rows = {
        "sample_id": (f"{step}:" + frame["idx"].cast(pl.String)) if frame["idx"].null_count() == 0 else None,
        "input_ids": alignment.to_series("input_ids", flats["token_ids"], pl.List(pl.Int32)),
        "prompt_len": pl.Series("prompt_len", prompt_len, dtype=pl.Int32),
        "loss_mask": alignment.to_series(
            "loss_mask", FlatList(mask_flat.offsets, loss, None, None), pl.List(pl.Boolean)
        ),
        "rollout_logprobs": alignment.to_series(
            "rollout_logprobs", flats["generation_logprobs"], pl.List(pl.Float32)
        ),
    }
    if "prev_logprobs" in flats:
        rows["old_logprobs"] = alignment.to_series(
            "old_logprobs", flats["prev_logprobs"], pl.List(pl.Float32)
        )
    if "advantages" in flats:
        rows["advantages"] = alignment.to_series("advantages", flats["advantages"], pl.List(pl.Float32))
    reward_field = "filtered_rewards" if frame["filtered_rewards"].null_count() < frame.height else "rewards"
    if frame[reward_field].null_count() < frame.height:
        rows["reward"] = frame[reward_field].list.first().cast(pl.Float32)
    if rows["sample_id"] is None:
        rows.pop("sample_id")
    df = pl.DataFrame([series.alias(name) for name, series in rows.items()])
    return ImportedStep(
        step=step,
        rows=df,
        src_files=(str(path),),
        framework="nemo-rl",
        default_group_by="prompt",
        stream_fields={"rollout_logprobs": "generation_logprobs", "old_logprobs": "prev_logprobs"},
        degenerate=(W701,),
    )


def read(src: Path, options: ImportOptions) -> Iterator[ImportedStep]:
    """Every ``train_data_step<N>.jsonl`` under `src`, one step at a time."""
    for step, path in step_files(src):
        yield read_step(step, path)


PRESET = Preset("nemo-rl", "NeMo-RL train_data_step<N>.jsonl", read)
