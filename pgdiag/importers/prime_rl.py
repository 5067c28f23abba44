"""prime-rl preset: ``rollout_transport.type = "filesystem"`` writes ``<output_dir>/rollouts/step_<n>/rank_<r>.bin``.

Each file is a msgspec MessagePack ``list[MicroBatch]``, every MicroBatch a positional array (``array_like``,
``omit_defaults``: trailing unset fields are left out). The field order changed several times and msgspec
ignores extra trailing elements, so the preset pins prime-rl 0.8.0's order and checks every field's type and
length; a mismatch is E703 naming the field. A micro-batch packs several samples: they are split where
``position_ids`` restart at 0 (``seq_lens`` cannot be used: padding extends the last sample's entry), and the
padding segment (token 1, loss false, env "") is dropped, as are dummy micro-batches whose loss mask is all
false (rank balancing). Values are token-aligned. There is no old stream (the trainer computes it in the
loss) and no reward; groups are by prompt (packing sorts by length and keeps no ids). ``routed_experts`` (MoE
router replay, ``[tokens, layers, top_k]`` raw bytes for the whole micro-batch) is cut per packed sample and kept
flat as the ``routed_experts`` column (docs/schema.md); a micro-batch without it gives null rows.

Kept sets (sampling-mask replay, PrimeIntellect-ai/prime-rl#3431, read on its branch at d09488d5,
``src/prime_rl/transport/types.py``): the same MicroBatch with ``kept_tokens`` appended last, a ``KeptTokens``
array ``[ids, counts]`` of raw int32 bytes: ``counts`` one per token of the micro-batch (0 = no mask there),
``ids`` the kept ids concatenated (4 x sum(counts) bytes). verifiers' ``KeptTokens`` reach disk only this way.
They become ``sampling_kept_ids`` / ``sampling_kept_offsets`` per packed sample (docs/schema.md, "Kept sets");
broken sets are refused by the writer (E220-E223).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from pgdiag.importers.alignment import from_rows, to_series
from pgdiag.importers.base import ImportedStep, ImportOptions, Preset, bad_layout, count_note
from pgdiag.importers.msgpack import decode

PRIME_RL_VERSION = "0.8.0"


@dataclass(frozen=True)
class Field:
    name: str
    kind: str  # int_list | bool_list | float_list | str_list | routed_experts | mm_kwargs
    per_token: bool  # as long as input_ids
    optional: bool  # may be nil or omitted


# prime-rl 0.8.0 src/prime_rl/transports/rollouts/types.py MicroBatch, in order
FIELDS_0_8_0 = (
    Field("input_ids", "int_list", True, False),
    Field("loss_mask", "bool_list", True, False),
    Field("advantages", "float_list", True, False),
    Field("inference_logprobs", "float_list", True, False),
    Field("position_ids", "int_list", True, False),
    Field("sequence_lengths", "int_list", False, False),
    Field("temperatures", "float_list", True, False),
    Field("env_names", "str_list", True, False),
    Field("seq_lens", "int_list", False, False),
    Field("ref_logprobs", "float_list", True, True),
    Field("routed_experts", "routed_experts", False, True),
    Field("mm_kwargs", "mm_kwargs", False, True),
    Field("mm_token_type_ids", "int_list", True, True),
    Field("rl_weights", "float_list", True, True),
    Field("ce_weights", "float_list", True, True),
    Field("ref_kl_weights", "float_list", True, True),
    # prime-rl#3431 (d09488d5): the kept-set sampling masks, appended last for wire-layout stability
    Field("kept_tokens", "kept_tokens", False, True),
)
_REQUIRED = sum(not f.optional for f in FIELDS_0_8_0)
_STEP_DIR = re.compile(r"^step_(\d+)$")
_RANK_FILE = re.compile(r"^rank_(\d+)\.bin$")


def _is_list_of(value: Any, kind: str) -> bool:
    if isinstance(value, np.ndarray):  # a list the decoder read in one step
        return value.dtype.kind in {"int_list": "iu", "bool_list": "b", "float_list": "fiu"}.get(kind, "")
    if not isinstance(value, list):
        return False
    if kind == "int_list":
        return all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    if kind == "bool_list":
        return all(isinstance(v, bool) for v in value)
    if kind == "float_list":
        return all(isinstance(v, float | int) and not isinstance(v, bool) for v in value)
    if kind == "str_list":
        return all(isinstance(v, str) for v in value)
    return False


def _check_field(field: Field, value: Any, path: Path, mb: int) -> None:
    where = f"micro-batch {mb}"
    if value is None:
        if not field.optional:
            raise bad_layout(path, field.name, f"a value ({where}; nil only for optional fields)")
        return
    if field.kind == "routed_experts":
        ok = isinstance(value, list) and len(value) == 3 and isinstance(value[0], bytes)
        if not ok:
            raise bad_layout(path, field.name, f"nil or [data bytes, shape, dtype] ({where})")
        return
    if field.kind == "kept_tokens":
        ok = isinstance(value, list) and len(value) == 2 and all(isinstance(v, bytes) for v in value)
        if not ok:
            raise bad_layout(path, field.name, f"nil or [ids bytes, counts bytes] ({where})")
        return
    if field.kind == "mm_kwargs":
        if not isinstance(value, dict):
            raise bad_layout(path, field.name, f"nil or a map of encoded tensors ({where})")
        return
    if not _is_list_of(value, field.kind):
        raise bad_layout(
            path,
            field.name,
            f"a list of {field.kind.removesuffix('_list')}s ({where}, prime-rl {PRIME_RL_VERSION} order)",
        )


def _micro_batch(raw: Any, path: Path, mb: int) -> dict[str, Any]:
    """One MicroBatch array checked field by field against the pinned 0.8.0 order."""
    if not isinstance(raw, list):
        raise bad_layout(path, "MicroBatch", f"a positional array (micro-batch {mb})")
    if not _REQUIRED <= len(raw) <= len(FIELDS_0_8_0):
        raise bad_layout(
            path,
            "MicroBatch",
            f"{_REQUIRED} to {len(FIELDS_0_8_0)} fields (prime-rl {PRIME_RL_VERSION}), got {len(raw)} (micro-batch {mb}); "
            "another prime-rl version?",
        )
    fields = {f.name: None for f in FIELDS_0_8_0}
    for field, value in zip(FIELDS_0_8_0, raw, strict=False):
        _check_field(field, value, path, mb)
        fields[field.name] = value
    n_tokens = len(fields["input_ids"])
    for field in FIELDS_0_8_0:
        value = fields[field.name]
        if field.per_token and value is not None and len(value) != n_tokens:
            raise bad_layout(
                path,
                field.name,
                f"{n_tokens} values (one per input_ids token), got {len(value)} (micro-batch {mb})",
            )
    for name in ("sequence_lengths", "seq_lens"):
        if int(np.sum(fields[name])) != n_tokens:
            raise bad_layout(path, name, f"lengths summing to {n_tokens} input_ids tokens (micro-batch {mb})")
    return fields


def _routes(fields: dict[str, Any], path: Path, mb: int) -> np.ndarray | None:
    """(N, L, k) expert ids of the micro-batch's N tokens, or None where it recorded none."""
    value = fields["routed_experts"]
    if value is None:
        return None
    data, shape, dtype = value
    n_tokens = len(fields["input_ids"])
    dims = (
        np.asarray(shape) if isinstance(shape, list | np.ndarray) else np.zeros(0)
    )  # the decoder reads int lists as arrays
    try:
        width = np.dtype(dtype)
    except TypeError:
        width = np.dtype(object)
    if dims.shape != (3,) or dims.dtype.kind not in "iu" or width.kind not in "iu" or dims[0] != n_tokens:
        raise bad_layout(
            path,
            "routed_experts",
            f"[{n_tokens}, layers, top_k] integer ids (micro-batch {mb}), got {shape} {dtype}",
        )
    shape = [int(d) for d in dims]
    if len(data) != int(np.prod(shape)) * width.itemsize:
        raise bad_layout(path, "routed_experts", f"{shape} x {dtype} bytes of data (micro-batch {mb})")
    routes = np.frombuffer(data, dtype=width).reshape(shape)  # (N, L, k)
    if routes.size and (routes.min() < -1 or routes.max() > np.iinfo(np.int16).max):
        raise bad_layout(path, "routed_experts", f"expert ids in [-1, 32767] (micro-batch {mb})")
    return routes


