"""Reading slime's layer-wise alignment dumps (the Megatron trainer side) for `explain --layers A slime:DIR`.

The format, as slime writes it (THUDM/slime 624b824a, ``slime/backends/megatron_utils/alignment/
layerwise_alignment.py``, ``_MegatronLayerwiseDumper``; enabled by ``SLIME_LAYERWISE_ALIGNMENT_DUMP_DIR`` with
``--megatron-deepgemm-forward-layers`` naming the layers): one file per forward pass of each rank,
``DIR/rank<RRRRR>/<store_prefix>_Pass<PPPPP>.pt`` (``actor`` is the prefix of the policy), each a
``torch.save`` of a plain dict:

* ``input_ids`` (1, T) int64: the packed micro-batch of slime's ``get_batch`` (``megatron_utils/data.py``):
  every sample's tokens end to end, the stream padded with token 0 to a multiple of TP × 128, the padding one
  more ``cu_seqlens`` segment;
* ``cu_seqlens`` (S + 1,) int32: sample s owns tokens ``cu_seqlens[s]:cu_seqlens[s + 1]``;
* ``layers`` {layer id: tensor}: the output hidden states of decoder block ``layer id`` (0-based: Megatron's
  ``layer_number`` − 1; only the selected layers), the first tensor of the block's output, Megatron's
  sequence-first (T, 1, H) layout, in the training dtype;
* ``store_prefix`` and ``modules`` (other modules' outputs, by name): not read.

A block's output there is what pgdiag's layer hook sees after block i (the residual stream after attention and
MLP), so the two compare row for row. slime's own comparator (``slime/utils/compare_glm52_layerwise.py``) reads
the same files the same way (rows reshaped to (T, H), all-zero padding segments skipped).

Not read: context-parallel dumps (each rank holds a slice of every sequence; ``cu_seqlens`` are then the
global lengths, so they do not add up to the file's tokens) and sequence-parallel shards (fewer rows than
tokens): both are E703, as is a torn file or a missing key. Files load with ``weights_only=True``: a pickle
that names any global is refused (E703 naming it), nothing in the file runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pgdiag.errors import Code, InvalidInputError, UsageError

_FILE = re.compile(r"^(.+)_Pass(\d+)\.pt$")
PREFIX = "slime:"  # `--layers A slime:DIR`


@dataclass(frozen=True)
class DumpSequence:
    """One sample of a dump: its token ids and the dumped blocks' outputs."""

    ids: np.ndarray  # (n,) int64
    hidden: dict[int, torch.Tensor]  # layer id -> (n, H) in the dump's dtype
    source: str  # file and segment, for messages
    observed: np.ndarray | None = (
        None  # (n,) bool: positions the dump holds (None: all; SGLang: those it ran)
    )


def dump_files(directory: Path, store_prefix: str = "actor") -> list[Path]:
    """The pass files of `directory` (the dump root with ``rank*/`` folders, or one rank folder), ranks and
    passes in order; E501 when there are none."""
    directory = Path(directory)
    ranks = sorted(p for p in directory.glob("rank*") if p.is_dir()) or [directory]
    files = [
        f for rank in ranks for f in sorted(rank.glob(f"{store_prefix}_Pass*.pt")) if _FILE.match(f.name)
    ]
    if not files:
        raise UsageError(
            Code.INPUT_NOT_FOUND,
            f"{directory}: no slime layer dump (rank*/{store_prefix}_Pass*.pt)",
            "point slime:DIR at SLIME_LAYERWISE_ALIGNMENT_DUMP_DIR",
        )
    return files


def bad_dump(path: Path, what: str) -> InvalidInputError:
    """E703 (a torn or misshapen dump) of a layer dump file: `path` and what is wrong with it."""
    return InvalidInputError(Code.BAD_DUMP_LAYOUT, f"{path}: {what}")


def load_dump(path: Path, kind: str) -> Any:
    """The object a `kind` dump file (``slime layer dump``, ``SGLang tensor dump``) holds, memory-mapped on the
    CPU with ``weights_only``; a file torch cannot read is a `bad_dump` naming why."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:  # a torn zip, a pickle naming a global: the message names which
        raise bad_dump(path, f"not a readable {kind} ({str(error).splitlines()[0][:200]})") from None


def read_pass(path: Path, hidden_size: int) -> list[DumpSequence]:
    """The non-padding sequences of one pass file (module docstring), each with every dumped layer's rows."""
    record = load_dump(path, "slime layer dump")
    if not isinstance(record, dict) or not {"input_ids", "cu_seqlens", "layers"} <= set(record):
        raise bad_dump(path, "a slime layer dump is a dict with input_ids, cu_seqlens and layers")
    ids = torch.as_tensor(record["input_ids"]).reshape(-1).to(torch.int64).numpy()  # (T,)
    bounds = torch.as_tensor(record["cu_seqlens"]).reshape(-1).to(torch.int64).tolist()
    if not bounds or bounds[0] != 0 or bounds[-1] != ids.shape[0] or any(b > c for b, c in pairwise(bounds)):
        raise bad_dump(
            path,
            f"cu_seqlens {bounds[:4]}…{bounds[-1:]} do not split the {ids.shape[0]} input_ids "
            "(a context-parallel dump is not read)",
        )
    layers = record["layers"]
    if not isinstance(layers, dict) or not layers:
        raise bad_dump(path, "layers holds no dumped block")
    rows: dict[int, torch.Tensor] = {}
    for layer_id, value in layers.items():
        if not isinstance(value, torch.Tensor) or value.shape[-1] != hidden_size:
            raise bad_dump(path, f"layer {layer_id} is not a tensor of hidden size {hidden_size}")
        flat = value.reshape(-1, hidden_size)  # Megatron's (T, 1, H) -> (T, H)
        if flat.shape[0] != ids.shape[0]:
            raise bad_dump(
                path,
                f"layer {layer_id} has {flat.shape[0]} rows for {ids.shape[0]} tokens (a sequence-parallel "
                "shard is not read)",
            )
        rows[int(layer_id)] = flat
    return [
        DumpSequence(ids[a:b], {i: r[a:b] for i, r in rows.items()}, f"{path}:segment{s}")
        for s, (a, b) in enumerate(pairwise(bounds))
        if b > a and np.any(ids[a:b] != 0)  # the padding segment is all token 0
    ]


def match_samples(directory: Path, samples: list[np.ndarray], hidden_size: int) -> dict[int, DumpSequence]:
    """{index in `samples`: its dump sequence}: the first sequence (ranks, passes, segments in order) whose ids
    equal the sample's; the same sequence dumped by several TP ranks or passes is read once. E304 when no
    sample has one, E703 when the dumped layers differ between files."""
    wanted: dict[bytes, int] = {}
    for index, ids in enumerate(samples):
        wanted.setdefault(np.asarray(ids, dtype=np.int64).tobytes(), index)
    found: dict[int, DumpSequence] = {}
    layers: set[int] | None = None
    for path in dump_files(directory):
        for sequence in read_pass(path, hidden_size):
            if layers is None:
                layers = set(sequence.hidden)
            elif set(sequence.hidden) != layers:
                raise bad_dump(
                    path, f"dumps layers {sorted(sequence.hidden)}, an earlier file {sorted(layers)}"
                )
            index = wanted.get(sequence.ids.tobytes())
            if index is not None and index not in found:
                found[index] = sequence
    if not found:
        raise InvalidInputError(
            Code.NOTHING_MATCHED,
            f"{directory}: no sequence of the slime layer dump has the token ids of a sample of the run",
            "pass the run whose samples the dumped forward scored, and a --tokens budget that reaches them",
        )
    return found
