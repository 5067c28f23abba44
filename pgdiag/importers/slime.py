"""slime preset: ``--dump-details D`` writes ``D/rollout_data/<id>.pt`` and ``D/train_data/<id>.pt``.

The rollout dump is ``torch.save({"rollout_id", "samples": [Sample.to_dict()]})``: per sample ``tokens`` (prompt
and response), ``response_length``, ``loss_mask`` (None = all ones; ``remove_sample`` zeroes it, which the
dump does not apply), ``rollout_log_probs`` (response-aligned, 0.0 on tool tokens), ``reward`` (a number, or a
dict of components), ``status``, ``weight_versions``, ``group_index`` and ``index``.

The train dump (``format_version`` 2: one file per rollout, every DP shard gathered, context parallelism
re-assembled) holds one dict per trained sample with ``log_probs`` (old), ``ref_log_probs`` and
``advantages``, response-aligned, plus ``rollout_position`` (the sample's position in the rollout dump) and
``sample_index`` (``Sample.index``). Its ``rewards`` are group-normalised and never taken as the reward; the
whole-batch ``raw_reward`` gives the reward of dict-valued rewards. When the dump shows more than one
optimizer step per rollout, ``log_probs`` may come from the training forward after an update (slime snapshots
them there when it skipped the recompute): W703, ``old`` kept. The `miles` preset reuses the rollout reading.

Top-p kept sets (slime 624b824a ``Sample.rollout_top_p_token_ids`` / ``rollout_top_p_token_offsets``, set from
SGLang's ``top_p_token_ids`` / ``top_p_token_offsets`` meta info when ``--rollout-top-p`` < 1): CSR over the
response tokens (response token i keeps ``ids[offsets[i]:offsets[i + 1]]``; tool tokens get empty spans), so
the offsets are response_length + 1 values. They become ``sampling_kept_ids`` and ``sampling_kept_offsets``
(docs/schema.md), the prompt positions given empty sets; broken sets are refused by the writer (E220-E223).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from pgdiag.data.flat import FlatList
from pgdiag.errors import Code
from pgdiag.importers.alignment import from_rows, offsets_of, response_aligned, to_series
from pgdiag.importers.base import ImportedStep, ImportOptions, ImportWarning, Preset, bad_layout
from pgdiag.importers.pt_reader import load_pt_lists
from pgdiag.importers.safe_load import numpy_allow_list
from pgdiag.importers.step_rows import field_or_prompt

FINISH_REASONS = {"completed": "stop", "truncated": "length", "aborted": "abort", "failed": "error"}
_ROLLOUT_NAME = re.compile(r"^(\d+)\.pt$")


@dataclass(frozen=True)
class RolloutSamples:
    """The samples of one rollout dump as flat columns; response-aligned lists still response-aligned."""

    path: Path
    rollout_id: int
    input_ids: FlatList  # (R rows) int64 tokens
    response_lens: np.ndarray  # (R,) int64
    loss_mask: FlatList  # response-aligned bool, `remove_sample` applied
    rollout: FlatList | None  # response-aligned float32 rollout_log_probs
    frame: pl.DataFrame  # sample_id, group_id, reward, finish_reason, policy_version (+ reward_components)
    dict_rewards: bool  # some reward was a dict of components

    @property
    def seq_lens(self) -> np.ndarray:
        return self.input_ids.lengths

    @property
    def prompt_lens(self) -> np.ndarray:
        return self.seq_lens - self.response_lens


def _as_int_array(value: Any, path: Path, field: str, row: int) -> np.ndarray:
    try:
        array = np.asarray(value.numpy() if hasattr(value, "numpy") else value)
    except (TypeError, ValueError) as exc:
        raise bad_layout(path, field, "a list of token ids", row=row) from exc
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iub"):
        raise bad_layout(
            path, field, f"a 1-D list of ints, got {array.dtype} of shape {array.shape}", row=row
        )
    return array.astype(np.int64, copy=False)


def float_row(value: Any, length: int, path: Path, field: str, row: int) -> np.ndarray:
    """One response-aligned float row of exactly `length` values (a list, array or tensor); E703 otherwise."""
    if hasattr(value, "float") and hasattr(value, "numpy"):  # a torch tensor, possibly bf16
        array = value.detach().float().numpy()
    else:
        try:
            array = np.asarray(value, dtype=np.float32)
        except (TypeError, ValueError) as exc:
            raise bad_layout(path, field, "a list of floats", row=row) from exc
    if array.ndim != 1 or array.shape[0] != length:
        raise bad_layout(
            path, field, f"{length} values (response_length), got shape {tuple(array.shape)}", row=row
        )
    return array.astype(np.float32, copy=False)


def float_rows(rows: Sequence[Any], lengths: np.ndarray, path: Path, field: str) -> FlatList:
    """Response-aligned float rows as one float32 flat list; row r must hold ``lengths[r]`` values (E703).

    Rows that are all plain lists (slime keeps every log-prob as a Python float) are converted in one pass,
    ``np.fromiter`` over the chained lists: the same float64 -> float32 rounding as ``np.asarray`` row by row,
    without a temporary array per row. Anything else, or an element that is not a number, goes row by row
    through `float_row`, which names the row.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if all(type(row) is list for row in rows):
        stored = np.fromiter(map(len, rows), np.int64, len(rows))
        if np.array_equal(stored, lengths):
            try:
                values = np.fromiter(itertools.chain.from_iterable(rows), np.float32, int(lengths.sum()))
            except (TypeError, ValueError):
                pass  # the row-by-row pass below names the row
            else:
                return FlatList(offsets_of(lengths), values, None, None)
    arrays = [
        float_row(row, int(n), path, field, r) for r, (row, n) in enumerate(zip(rows, lengths, strict=True))
    ]
    return from_rows(arrays)