def _kept(fields: dict[str, Any], path: Path, mb: int) -> tuple[np.ndarray, np.ndarray] | None:
    """((N,) int64 kept-set size per token, (E,) int64 kept ids) of the micro-batch, or None without masks."""
    value = fields["kept_tokens"]
    if value is None:
        return None
    ids_bytes, count_bytes = value
    n_tokens = len(fields["input_ids"])
    if len(count_bytes) != 4 * n_tokens or len(ids_bytes) % 4:
        raise bad_layout(
            path, "kept_tokens", f"{n_tokens} int32 counts (one per token) and int32 ids (micro-batch {mb})"
        )
    counts = np.frombuffer(count_bytes, dtype="<i4").astype(np.int64)  # (N,)
    ids = np.frombuffer(ids_bytes, dtype="<i4").astype(np.int64)  # (E,)
    if (counts < 0).any() or int(counts.sum()) != ids.size:
        raise bad_layout(path, "kept_tokens", f"counts >= 0 summing to the {ids.size} ids (micro-batch {mb})")
    return counts, ids


def _segments(fields: dict[str, Any], path: Path, mb: int) -> list[tuple[int, int]]:
    """(start, end) of each packed sample: where position_ids restart at 0, padding segment dropped."""
    positions = np.asarray(fields["position_ids"], dtype=np.int64)
    if positions.size == 0 or positions[0] != 0:
        raise bad_layout(path, "position_ids", f"0 at the first token (micro-batch {mb})")
    starts = np.flatnonzero(positions == 0)
    ends = np.append(starts[1:], positions.size)
    segment = np.cumsum(positions == 0) - 1  # (N,) packed sample of each token
    if not np.array_equal(positions, np.arange(positions.size) - starts[segment]):
        raise bad_layout(path, "position_ids", f"runs 0, 1, 2, ... per packed sample (micro-batch {mb})")
    spans = list(zip(starts.tolist(), ends.tolist(), strict=True))
    s, e = spans[-1]
    ids = np.asarray(fields["input_ids"][s:e])
    mask = np.asarray(fields["loss_mask"][s:e], dtype=bool)
    envs = fields["env_names"][s:e]
    if len(spans) > 1 and (ids == 1).all() and not mask.any() and all(env == "" for env in envs):
        spans.pop()  # pad_micro_batch's trailing segment
    return spans


