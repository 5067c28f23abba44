"""Kept sets from the inference engine's outputs, as the hooks see them (docs/schema.md, "Kept sets").

What: an engine that samples with top-k / top-p / min-p can return the kept set K of every generated token. The
two shapes read here, each as the engine hands it to Python:

* vLLM (vllm-project/vllm PR #49577 "Mask Replay", merged; ``--return-sampling-mask`` / ``LLM(...,
  return_sampling_mask=True)``): ``CompletionOutput.sampling_mask``, a ``vllm.outputs.SamplingMask`` whose
  ``token_ids`` is a ``list[list[int]]``, one kept set per generated token, and, in later versions, ``logprobs``
  (``list[list[float]]``, the engine's log-prob of each kept id; ``tests/test_outputs.py``
  ``test_request_output_aggregation_preserves_sampling_mask_logprobs``). The CSR form (``token_ids`` +
  ``offsets``) is vLLM's internal ``vllm.v1.outputs.SamplingMaskLists`` (``vllm/v1/worker/gpu/sample/output.py``
  ``SamplingMaskTensors.tolists`` at 03d51b84), converted to the nested lists before the user sees it; the
  HTTP ``/inference/v1/generate`` choice carries the same nested lists as ``"sampling_mask"``.
* SGLang (sgl-project/sglang PR #27408, top-p-only admitted by #33593; ``return_sampling_mask=True``): the
  response's ``meta_info["output_token_sampling_mask"]``, one list of kept ids per output token
  (``tokenizer_manager.py`` at c60799d0 fills it; ``output_token_sampling_logprobs`` there is one renormalised
  log-prob per *token*, the sampled one's, not per kept id, so it is not a kept-set log-prob).

`completion_sets` turns either into a `RowSets` (flat ids, one count per generated token, optional log-probs)
after checking it: one set per generated token, each holding its sampled token. A payload that does not line up
is dropped (the position would otherwise be scored over the wrong set): `None`. `kept_lists` makes the
hookdump lists ``sampling_kept_ids`` / ``sampling_kept_counts`` (/ ``sampling_kept_logprobs``), one entry a row,
that the importers turn into ``sampling_kept_ids`` / ``sampling_kept_offsets``.

Light: the standard library only (no vLLM or SGLang import: attributes and keys are read as they come).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

SGLANG_MASK_KEY = "output_token_sampling_mask"
VLLM_HTTP_KEY = "sampling_mask"


@dataclass(frozen=True)
class RowSets:
    """The kept sets of one completion's generated tokens: set j is ``ids[sum(counts[:j]):sum(counts[:j+1])]``."""

    ids: list[int]
    counts: list[int]  # one per generated token
    logprobs: list[float] | None = None  # aligned with ids


def _nested(sets: Any) -> list[list[int]] | None:
    if sets is None or isinstance(sets, (str, bytes)):
        return None
    try:
        return [[int(t) for t in kept] for kept in sets]
    except (TypeError, ValueError):
        return None


def engine_sets(output: Any) -> tuple[list[list[int]] | None, list[list[float]] | None]:
    """The nested kept sets (and kept log-probs) carried by one engine output, or (None, None): a vLLM
    `CompletionOutput` (``.sampling_mask.token_ids`` / ``.logprobs``), a vLLM HTTP choice dict
    (``"sampling_mask"``), or an SGLang response / its ``meta_info`` (``"output_token_sampling_mask"``)."""
    if isinstance(output, Mapping):
        meta = output.get("meta_info", output)
        if isinstance(meta, Mapping) and meta.get(SGLANG_MASK_KEY) is not None:
            return _nested(meta[SGLANG_MASK_KEY]), None
        return _nested(output.get(VLLM_HTTP_KEY)), None
    mask = getattr(output, "sampling_mask", None)
    if mask is None:
        return None, None
    sets = _nested(getattr(mask, "token_ids", None))
    raw = getattr(mask, "logprobs", None)
    logprobs = None
    if raw is not None:
        try:
            logprobs = [[float(v) for v in row] for row in raw]
        except (TypeError, ValueError):
            logprobs = None
    return sets, logprobs


def completion_sets(output: Any, token_ids: Sequence[int]) -> RowSets | None:
    """`RowSets` of one completion whose generated tokens are `token_ids`, from its engine output (see
    `engine_sets`); None when the output carries no kept sets or they do not line up (not one set per token,
    a sampled token outside its set, kept log-probs of another shape)."""
    sets, logprobs = engine_sets(output)
    tokens = [int(t) for t in token_ids]
    if sets is None or len(sets) != len(tokens):
        return None
    if any(token not in kept for token, kept in zip(tokens, sets, strict=True)):
        return None
    if logprobs is not None and [len(r) for r in logprobs] != [len(s) for s in sets]:
        logprobs = None  # shaped otherwise: keep the sets, drop the log-probs
    ids = [t for kept in sets for t in kept]
    flat_logprobs = None if logprobs is None else [v for row in logprobs for v in row]
    return RowSets(ids, [len(kept) for kept in sets], flat_logprobs)


def kept_lists(rows: Sequence[RowSets | None]) -> dict[str, list[Any]]:
    """The hookdump lists of R rows: ``sampling_kept_ids`` and ``sampling_kept_counts`` (empty lists for a row
    without sets), and ``sampling_kept_logprobs`` when every row with sets has them; {} when no row has sets."""
    if all(row is None for row in rows):
        return {}
    out: dict[str, list[Any]] = {
        "sampling_kept_ids": [[] if row is None else list(row.ids) for row in rows],
        "sampling_kept_counts": [[] if row is None else list(row.counts) for row in rows],
    }
    if all(row is None or row.logprobs is not None for row in rows):
        out["sampling_kept_logprobs"] = [[] if row is None else list(row.logprobs or []) for row in rows]
    return out


def match_rows(
    completions: Sequence[tuple[list[int], Any]], rows: Sequence[Sequence[int]]
) -> list[Any] | None:
    """The engine outputs of `rows` (this process's completion ids, in order) among `completions` ((token ids,
    output) of everything the engine generated, in order): the contiguous slice whose token ids equal `rows`
    (under tensor parallelism a rank keeps one slice of the group's outputs); None when none matches."""
    n = len(rows)
    wanted = [[int(t) for t in row] for row in rows]
    for start in range(0, len(completions) - n + 1):
        if all(completions[start + i][0] == wanted[i] for i in range(n)):
            return [completions[start + i][1] for i in range(n)]
    return None
