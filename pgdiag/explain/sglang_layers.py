"""Reading SGLang's layer dumps (the rollout side of slime's layer-wise alignment) for `--layers A sglang:DIR`.

The format, as SGLang's tensor dumper writes it (``--debug-tensor-dump-output-folder``; sgl-project/sglang
19fed5ff, ``python/sglang/srt/debug_utils/tensor_dump_forward_hook.py``, with the fields slime's patch adds,
THUDM/slime 624b824a ``docker/patch/latest/sglang-deterministic.patch``, and read as slime's own comparator
``slime/utils/compare_glm52_layerwise.py`` reads it): one folder per rank, ``DIR/TP<t>_PP<p>_Rank<r>_pid<pid>/``,
holding ``Pass<NNNNN>.pt`` (one forward pass: a dict) or ``Chunk<NNNNN>.pt`` (a list of such dicts, with
``SGLANG_TENSOR_DUMP_CHUNK_SIZE`` > 1). Each dict holds, under the module's name:

* ``model.forward_batch_info.input_ids`` (N,), ``.positions`` (N,), ``.rids`` (one request id per request of
  the batch), ``.extend_seq_lens`` (tokens of each request in a prefill pass; absent in a decode pass: one
  token per request);
* ``model.layers.<i>``: decoder layer i's output as SGLang's layers return it, the pair [delta, residual] whose
  sum is the residual stream after the block (SGLang defers the residual add to the next layer's norm); the
  layer output is ``(delta.float() + residual.float())`` cast back to delta's dtype, as slime's comparator does.

Requests whose id starts with ``HEALTH_CHECK_`` are skipped. A request's tokens come in several passes (the
prompt in a prefill pass, then one token per decode pass; a prefix-cache hit leaves positions out), so a request
is a set of observed (position, token id, rows). It is matched to the run's sample whose ids have those tokens at
those positions (the first, in sample order), and compared at the observed positions only.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pgdiag.errors import Code, InvalidInputError, UsageError
from pgdiag.explain.slime_layers import DumpSequence, bad_dump, load_dump

PREFIX = "sglang:"  # `--layers A sglang:DIR`
_LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)$")
_SKIPPED_REQUESTS = ("HEALTH_CHECK_",)


def dump_files(directory: Path) -> list[Path]:
    """The pass and chunk files of every rank folder of `directory`, in order; E501 when there are none."""
    directory = Path(directory)
    folders = sorted(p for p in directory.iterdir() if p.is_dir()) if directory.is_dir() else []
    files = [f for d in folders for pattern in ("Chunk*.pt", "Pass*.pt") for f in sorted(d.glob(pattern))]
    if not files:
        raise UsageError(
            Code.INPUT_NOT_FOUND,
            f"{directory}: no SGLang layer dump (<rank folder>/Pass*.pt or Chunk*.pt)",
            "point sglang:DIR at the folder SGLang's tensor dumper writes (its debug tensor dump output folder)",
        )
    return files


def _records(path: Path) -> list[dict[str, Any]]:
    value = load_dump(path, "SGLang tensor dump")
    if isinstance(value, dict):
        return [value]
    if isinstance(value, list) and all(isinstance(v, dict) for v in value):
        return value
    raise bad_dump(path, "an SGLang tensor dump is a dict (Pass*.pt) or a list of dicts (Chunk*.pt)")


def _one(record: dict[str, Any], suffix: str, path: Path, required: bool = True) -> Any:
    found = [v for k, v in record.items() if k.endswith(suffix)]
    if len(found) == 1:
        return found[0]
    if not found and not required:
        return None
    raise bad_dump(path, f"expected one key ending in {suffix!r}, found {len(found)}")


def _layer_rows(value: Any, n: int, hidden_size: int, where: str, path: Path) -> torch.Tensor:
    """(n, H) layer output from SGLang's [delta, residual] (or one tensor)."""
    if isinstance(value, (list, tuple)) and len(value) >= 2:
        delta, residual = value[0], value[1]
        if (
            not (isinstance(delta, torch.Tensor) and isinstance(residual, torch.Tensor))
            or delta.shape != residual.shape
        ):
            raise bad_dump(path, f"{where}: delta and residual must be tensors of one shape")
        value = (delta.float() + residual.float()).to(delta.dtype)
    if not isinstance(value, torch.Tensor) or value.shape[-1] != hidden_size:
        raise bad_dump(path, f"{where} is not a tensor of hidden size {hidden_size}")
    rows = value.reshape(-1, hidden_size)
    if rows.shape[0] != n:
        raise bad_dump(path, f"{where} has {rows.shape[0]} rows for {n} tokens")
    return rows