def _read_step(step: int, files: list[Path]) -> ImportedStep:
    ids: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    streams: dict[str, list[np.ndarray]] = {"rollout_logprobs": [], "advantages": [], "temperature_tok": []}
    refs: list[np.ndarray | None] = []
    routes: list[np.ndarray | None] = []
    kept_ids: list[list[int] | None] = []
    kept_offsets: list[list[int] | None] = []
    envs: list[str] = []
    dummies = 0
    for path in files:
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise bad_layout(path, "file", f"a readable file ({exc.strerror})") from exc
        batches = decode(data, source=path)
        if not isinstance(batches, list):
            raise bad_layout(path, "file", "a list of MicroBatch arrays")
        for mb, raw in enumerate(batches):
            fields = _micro_batch(raw, path, mb)
            loss = np.asarray(fields["loss_mask"], dtype=bool)
            if not loss.any():
                dummies += 1  # _make_dummy_batch copies that balance ranks
                continue
            if fields["rl_weights"] is not None:
                loss = loss & (np.asarray(fields["rl_weights"], dtype=np.float64) != 0)
            batch_routes = _routes(fields, path, mb)  # (N, L, k) or None
            batch_kept = _kept(fields, path, mb)  # ((N,) counts, (E,) ids) or None
            starts = None if batch_kept is None else np.concatenate([[0], np.cumsum(batch_kept[0])])
            for s, e in _segments(fields, path, mb):
                ids.append(np.asarray(fields["input_ids"][s:e], dtype=np.int64))
                masks.append(loss[s:e])
                streams["rollout_logprobs"].append(
                    np.asarray(fields["inference_logprobs"][s:e], dtype=np.float32)
                )
                streams["advantages"].append(np.asarray(fields["advantages"][s:e], dtype=np.float32))
                streams["temperature_tok"].append(np.asarray(fields["temperatures"][s:e], dtype=np.float32))
                ref = fields["ref_logprobs"]
                refs.append(None if ref is None else np.asarray(ref[s:e], dtype=np.float32))
                routes.append(
                    None if batch_routes is None else batch_routes[s:e].reshape(-1).astype(np.int16)
                )
                envs.append(fields["env_names"][s])
                if batch_kept is None or starts is None:
                    kept_ids.append(None)
                    kept_offsets.append(None)
                else:
                    kept_ids.append(batch_kept[1][starts[s] : starts[e]].tolist())
                    kept_offsets.append((starts[s : e + 1] - starts[s]).tolist())
    if not ids:
        raise bad_layout(files[0].parent, "loss_mask", "at least one micro-batch with loss tokens")
    columns = [
        to_series("input_ids", from_rows(ids, np.int64), pl.List(pl.Int32)),
        to_series("loss_mask", from_rows(masks, bool), pl.List(pl.Boolean)),
    ]
    for name, rows in streams.items():
        columns.append(to_series(name, from_rows(rows), pl.List(pl.Float32)))
    fields_used = {"rollout_logprobs": "inference_logprobs"}
    if any(r is not None for r in refs):
        if any(r is None for r in refs):
            raise bad_layout(
                files[0].parent, "ref_logprobs", "present in every micro-batch of the step or in none"
            )
        columns.append(to_series("ref_logprobs", from_rows(refs), pl.List(pl.Float32)))  # type: ignore[arg-type]
        fields_used["ref_logprobs"] = "ref_logprobs"
    if any(r is not None for r in routes):
        columns.append(
            pl.Series(
                "routed_experts", [None if r is None else r.tolist() for r in routes], pl.List(pl.Int16)
            )
        )
    if any(k is not None for k in kept_offsets):  # docs/schema.md, "Kept sets"
        columns.append(pl.Series("sampling_kept_ids", kept_ids, dtype=pl.List(pl.Int64)))
        columns.append(pl.Series("sampling_kept_offsets", kept_offsets, dtype=pl.List(pl.Int64)))
    columns.append(pl.Series("env", envs, dtype=pl.String))
    columns.append(pl.Series("sample_id", [f"{step}:{k}" for k in range(len(ids))], dtype=pl.String))
    warnings = count_note(step, dummies, "dummy micro-batches skipped (all loss_mask false)")
    return ImportedStep(
        step=step,
        rows=pl.DataFrame(columns),
        src_files=tuple(str(p) for p in files),
        framework="prime-rl",
        framework_version=PRIME_RL_VERSION,
        default_group_by="prompt",
        stream_fields=fields_used,
        warnings=warnings,
    )