def _mask_rows(rows: Sequence[np.ndarray | None], lengths: np.ndarray) -> FlatList:
    """The response-aligned loss mask from per-row bool arrays, None meaning all ones."""
    offsets = offsets_of(lengths)
    values = np.ones(int(offsets[-1]), dtype=bool)
    for r, row in enumerate(rows):
        if row is not None:
            values[offsets[r] : offsets[r + 1]] = row
    return FlatList(offsets, values, None, None)


def _policy_version(versions: Any) -> int | None:
    if not versions:
        return None
    first = str(versions[0])
    return int(first) if first.isdigit() else None


def _reward(value: Any, path: Path, row: int) -> tuple[float | None, dict[str, float] | None]:
    if value is None:
        return None, None
    if isinstance(value, bool | int | float):
        return float(value), None
    if isinstance(value, Mapping):
        components = {str(k): float(v) for k, v in value.items() if isinstance(v, bool | int | float)}
        return None, components
    raise bad_layout(path, "reward", f"a number, a dict or None, got {type(value).__name__}", row=row)


def _routes_row(value: Any, n_tokens: int, path: Path, row: int) -> np.ndarray:
    """``rollout_routed_experts`` ((T - 1, L, k): the engine records no route for the last token) as the flat
    int16 ``routed_experts`` row of docs/schema.md, the last token's k x L entries -1."""
    try:
        routes = np.asarray(value.numpy() if hasattr(value, "numpy") else value)
    except (TypeError, ValueError) as exc:
        raise bad_layout(
            path, "rollout_routed_experts", "a (tokens - 1, layers, top_k) array", row=row
        ) from exc
    if routes.ndim != 3 or routes.dtype.kind not in "iu" or routes.shape[0] not in (n_tokens - 1, n_tokens):
        raise bad_layout(
            path,
            "rollout_routed_experts",
            f"integer ids of shape ({n_tokens - 1}, layers, top_k), got {routes.dtype} {routes.shape}",
            row=row,
        )
    if routes.size and (routes.min() < -1 or routes.max() > np.iinfo(np.int16).max):
        raise bad_layout(path, "rollout_routed_experts", "expert ids in [-1, 32767]", row=row)
    full = np.full((n_tokens, *routes.shape[1:]), -1, dtype=np.int16)  # (T, L, k)
    full[: routes.shape[0]] = routes
    return full.reshape(-1)


