"""The Parquet contract of pgdiag: column names, types and footer metadata.

Every reader and writer takes its names from here so that the schema lives in one place: the canonical
rollout columns and their Arrow types, the stream naming rule (stream ``old`` is column
``old_logprobs``, a recompute tag ``rc_bf16_fp32`` becomes ``rc_bf16_fp32_logprobs`` and
``rc_bf16_fp32_entropy`` once joined), the lossless-cast rules that decide E103, and the ``pgdiag.*``
footer keys, whose values are JSON strings. `decode_footer` strips the ``pgdiag.`` prefix, so the
decoded dict has keys ``schema``, ``alignment``, ``source``, ``streams``, ``sampling``, ...
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from pgdiag.errors import Code, InvalidInputError

ROLLOUTS_SCHEMA = "pgdiag.rollouts/v1"
LOGPROBS_SCHEMA = "pgdiag.logprobs/v1"
RUN_SIDECAR_SCHEMA = "pgdiag.run/v1"
FOOTER_PREFIX = "pgdiag."
RECOMPUTE_FOOTER_KEY = "recompute"  # pgdiag.recompute in logprobs parts
ROUTING_FILE = "_routing.parquet"  # per step/layer routing counts in a recompute stream; "_": never a part

BASE_STREAMS = ("rollout", "old", "ref", "new")
LABEL_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")
TAG_PATTERN = re.compile(r"[a-z][a-z0-9_]{0,39}")

KEY_COLUMNS = ("run", "step", "sample_id", "segment_idx")
REQUIRED_COLUMNS = (
    "run",
    "step",
    "sample_id",
    "group_id",
    "seq_hash",
    "input_ids",
    "prompt_len",
    "loss_mask",
)
REQUIRED_HINTS = {
    "group_id": "re-import with pgdiag import --group-by",
    "seq_hash": "re-import (pgdiag import --preset canonical fills it)",
}

# Canonical Arrow types (writers cast to these; readers accept what casts losslessly).
_FLOAT_LIST = pa.list_(pa.float32())
_DICT_STRING = pa.dictionary(pa.int32(), pa.string())
ROLLOUT_ARROW_TYPES: dict[str, pa.DataType] = {
    "run": _DICT_STRING,
    "step": pa.int64(),
    "sample_id": pa.string(),
    "segment_idx": pa.int32(),
    "group_id": pa.string(),
    "seq_hash": pa.uint64(),
    "input_ids": pa.list_(pa.int32()),
    "prompt_len": pa.int32(),
    "loss_mask": pa.list_(pa.bool_()),
    "rollout_logprobs": _FLOAT_LIST,
    "old_logprobs": _FLOAT_LIST,
    "ref_logprobs": _FLOAT_LIST,
    "new_logprobs": _FLOAT_LIST,
    "advantages": _FLOAT_LIST,
    "advantage": pa.float32(),
    "reward": pa.float32(),
    "reward_components": pa.map_(pa.string(), pa.float32()),
    "finish_reason": _DICT_STRING,
    "policy_version": pa.int64(),
    "policy_version_tok": pa.list_(pa.int64()),
    "temperature": pa.float32(),
    "temperature_tok": _FLOAT_LIST,
    "top_p": pa.float32(),
    "top_k": pa.int32(),
    "min_p": pa.float32(),
    "logprobs_mode": _DICT_STRING,
    "env": _DICT_STRING,
    # MoE routing replay: per sample T x L x k expert ids, flat in token, then MoE layer, then rank order;
    # -1 = not recorded (docs/models.md, "Routing replay")
    "routed_experts": pa.list_(pa.int16()),
    # kept sets of the sampling stream in CSR form (pgdiag.data.kept; docs/schema.md, "Kept sets")
    "sampling_kept_ids": pa.list_(pa.int32()),
    "sampling_kept_offsets": pa.list_(pa.int32()),
    "sampling_kept_logprobs": _FLOAT_LIST,
    "sampling_kept_bitmask": pa.list_(pa.uint8()),
    "sampling_kept_bitmask_positions": pa.list_(pa.int32()),
}

# Column kinds that decide which polars dtypes are accepted (lossless cast).
_KIND_OF: dict[str, str] = {
    "run": "string",
    "step": "int64",
    "sample_id": "string",
    "segment_idx": "int32",
    "group_id": "string",
    "seq_hash": "uint64",
    "input_ids": "int32_list",
    "prompt_len": "int32",
    "loss_mask": "bool_list",
    "advantages": "float_list",
    "advantage": "float",
    "reward": "float",
    "env": "string",
    "finish_reason": "string",
    "temperature": "float",
    "temperature_tok": "float_list",
    "policy_version": "int64",
    "routed_experts": "int32_list",
    "sampling_kept_ids": "int32_list",
    "sampling_kept_offsets": "int32_list",
    "sampling_kept_bitmask": "int32_list",
    "sampling_kept_bitmask_positions": "int32_list",
}
_INTS = (pl.Int8, pl.Int16, pl.Int32, pl.Int64, pl.UInt8, pl.UInt16, pl.UInt32, pl.UInt64)
_FLOATS = (pl.Float16, pl.Float32, pl.Float64) if hasattr(pl, "Float16") else (pl.Float32, pl.Float64)
_STRINGS = (pl.String, pl.Categorical, pl.Enum)


def stream_column(stream: str) -> str:
    """Column holding the log-probs of `stream` (``old`` -> ``old_logprobs``)."""
    return f"{stream}_logprobs"


def entropy_column(tag: str) -> str:
    """Column holding the entropy of recompute `tag` once joined (``rc`` -> ``rc_entropy``)."""
    return f"{tag}_entropy"


def kept_mass_column(tag: str) -> str:
    """Column holding the kept mass of recompute `tag` once joined (``rc`` -> ``rc_kept_mass``)."""
    return f"{tag}_kept_mass"


def full_logprobs_column(tag: str) -> str:
    """Column holding the full-vocabulary log-probs of a kept-set recompute `tag` once joined (``rc_full_vocab``)."""
    return f"{tag}_full_vocab"


def kept_kl_column(tag: str) -> str:
    """Column holding the engine-vs-model KL over K of a kept-set recompute `tag` once joined (``rc_kept_kl``)."""
    return f"{tag}_kept_kl"


def column_kind(name: str) -> str | None:
    """The type kind of a known column (``float_list`` for every stream column), or None when unknown."""
    if name.endswith("_logprobs") or name.endswith("_entropy"):
        return "float_list"
    return _KIND_OF.get(name)


def _is_dtype(dtype: pl.DataType, options: tuple) -> bool:
    return any(dtype == option or isinstance(dtype, option) for option in options)


def cast_problem(name: str, dtype: pl.DataType) -> str | None:
    """Why a column of polars type `dtype` cannot be cast losslessly to its schema type (E103), else None.

    Only the type is judged here; value ranges (int64 ids beyond int32, float64 beyond float32) are checked on
    the data by the reader.
    """
    kind = column_kind(name)
    if kind is None:
        return None
    inner = dtype.inner if isinstance(dtype, pl.List | pl.Array) else None
    ok = {
        "string": lambda: _is_dtype(dtype, _STRINGS) or _is_dtype(dtype, _INTS),
        "int64": lambda: _is_dtype(dtype, _INTS),
        "int32": lambda: _is_dtype(dtype, _INTS),
        "uint64": lambda: dtype in (pl.UInt64, pl.UInt32, pl.UInt16, pl.UInt8),
        "float": lambda: _is_dtype(dtype, _FLOATS) or _is_dtype(dtype, _INTS),
        "int32_list": lambda: inner is not None and _is_dtype(inner, _INTS),
        "bool_list": lambda: inner is not None and inner == pl.Boolean,
        "float_list": lambda: inner is not None and _is_dtype(inner, _FLOATS),
    }[kind]()
    if ok:
        return None
    return f"{name}: type {dtype} cannot be cast losslessly to {kind.replace('_', ' ')}"


_UNSIGNED = (pl.UInt8, pl.UInt16, pl.UInt32, pl.UInt64)
INT64_MAX = 2**63 - 1


def safe_coercions(schema: Mapping[str, pl.DataType]) -> list[pl.Expr]:
    """The reader's coercions of columns whose type differs from the schema's but converts without loss
    (the coercion table in docs/schema.md): an unsigned ``step`` becomes int64 (a uint64 step above 2^63 - 1 is
    E103, checked by `pgdiag.data.runs.read_run` before this cast runs), a signed int64 ``seq_hash`` is read as
    the same 64 bits unsigned. ``large_list``, ``large_string`` and dictionary-encoded strings need no
    expression: polars reads them as its list, string and categorical types, which every reader accepts."""
    coercions = []
    if _is_dtype(schema.get("step", pl.Int64), _UNSIGNED):
        coercions.append(pl.col("step").cast(pl.Int64, strict=True))
    if schema.get("seq_hash") == pl.Int64:
        coercions.append(pl.col("seq_hash").reinterpret(signed=False))
    return coercions


def encode_footer(meta: Mapping[str, Any]) -> dict[bytes, bytes]:
    """Footer key/values: each entry JSON-encoded under ``pgdiag.<key>`` (keys given with or without prefix)."""
    out: dict[bytes, bytes] = {}
    for key, value in meta.items():
        full = key if key.startswith(FOOTER_PREFIX) else FOOTER_PREFIX + key
        out[full.encode()] = json.dumps(value, sort_keys=True).encode()
    return out


def decode_footer(metadata: Mapping[bytes, bytes] | None) -> dict[str, Any]:
    """The ``pgdiag.*`` footer entries, JSON-decoded, keyed without the ``pgdiag.`` prefix.

    A value that is not valid JSON is kept as its raw string (so that E101 can name it).
    """
    out: dict[str, Any] = {}
    for raw_key, raw_value in (metadata or {}).items():
        key = raw_key.decode("utf-8", errors="replace")
        if not key.startswith(FOOTER_PREFIX):
            continue
        text = raw_value.decode("utf-8", errors="replace")
        try:
            out[key[len(FOOTER_PREFIX) :]] = json.loads(text)
        except json.JSONDecodeError:
            out[key[len(FOOTER_PREFIX) :]] = text
    return out


def csv_error(path: Path) -> InvalidInputError | None:
    """E101 for a CSV or TSV file given where Parquet is read (a ``.csv``/``.tsv`` name, or a first line of text
    with commas or tabs), naming `pgdiag.write_run`; None for any other file."""
    if path.suffix.lower() not in (".csv", ".tsv"):
        try:
            with open(path, "rb") as handle:
                head = handle.read(4096)
        except OSError:
            return None
        first = head.split(b"\n", 1)[0]
        try:
            text = first.decode("utf-8")
        except UnicodeDecodeError:
            return None
        if b"\0" in head or head.startswith(b"PAR1") or not ("," in text or "\t" in text):
            return None
    return InvalidInputError(
        Code.NOT_ROLLOUTS_FILE,
        f"{path}: a CSV file, not Parquet; pgdiag reads Parquet rollouts (docs/schema.md)",
        "load it (e.g. polars.read_csv) and write it with pgdiag.write_run(df, OUT) (docs/import.md, "
        "'Your own format')",
    )


def read_footer(path: Path) -> dict[str, Any]:
    """Decoded ``pgdiag.*`` footer of one Parquet file; an unreadable file is E101 (a CSV one names
    `pgdiag.write_run`)."""
    try:
        schema = pq.read_schema(path)
    except (OSError, pa.ArrowException) as exc:
        raise csv_error(path) or InvalidInputError(
            Code.NOT_ROLLOUTS_FILE,
            f"{path}: not a readable Parquet file ({exc})",
            "convert it with pgdiag import",
        ) from exc
    return decode_footer(schema.metadata)


def check_rollouts_footer(meta: Mapping[str, Any], path: Path) -> None:
    """Raise E101 when `meta` is not a rollouts/v1 footer, E104 when its alignment is not ``token``."""
    schema = meta.get("schema")
    if schema != ROLLOUTS_SCHEMA:
        raise InvalidInputError(
            Code.NOT_ROLLOUTS_FILE,
            f"{path}: not a pgdiag rollouts file (schema={schema!r})",
            "convert it with pgdiag import",
        )
    alignment = meta.get("alignment")
    if alignment != "token":
        raise InvalidInputError(
            Code.ALIGNMENT_UNSUPPORTED,
            f"{path}: alignment {alignment!r} is not supported",
            "re-import with pgdiag import",
        )
    check_footer_shape(meta, path)


_FOOTER_OBJECTS = ("source", "streams", "sampling", "tokenizer", "model", "import", "recompute")


def check_footer_shape(meta: Mapping[str, Any], path: Path) -> None:
    """Raise E105 when a footer entry documented as a JSON object (docs/schema.md) is anything else.

    Checked before any reader calls ``.get`` on it; every stream entry of ``streams`` must be an object too.
    """
    for key in _FOOTER_OBJECTS:
        if key in meta and not isinstance(meta[key], dict):
            raise InvalidInputError(
                Code.BAD_FOOTER_SHAPE,
                f"{path}: footer pgdiag.{key} is a {type(meta[key]).__name__}, not a JSON object",
                "re-import the run with pgdiag import",
            )
    for name, entry in meta.get("streams", {}).items():
        if not isinstance(entry, dict):
            raise InvalidInputError(
                Code.BAD_FOOTER_SHAPE,
                f"{path}: footer pgdiag.streams.{name} is a {type(entry).__name__}, not a JSON object",
                "re-import the run with pgdiag import",
            )


def check_logprobs_footer(meta: Mapping[str, Any], path: Path) -> None:
    """Raise E101 when `meta` names a schema other than pgdiag.logprobs/v1 (parts may omit the key)."""
    schema = meta.get("schema", LOGPROBS_SCHEMA)
    if schema != LOGPROBS_SCHEMA:
        raise InvalidInputError(
            Code.NOT_ROLLOUTS_FILE,
            f"{path}: not a pgdiag recompute part (schema={schema!r})",
            "rerun pgdiag logprobs --overwrite",
        )