def _read(src: Path, options: ImportOptions) -> Iterator[ImportedStep]:
    if src.is_file():
        match = _STEP_DIR.match(src.parent.name)
        step = int(match.group(1)) if match else options.step
        if step is None:
            raise bad_layout(src, "step", "a step_<n> folder holding the file, or --step N")
        yield _read_step(step, [src])
        return
    root = src / "rollouts" if (src / "rollouts").is_dir() else src
    step_dirs = [
        (int(m.group(1)), d) for d in root.iterdir() if d.is_dir() and (m := _STEP_DIR.match(d.name))
    ]
    if not step_dirs and _STEP_DIR.match(src.name):
        step_dirs = [(int(_STEP_DIR.match(src.name).group(1)), src)]  # type: ignore[union-attr]
    if not step_dirs:
        raise bad_layout(
            src, "rollouts", 'step_<n>/rank_<r>.bin folders (rollout_transport.type = "filesystem")'
        )
    for step, folder in sorted(step_dirs):
        ranks = sorted((int(m.group(1)), p) for p in folder.iterdir() if (m := _RANK_FILE.match(p.name)))
        if not ranks:
            continue
        if [r for r, _ in ranks] != list(range(len(ranks))):
            raise bad_layout(folder, "rank_<r>.bin", f"ranks 0..{len(ranks) - 1} without gaps")
        yield _read_step(step, [p for _, p in ranks])


PRESET = Preset("prime-rl", "prime-rl 0.8.0 rollouts/step_<n>/rank_<r>.bin", _read)