def read_rollout_samples(path: Path, payload: Any, rollout_id: int) -> RolloutSamples:
    """Parse one rollout dump's ``samples`` (slime and miles write the same `Sample.to_dict` records)."""
    samples = payload.get("samples") if isinstance(payload, Mapping) else None
    if not isinstance(samples, list) or not samples:
        raise bad_layout(path, "samples", "a non-empty list of Sample.to_dict() records")
    ids_rows: list[np.ndarray] = []
    mask_rows: list[np.ndarray | None] = []  # None: all ones
    rollout_rows: list[Any] = []  # as stored; converted in one pass by `float_rows`
    response_lens = np.zeros(len(samples), dtype=np.int64)
    sample_ids: list[str | None] = []
    group_ids: list[str | None] = []
    rewards: list[float | None] = []
    components: list[dict[str, float] | None] = []
    finish: list[str | None] = []
    versions: list[int | None] = []
    routes: list[np.ndarray | None] = []
    kept_ids: list[list[int] | None] = []
    kept_offsets: list[list[int] | None] = []
    with_rollout = [isinstance(s, Mapping) and s.get("rollout_log_probs") is not None for s in samples]
    if any(with_rollout) and not all(with_rollout):
        row = with_rollout.index(not with_rollout[0])
        raise bad_layout(path, "rollout_log_probs", "present on every sample or on none", row=row)
    for row, sample in enumerate(samples):
        if not isinstance(sample, Mapping) or "tokens" not in sample or "response_length" not in sample:
            raise bad_layout(path, "samples", "records with tokens and response_length", row=row)
        tokens = _as_int_array(sample["tokens"], path, "tokens", row)
        n_resp = int(sample["response_length"])
        if not 0 <= n_resp < tokens.shape[0]:
            raise bad_layout(
                path,
                "response_length",
                f"0 <= response_length < len(tokens) {tokens.shape[0]}, got {n_resp}",
                row=row,
            )
        response_lens[row] = n_resp
        ids_rows.append(tokens)
        raw_mask = sample.get("loss_mask")
        mask = None  # None means all ones; an all-ones list needs no conversion
        if raw_mask is not None and not (
            isinstance(raw_mask, list) and len(raw_mask) == n_resp and raw_mask.count(1) == n_resp
        ):
            mask = float_row(raw_mask, n_resp, path, "loss_mask", row) != 0
        if sample.get("remove_sample"):
            mask = np.zeros(n_resp, dtype=bool)
        mask_rows.append(mask)
        if with_rollout[0]:
            rollout_rows.append(sample["rollout_log_probs"])
        index, group = sample.get("index"), sample.get("group_index")
        sample_ids.append(None if index is None else str(index))
        group_ids.append(None if group is None else str(group))
        reward, parts = _reward(sample.get("reward"), path, row)
        rewards.append(reward)
        components.append(parts)
        status = sample.get("status")
        finish.append(FINISH_REASONS.get(getattr(status, "value", status)))
        versions.append(_policy_version(sample.get("weight_versions")))
        raw_routes = sample.get("rollout_routed_experts")
        routes.append(None if raw_routes is None else _routes_row(raw_routes, tokens.shape[0], path, row))
        ids, offsets = _kept_row(sample, tokens.shape[0] - n_resp, path, row)
        kept_ids.append(ids)
        kept_offsets.append(offsets)
    frame = pl.DataFrame(
        {
            "sample_id": pl.Series(sample_ids, dtype=pl.String),
            "group_id": pl.Series(group_ids, dtype=pl.String),
            "reward": pl.Series(rewards, dtype=pl.Float32),
            "finish_reason": pl.Series(finish, dtype=pl.String),
            "policy_version": pl.Series(versions, dtype=pl.Int64),
        }
    )
    if any(r is not None for r in routes):  # MoE routing replay (docs/schema.md)
        frame = frame.with_columns(
            pl.Series(
                "routed_experts", [None if r is None else r.tolist() for r in routes], dtype=pl.List(pl.Int16)
            )
        )
    if any(o is not None for o in kept_offsets):  # top-p kept sets (docs/schema.md, "Kept sets")
        frame = frame.with_columns(
            pl.Series("sampling_kept_ids", kept_ids, dtype=pl.List(pl.Int64)),
            pl.Series("sampling_kept_offsets", kept_offsets, dtype=pl.List(pl.Int64)),
        )
    dict_rewards = any(c is not None for c in components)
    if dict_rewards:
        frame = frame.with_columns(reward_components_series(components))
    if frame["sample_id"].null_count():
        frame = frame.drop("sample_id")
    if frame["group_id"].null_count():
        frame = frame.drop("group_id")
    return RolloutSamples(
        path=path,
        rollout_id=rollout_id,
        input_ids=from_rows(ids_rows, np.int64),
        response_lens=response_lens,
        loss_mask=_mask_rows(mask_rows, response_lens),
        rollout=float_rows(rollout_rows, response_lens, path, "rollout_log_probs")
        if with_rollout[0]
        else None,
        frame=frame,
        dict_rewards=dict_rewards,
    )


