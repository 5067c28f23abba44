"""The on-disk recompute stream: part files, the manifest, and the resume decision (docs/recompute.md).

What: `inspect_output` decides, before anything is written, whether a recompute under a tag starts fresh,
resumes (and which parts are already done), or must refuse: E502 when the output exists (complete, or
incomplete without resume) and `overwrite` is not given, or when it was made with other settings, another
model or other input. `clear_output` removes a previous recompute's files and nothing else. `write_part` writes
one `pgdiag.logprobs/v1` file: full-length, token-aligned ``logprobs``/``entropy`` lists, null off the loss
positions, with the ``pgdiag.recompute`` footer.

Why here: these are the rules that make an interrupted job safe to rerun; `pgdiag.recompute.logprobs` only orchestrates.
A part is "done" when its file exists and its footer carries the same model, settings, input fingerprint and
plan entry, so a part written by other settings is recomputed rather than trusted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from pgdiag.data.arrow_build import list_array, numeric_array, string_array
from pgdiag.data.schema import LOGPROBS_SCHEMA, RECOMPUTE_FOOTER_KEY, ROUTING_FILE, read_footer
from pgdiag.data.writing import write_parquet
from pgdiag.errors import Code, InvalidInputError, UsageError

if TYPE_CHECKING:
    from pgdiag.recompute.inputs import Part, RecomputeInputs

MANIFEST_NAME = "_manifest.json"


_COMPARED = ("model", "settings", "input_fingerprint")


def inspect_output(
    out_dir: Path,
    manifest: dict[str, Any],
    parts: list[Part],
    footer_base: dict[str, Any],
    *,
    resume: bool,
    overwrite: bool,
    tag: str,
) -> set[str]:
    """The relative paths of parts already done; raises E502 when the existing output may not be touched."""
    if overwrite:
        return set()
    manifest_path = out_dir / MANIFEST_NAME
    if not manifest_path.is_file():
        if out_dir.is_dir() and any(out_dir.iterdir()):
            raise UsageError(
                Code.OUTPUT_EXISTS,
                f"{out_dir} exists and is not a pgdiag recompute output",
                "pass --overwrite",
            )
        return set()
    try:
        old = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(
            Code.OUTPUT_EXISTS, f"{manifest_path} is unreadable ({exc})", "pass --overwrite"
        ) from exc
    if not isinstance(old, dict):
        raise UsageError(Code.OUTPUT_EXISTS, f"{manifest_path} is not a JSON object", "pass --overwrite")
    for key in _COMPARED:
        if old.get(key) != manifest[key]:
            raise UsageError(
                Code.OUTPUT_EXISTS,
                f"{out_dir} holds tag {tag} made with other {key} ({_first_difference(old.get(key), manifest[key])})",
                "pass --overwrite to replace it, or choose another --tag",
            )
    if old.get("complete") is True:
        raise UsageError(
            Code.OUTPUT_EXISTS,
            f"{out_dir} is complete",
            "pass --overwrite to recompute, or choose another --tag",
        )
    if not resume:
        raise UsageError(
            Code.OUTPUT_EXISTS,
            f"{out_dir} exists (incomplete)",
            "--no-resume recomputes everything: add --overwrite",
        )
    done = set()
    for part in parts:
        path = out_dir / part.relpath
        if not path.is_file():
            continue
        try:
            footer = read_footer(path).get(RECOMPUTE_FOOTER_KEY) or {}
        except InvalidInputError:
            continue
        expected = {**footer_base, "part": part.plan_entry()}
        if all(footer.get(k) == expected[k] for k in (*_COMPARED, "part")):
            done.add(part.relpath)
    return done


def _first_difference(old: Any, new: Any) -> str:
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new)):
            if old.get(key) != new.get(key):
                return f"{key}: {old.get(key)!r} on disk vs {new.get(key)!r} now"
    return f"{old!r} on disk vs {new!r} now"


def remove_temp_files(out_dir: Path) -> int:
    """Remove the temp files a killed writer left (``.<name>.tmp-<pid>-<random>`` of parts, manifest, routing
    summary); only safe while this process holds the tag's lock. Returns how many were removed."""
    stale = [
        *out_dir.glob("step=*/.part-*.tmp-*"),
        *out_dir.glob(f".{MANIFEST_NAME}.tmp-*"),
        *out_dir.glob(f".{ROUTING_FILE}.tmp-*"),
    ]
    for path in stale:
        path.unlink(missing_ok=True)
    return len(stale)