def _observations(
    directory: Path, hidden_size: int
) -> tuple[dict[str, dict[int, tuple[int, dict[int, torch.Tensor]]]], set[int]]:
    """{request id: {position: (token id, {layer: (H,) row})}} over every file, and the dumped layers."""
    requests: dict[str, dict[int, tuple[int, dict[int, torch.Tensor]]]] = {}
    layers: set[int] | None = None
    for path in dump_files(directory):
        for record in _records(path):
            ids = torch.as_tensor(_one(record, ".forward_batch_info.input_ids", path)).reshape(-1).tolist()
            positions = (
                torch.as_tensor(_one(record, ".forward_batch_info.positions", path)).reshape(-1).tolist()
            )
            rids = _one(record, ".forward_batch_info.rids", path, required=False) or []
            lens = _one(record, ".forward_batch_info.extend_seq_lens", path, required=False)
            counts = (
                [1] * len(rids)
                if lens is None
                else [int(c) for c in torch.as_tensor(lens).reshape(-1).tolist()]
            )
            if len(counts) != len(rids) or sum(counts) != len(ids) or len(positions) != len(ids):
                raise bad_dump(
                    path, f"{len(rids)} requests of {counts} tokens do not split {len(ids)} input_ids"
                )
            rows = {
                int(m.group(1)): _layer_rows(v, len(ids), hidden_size, k, path)
                for k, v in record.items()
                if (m := _LAYER_KEY.search(k)) is not None
            }
            if layers is None:
                layers = set(rows)
            elif set(rows) != layers:
                raise bad_dump(path, f"dumps layers {sorted(rows)}, an earlier file {sorted(layers)}")
            start = 0
            for rid, count in zip(rids, counts, strict=True):
                if not str(rid).startswith(_SKIPPED_REQUESTS):
                    seen = requests.setdefault(str(rid), {})
                    for t in range(start, start + count):
                        seen.setdefault(int(positions[t]), (int(ids[t]), {i: r[t] for i, r in rows.items()}))
                start += count
    return requests, layers or set()


def match_samples(directory: Path, samples: list[np.ndarray], hidden_size: int) -> dict[int, DumpSequence]:
    """{index in `samples`: its observed rows}: each request matched to the first sample whose ids have the
    request's tokens at its positions (a position past the sample's end never matches); rows only where
    observed (`DumpSequence.observed`). E304 when no request matches a sample."""
    requests, layers = _observations(directory, hidden_size)
    found: dict[int, DumpSequence] = {}
    for rid, seen in requests.items():
        pos = np.fromiter(seen, dtype=np.int64)
        tok = np.array([seen[p][0] for p in pos.tolist()], dtype=np.int64)
        match = next(
            (
                k
                for k, ids in enumerate(samples)
                if k not in found
                and pos.max() < len(ids)
                and pos.min() >= 0
                and np.array_equal(ids[pos], tok)
            ),
            None,
        )
        if match is None:
            continue
        n = len(samples[match])
        observed = np.zeros(n, dtype=bool)
        observed[pos] = True
        hidden = {}
        for i in sorted(layers):
            rows = torch.zeros(n, hidden_size, dtype=seen[int(pos[0])][1][i].dtype)
            rows[torch.from_numpy(pos)] = torch.stack([seen[p][1][i] for p in pos.tolist()])
            hidden[i] = rows
        found[match] = DumpSequence(
            np.asarray(samples[match], dtype=np.int64), hidden, f"{directory}:{rid}", observed
        )
    if not found:
        raise InvalidInputError(
            Code.NOTHING_MATCHED,
            f"{directory}: no request of the SGLang dump has the token ids of a sample of the run",
            "pass the run whose samples the dumped engine generated, and a --tokens budget that reaches them",
        )
    return found