def _kept_row(
    sample: Mapping[str, Any], prompt_len: int, path: Path, row: int
) -> tuple[list[int] | None, list[int] | None]:
    """(ids, offsets over all T tokens) of a sample's ``rollout_top_p_token_ids`` / ``_offsets`` (CSR over its
    response tokens): the prompt positions get empty sets. (None, None) when the sample records none; E703 when
    only one of the two is there. Wrong lengths and orders are left to the writer's E220-E223."""
    raw_ids, raw_offsets = sample.get("rollout_top_p_token_ids"), sample.get("rollout_top_p_token_offsets")
    if raw_ids is None and raw_offsets is None:
        return None, None
    if raw_ids is None or raw_offsets is None:
        raise bad_layout(
            path, "rollout_top_p_token_ids", "both rollout_top_p_token_ids and _offsets, or neither", row=row
        )
    ids = _as_int_array(raw_ids, path, "rollout_top_p_token_ids", row).reshape(-1)
    offsets = _as_int_array(raw_offsets, path, "rollout_top_p_token_offsets", row).reshape(-1)
    return ids.tolist(), [0] * prompt_len + offsets.tolist()


def reward_components_series(components: Sequence[Mapping[str, float] | None]) -> pl.Series:
    """A ``map<string, float32>`` column as polars holds it: a list of {key, value} structs per row."""
    dtype = pl.List(pl.Struct({"key": pl.String, "value": pl.Float32}))
    rows = [None if c is None else [{"key": k, "value": v} for k, v in c.items()] for c in components]
    return pl.Series("reward_components", rows, dtype=dtype)


def place(samples: RolloutSamples, response: FlatList, field: str) -> FlatList:
    """Response-aligned rows of `samples` placed at the prompt length, full length."""
    return response_aligned(
        response, samples.prompt_lens, samples.seq_lens, source=str(samples.path), field=field
    )


def base_rows(samples: RolloutSamples, streams: Mapping[str, FlatList]) -> pl.DataFrame:
    """The canonical rows of one rollout: ids, loss mask, prompt length, `streams` (response-aligned) placed."""
    mask = place(samples, samples.loss_mask, "loss_mask")
    full_mask = FlatList(mask.offsets, mask.values & mask.valid, None, None)
    columns = [
        to_series("input_ids", samples.input_ids, pl.List(pl.Int32)),
        to_series("loss_mask", full_mask, pl.List(pl.Boolean)),
        pl.Series("prompt_len", samples.prompt_lens, dtype=pl.Int32),
    ]
    if samples.rollout is not None:
        columns.append(
            to_series(
                "rollout_logprobs", place(samples, samples.rollout, "rollout_log_probs"), pl.List(pl.Float32)
            )
        )
    for name, flat in streams.items():
        columns.append(to_series(name, place(samples, flat, name), pl.List(pl.Float32)))
    return pl.DataFrame(columns).hstack(samples.frame)


