"""Preset ``verl-jsonl``: verl's text rollout dump ``<trainer.rollout_data_dir>/<global_steps>.jsonl``.

verl's trainers (``_write_generations`` in ``verl/trainer/ppo/ray_trainer.py`` and
``verl/trainer/ppo/v1/trainer_base.py``, checked against verl-project/verl 1dda039b) write one JSON object per
sample: ``input`` and ``output`` (decoded with ``skip_special_tokens=True``), ``gts``, ``score`` (row sum of the
token-level scores), ``step``, every ``reward_extra_info`` key, and ``uid`` (v1 trainer: the key
``{uid}_{session_id}_{index}``, rows sorted by it) or ``request_id`` (legacy trainer, when the batch has one).

The dump holds **text only**, so it is E702 unless ``--retokenize --tokenizer PATH``: ``input`` and ``output``
are then tokenized separately with the HF ``tokenizers`` library (no special tokens added: they were stripped
when verl decoded), ids = input ids + output ids, prompt_len = len(input ids), loss_mask = every output token,
``pgdiag.source.retokenized`` = true (W405 on later commands: expect drift against the engine's ids). No stream
is imported: attach one with ``pgdiag logprobs``. ``score`` -> reward; numeric extra keys -> reward_components.
Ids: v1 ``uid`` gives group ``{uid}``, sample ``{uid}_{session_id}``, segment_idx ``index``; else group
``prompt`` and sample ``request_id``, else ``"{step}:{line}"``.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from pgdiag.data.flat import FlatList
from pgdiag.errors import Code, UsageError, missing_package
from pgdiag.importers import alignment
from pgdiag.importers.base import ImportedStep, ImportOptions, Preset, bad_layout, text_only
from pgdiag.importers.nemo_rl import check_complete

FILE_PATTERN = re.compile(r"(\d+)\.jsonl")
_TEXT_FIELDS = ("input", "output", "gts", "score", "step", "uid", "request_id")


def step_files(src: Path) -> list[tuple[int, Path]]:
    """(global_steps, path) of every ``<N>.jsonl`` in `src` (or `src` itself), in step order."""
    if src.is_file():
        match = FILE_PATTERN.fullmatch(src.name)
        return [(int(match.group(1)) if match else -1, src)]
    found = [(int(m.group(1)), p) for p in src.glob("*.jsonl") if (m := FILE_PATTERN.fullmatch(p.name))]
    if not found:
        raise UsageError(Code.INPUT_NOT_FOUND, f"{src}: no <global_steps>.jsonl file found")
    return sorted(found)


def load_tokenizer(path: Path) -> tuple[Any, dict[str, Any]]:
    """A `tokenizers.Tokenizer` from a tokenizer.json (or its folder), and its footer entry."""
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:  # pragma: no cover - transformers brings it
        raise missing_package("--retokenize", "tokenizers", "pip install tokenizers") from exc
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise UsageError(
            Code.INPUT_NOT_FOUND, f"{file}: no tokenizer.json found", "pass --tokenizer PATH/tokenizer.json"
        )
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as exc:  # the tokenizers library raises bare Exceptions on bad files
        raise UsageError(Code.WRONG_FILE_KIND, f"{file}: not a tokenizers tokenizer.json ({exc})") from exc
    meta = {
        "name": str(path),
        "vocab_size": tokenizer.get_vocab_size(with_added_tokens=False),
        "tokenizer_len": tokenizer.get_vocab_size(with_added_tokens=True),
        "sha256": hashlib.sha256(file.read_bytes()).hexdigest(),
    }
    return tokenizer, meta


def _lines(path: Path) -> list[dict[str, Any]]:
    check_complete(path)
    rows = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle):
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise bad_layout(path, "line", f"one JSON object per line ({exc})", row=number) from exc
            if (
                not isinstance(row, dict)
                or not isinstance(row.get("input"), str)
                or not isinstance(row.get("output"), str)
            ):
                raise bad_layout(path, "input/output", "strings (verl _write_generations)", row=number)
            rows.append(row)
    return rows


def _components(rows: list[dict[str, Any]]) -> list[list[tuple[str, float]]] | None:
    keys = sorted(
        {
            k
            for row in rows
            for k, v in row.items()
            if k not in _TEXT_FIELDS and isinstance(v, int | float) and not isinstance(v, bool)
        }
    )
    if not keys:
        return None
    return [
        [
            (k, float(row[k]))
            for k in keys
            if isinstance(row.get(k), int | float) and not isinstance(row.get(k), bool)
        ]
        for row in rows
    ]


def read_step(step: int, path: Path, tokenizer: Any, tokenizer_meta: dict[str, Any]) -> ImportedStep:
    rows = _lines(path)
    steps = {row.get("step") for row in rows}
    if len(steps) == 1 and isinstance(next(iter(steps)), int):
        step = int(next(iter(steps)))
    elif steps != {None} or step < 0:
        raise bad_layout(path, "step", "one integer step on every line (or a <global_steps>.jsonl name)")
    prompts = tokenizer.encode_batch([row["input"] for row in rows], add_special_tokens=False)
    outputs = tokenizer.encode_batch([row["output"] for row in rows], add_special_tokens=False)
    prompt_ids = [p.ids for p in prompts]
    output_ids = [o.ids for o in outputs]
    empty = [i for i, ids in enumerate(prompt_ids) if not ids]
    if empty:
        raise bad_layout(
            path, "input", "a non-empty prompt (no token before the first loss position)", row=empty[0]
        )
    seq_lens = np.array(
        [len(p) + len(o) for p, o in zip(prompt_ids, output_ids, strict=True)], dtype=np.int64
    )
    prompt_lens = np.array([len(p) for p in prompt_ids], dtype=np.int64)
    ids = alignment.from_rows([p + o for p, o in zip(prompt_ids, output_ids, strict=True)], dtype=np.int32)
    positions = np.arange(int(seq_lens.sum())) - np.repeat(alignment.offsets_of(seq_lens)[:-1], seq_lens)
    mask = positions >= np.repeat(prompt_lens, seq_lens)
    columns: dict[str, pl.Series] = {
        "input_ids": alignment.to_series("input_ids", ids, pl.List(pl.Int32)),
        "prompt_len": pl.Series("prompt_len", prompt_lens, dtype=pl.Int32),
        "loss_mask": alignment.to_series(
            "loss_mask", FlatList(ids.offsets, mask, None, None), pl.List(pl.Boolean)
        ),
    }
    scores = [row.get("score") for row in rows]
    if any(isinstance(s, int | float) for s in scores):
        columns["reward"] = pl.Series(
            "reward", [float(s) if isinstance(s, int | float) else None for s in scores], dtype=pl.Float32
        )
    components = _components(rows)
    if components is not None:
        columns["reward_components"] = pl.Series(
            "reward_components",
            [[{"key": k, "value": v} for k, v in row] for row in components],
            dtype=pl.List(pl.Struct({"key": pl.String, "value": pl.Float32})),
        )
    group_by = "prompt"
    uids = [row.get("uid") for row in rows]
    if all(isinstance(u, str) for u in uids):
        parts = [u.rsplit("_", 2) for u in uids]
        if all(len(p) == 3 and p[2].isdigit() for p in parts):
            columns["group_id"] = pl.Series("group_id", [p[0] for p in parts], dtype=pl.String)
            columns["sample_id"] = pl.Series("sample_id", [f"{p[0]}_{p[1]}" for p in parts], dtype=pl.String)
            columns["segment_idx"] = pl.Series("segment_idx", [int(p[2]) for p in parts], dtype=pl.Int32)
            group_by = "field"
        else:
            columns["group_id"] = pl.Series("group_id", uids, dtype=pl.String)
            group_by = "field"
    elif all(isinstance(row.get("request_id"), str) for row in rows):
        columns["sample_id"] = pl.Series("sample_id", [row["request_id"] for row in rows], dtype=pl.String)
    return ImportedStep(
        step=step,
        rows=pl.DataFrame(list(columns.values())),
        src_files=(str(path),),
        framework="verl",
        default_group_by=group_by,
        retokenized=True,
        requires_stream=False,
        footer={"tokenizer": tokenizer_meta},
    )


def read(src: Path, options: ImportOptions) -> Iterator[ImportedStep]:
    """Every ``<global_steps>.jsonl`` in `src`, retokenized; E702 without ``--retokenize --tokenizer``."""
    files = step_files(src)
    if not options.retokenize or options.tokenizer is None:
        raise text_only(files[0][1], "input/output")
    tokenizer, meta = load_tokenizer(options.tokenizer)
    for step, path in files:
        yield read_step(step, path, tokenizer, meta)


PRESET = Preset(
    "verl-jsonl", "verl rollout_data_dir <step>.jsonl (text; needs --retokenize --tokenizer)", read
)