def clear_output(out_dir: Path) -> None:
    """Remove a previous recompute's files (manifest, parts, temp files) and nothing else."""
    remove_temp_files(out_dir)
    for path in [
        *out_dir.glob("step=*/part-*.parquet"),
        out_dir / MANIFEST_NAME,
        out_dir / ROUTING_FILE,
    ]:
        path.unlink(missing_ok=True)
    for step_dir in out_dir.glob("step=*"):
        if step_dir.is_dir() and not any(step_dir.iterdir()):
            step_dir.rmdir()


def discard_empty_output(out_dir: Path) -> None:
    """After a failed or interrupted recompute: when no part is on disk, remove the manifest (and the tag
    directory when nothing else is in it), so that no incomplete dataset is left; parts on disk are kept, and a
    rerun resumes from them."""
    if any(out_dir.glob("step=*/part-*.parquet")):
        return
    clear_output(out_dir)
    if out_dir.is_dir() and not any(out_dir.iterdir()):
        out_dir.rmdir()


def write_part(
    inputs: RecomputeInputs,
    part: Part,
    logprobs: np.ndarray,
    entropy: np.ndarray,
    out_dir: Path,
    footer_base: dict[str, Any],
    *,
    with_entropy: bool,
    tag: str,
    routing: dict[str, Any] | None = None,
    kept: dict[str, np.ndarray] | None = None,
) -> None:
    """One pgdiag.logprobs/v1 file: full-length lists, null off the loss positions.

    `logprobs` and `entropy` are (T_part,) float32 over the part's tokens; values off the loss mask are ignored.
    `routing`: the part's MoE routing counts (`pgdiag.recompute.routing.footer_entry`), kept in the footer.
    `kept`: the kept-set columns (``kept_mass``, ``logprobs_full``, optional ``kept_kl``; (T_part,) float32 each),
    written as lists too; a NaN in them (``kept_kl`` where no set is recorded) is written null.
    """
    rows = slice(part.start, part.stop)
    base = int(inputs.offsets[part.start])
    offsets = (inputs.offsets[part.start : part.stop + 1] - base).astype(np.int32)  # (n+1,)
    valid = inputs.loss_mask[base : int(inputs.offsets[part.stop])]  # (T_part,)
    if not np.isfinite(logprobs[valid]).all() or not np.isfinite(entropy[valid]).all():
        raise UsageError(
            Code.NON_FINITE_MODEL,
            f"{out_dir}: non-finite log-probs in step {part.step} part {part.index} (the LM head overflows)",
            "recompute with --head-dtype fp32",
        )

    def tokens(values: np.ndarray, null: np.ndarray) -> pa.ListArray:
        return list_array(offsets, numeric_array(values, pa.float32(), null))

    # arrays from numpy buffers: pa.array would import pandas (0.3 s) at the first part (data.arrow_build)
    columns = {
        "step": numeric_array(inputs.step[rows], pa.int64()),
        "sample_id": string_array(inputs.sample_id[rows].tolist()),
        "segment_idx": numeric_array(inputs.segment_idx[rows], pa.int32()),
        "seq_hash": numeric_array(inputs.seq_hash[rows], pa.uint64()),
        "logprobs": tokens(logprobs, ~valid),
    }
    if with_entropy:
        columns["entropy"] = tokens(entropy, ~valid)
    for name, values in (kept or {}).items():
        columns[name] = tokens(values, ~valid | ~np.isfinite(values))
    recompute = {**footer_base, "part": part.plan_entry(), **({"routing": routing} if routing else {})}
    footer = {"schema": LOGPROBS_SCHEMA, RECOMPUTE_FOOTER_KEY: recompute}
    table = pa.Table.from_arrays(list(columns.values()), names=list(columns))
    write_parquet(table, out_dir / part.relpath, metadata=footer)