def rollout_files(src: Path) -> tuple[Path, list[tuple[int, Path]]]:
    """(the dump directory D, [(id, D/rollout_data/<id>.pt)] sorted by id); evaluation dumps skipped.

    SRC may be D, D/rollout_data or one ``<id>.pt`` file. No rollout file: E703 naming the folder.
    """
    if src.is_file():
        match = _ROLLOUT_NAME.match(src.name)
        if match is None:
            raise bad_layout(src, "file name", "<rollout_id>.pt")
        return src.parent.parent, [(int(match.group(1)), src)]
    folder = src / "rollout_data" if (src / "rollout_data").is_dir() else src
    found = sorted(
        (int(m.group(1)), p) for p in folder.glob("*.pt") if (m := _ROLLOUT_NAME.match(p.name)) is not None
    )
    if not found:
        raise bad_layout(folder, "rollout_data", "files <rollout_id>.pt (slime/miles --dump-details)")
    return folder.parent if folder.name == "rollout_data" else folder, found


def rollout_id_of(payload: Any, path: Path, file_id: int) -> int:
    """The step: the dump's own ``rollout_id`` (a sample's ``rollout_id`` is not the step)."""
    value = payload.get("rollout_id", file_id) if isinstance(payload, Mapping) else file_id
    if not isinstance(value, int) or value < 0:
        raise bad_layout(path, "rollout_id", f"a non-negative int, got {value!r}")
    return value


# ---------------------------------------------------------------------------------------------- slime train


def _train_samples(path: Path, payload: Any) -> list[Mapping[str, Any]]:
    if not isinstance(payload, Mapping) or payload.get("format_version") != 2:
        version = payload.get("format_version") if isinstance(payload, Mapping) else None
        raise bad_layout(path, "format_version", f"2 (one file per rollout, all DP shards), got {version!r}")
    samples = payload.get("samples")
    if not isinstance(samples, list):
        raise bad_layout(path, "samples", "a list of per-sample dicts")
    return samples


def _optimizer_steps(payload: Mapping[str, Any]) -> int:
    """Optimizer steps per rollout recorded in the shards' layout (``global_batch_sizes``, one per step)."""
    steps = 1
    for shard in payload.get("dp_shards") or ():
        if isinstance(shard, Mapping):
            for key in ("global_batch_sizes", "num_microbatches"):
                value = shard.get(key)
                if isinstance(value, list | tuple):
                    steps = max(steps, len(value))
    return steps


TRAIN_STREAMS = {"log_probs": "old_logprobs", "ref_log_probs": "ref_logprobs", "advantages": "advantages"}


def join_train(samples: RolloutSamples, train: list[Mapping[str, Any]], path: Path) -> dict[str, FlatList]:
    """Train values per rollout row: {canonical column: response-aligned rows}. The join key is ``rollout_position`` (the sample's position in the rollout dump, what
    slime sorts the dump by) where every sample has one, else ``sample_index`` = ``Sample.index``."""
    n_rows = samples.input_ids.lengths.shape[0]
    if all("rollout_position" in t for t in train):
        positions = [int(t["rollout_position"]) for t in train]
    else:
        if "sample_id" not in samples.frame.columns:
            raise bad_layout(path, "sample_index", "rollout samples with an index to join on")
        by_index = {int(s): r for r, s in enumerate(samples.frame["sample_id"].to_list())}
        positions = []
        for row, t in enumerate(train):
            key = t.get("sample_index")
            if key is None or int(key) not in by_index:
                raise bad_layout(path, "sample_index", "the index of a sample in the rollout dump", row=row)
            positions.append(by_index[int(key)])
    if len(set(positions)) != len(positions) or any(not 0 <= p < n_rows for p in positions):
        raise bad_layout(path, "rollout_position", f"distinct positions in 0..{n_rows - 1}")
    present = [key for key in TRAIN_STREAMS if any(t.get(key) is not None for t in train)]
    rows: dict[str, list[np.ndarray | None]] = {key: [None] * n_rows for key in present}
    offsets = samples.input_ids.offsets
    for row, (t, pos) in enumerate(zip(train, positions, strict=True)):
        n_resp = int(samples.response_lens[pos])
        if "tokens" in t:
            tokens = _as_int_array(t["tokens"], path, "tokens", row)
            if not np.array_equal(tokens, samples.input_ids.values[offsets[pos] : offsets[pos + 1]]):
                raise bad_layout(path, "tokens", f"the tokens of rollout sample {pos}", row=row)
        for key in present:
            if t.get(key) is None:
                raise bad_layout(path, key, "a value on every train sample", row=row)
            rows[key][pos] = float_row(t[key], n_resp, path, key, row)
    missing = [r for r in range(n_rows) if present and rows[present[0]][r] is None]
    flats: dict[str, FlatList] = {}
    for key in present:
        filled = [
            np.zeros(int(samples.response_lens[r]), np.float32) if v is None else v
            for r, v in enumerate(rows[key])
        ]
        flat = from_rows(filled)
        if missing:
            valid = np.ones(flat.values.shape[0], dtype=bool)
            for r in missing:
                valid[flat.offsets[r] : flat.offsets[r + 1]] = False
            flat = FlatList(flat.offsets, flat.values, valid, None)
        flats[TRAIN_STREAMS[key]] = flat
    return flats


def _raw_rewards(samples: RolloutSamples, payload: Mapping[str, Any], frame: pl.DataFrame) -> pl.DataFrame:
    """Dict-valued rewards: the reward slime trained on is the train dump's whole-batch ``raw_reward``."""
    raw = payload.get("raw_reward")
    if not samples.dict_rewards or not isinstance(raw, list | tuple) or len(raw) != frame.height:
        return frame
    values = [float(v) if isinstance(v, bool | int | float) else None for v in raw]
    return frame.with_columns(pl.Series("reward", values, dtype=pl.Float32))


def _read(src: Path, options: ImportOptions) -> Iterator[ImportedStep]:
    dump_dir, files = rollout_files(src)
    allow = numpy_allow_list()
    for file_id, path in files:
        loaded = load_pt_lists(path, allow, allow_unsafe=options.allow_unsafe_pickle)
        step = rollout_id_of(loaded.value, path, file_id)
        samples = read_rollout_samples(path, loaded.value, step)
        src_files = [str(path)]
        streams: dict[str, FlatList] = {}
        warnings: list[ImportWarning] = []
        unsafe = loaded.unsafe_load
        train_path = dump_dir / "train_data" / path.name
        train_payload: Mapping[str, Any] = {}
        if train_path.is_file():
            train_loaded = load_pt_lists(train_path, allow, allow_unsafe=options.allow_unsafe_pickle)
            unsafe = unsafe or train_loaded.unsafe_load
            train_payload = train_loaded.value
            train = _train_samples(train_path, train_payload)
            streams = join_train(samples, train, train_path)
            src_files.append(str(train_path))
            n_steps = _optimizer_steps(train_payload)
            if "old_logprobs" in streams and n_steps > 1:
                warnings.append(
                    ImportWarning(
                        Code.TRAIN_FORWARD_LOGPROBS,
                        f"step {step}: {n_steps} optimizer steps per rollout; log_probs may be snapshots of the "
                        "training forward after an update (--use-rollout-logprobs), not the old policy (old kept)",
                    )
                )
        rows = base_rows(samples, streams)
        rows = _raw_rewards(samples, train_payload, rows)
        fields = {
            "rollout_logprobs": "rollout_log_probs",
            "old_logprobs": "log_probs",
            "ref_logprobs": "ref_log_probs",
        }
        yield ImportedStep(
            step=step,
            rows=rows,
            src_files=tuple(src_files),
            framework="slime",
            default_group_by=field_or_prompt(rows),
            stream_fields={k: v for k, v in fields.items() if k in rows.columns},
            unsafe_load=unsafe,
            warnings=warnings,
        )


PRESET = Preset("slime", "slime --dump-details rollout_data/ and train_data/ .pt", _read)
