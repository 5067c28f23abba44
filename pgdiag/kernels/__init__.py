"""Per-token logprobs and entropies from the LM head, without materializing the logits.

What: `lm_head_logprobs(hidden, weight, targets)` returns, for every token t,
``logprob[t] = z[t, y_t] - logsumexp(z[t])`` and ``entropy[t] = logsumexp(z[t]) - sum_j softmax(z[t])_j z[t, j]``
with ``z = (hidden @ weight.T) / temperature`` in fp32 (the entropy is that of the tempered distribution).

Why: recomputing logprobs is pgdiag's hot path, and the full (N, V) logits of an RL batch are 10-40 GB.
Both implementations reduce the vocabulary to four fp32 numbers per token (`vocab_parallel`), so memory is
O(N) beyond the inputs, and a vocab-parallel W needs one small collective per call.

How: ``impl="auto"`` resolves here, once, to "triton" for CUDA tensors and "torch" otherwise; the result says
which implementation and which head precision ran:

    impl     module                          notes
    torch    lm_head_logprobs_ref.py         chunked plain torch; the reference and the CPU path
    triton   lm_head_logprobs_triton.py      fused forward kernel (CUDA, or the Triton interpreter)

Kept sets (``kept``, a `kept_set.KeptSet`: CSR ids, or packed bitmasks): the renormalised log-prob and entropy
over each token's kept set K replace the full ones where K is not empty, and the kept mass and the
full-vocabulary log-prob and entropy come beside them (`kept_set`). K is scored inside the head itself: each
chunk of tokens gets per-row packed bitmasks of K over the shard, and the same pass over the vocabulary tiles
writes the partials of the full vocabulary and of K; under TP they travel in the same one all-gather.

Ignored tokens (``targets == ignore_index``) get logprob 0.0 and their entropy computed as usual (it does
not depend on the target). Any other target outside [0, V) raises `InvalidInputError` E208.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.distributed as dist

from pgdiag.errors import Code, InvalidInputError, UsageError
from pgdiag.kernels.kept_set import (
    KeptSet,
    engine_dot,
    finish_kept,
    kept_head_partials,
    kept_kl,
    rescore_underflow,
)
from pgdiag.kernels.vocab_parallel import PARTIAL_ROWS, finish_partials, gather_partials, merge_partials

IMPLS = ("auto", "torch", "triton")
HEAD_DTYPES = ("bf16", "fp32")


@dataclass(frozen=True)
class TokenLogprobs:
    """Per-token results of one LM-head call.

    logprobs (N,) fp32: log p(target) under the tempered distribution; 0.0 where the target is ignored.
    entropy (N,) fp32: entropy in nats of the tempered distribution.
    impl: the implementation that ran ("torch" or "triton"); head_dtype: "bf16" or "fp32";
    head_mode: the head arithmetic that ran ("bf16", "bf16x3", "fp16x3", "bf16x1", "fp16x1",
    "tf32x3" for triton; "bf16"/"fp32" for torch).
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor
    impl: str
    head_dtype: str
    head_mode: str
    kept_mass: torch.Tensor | None = (
        None  # (N,) sum of the full softmax over K (1 where K is empty); with `kept`
    )
    logprobs_full: torch.Tensor | None = None  # (N,) full-vocabulary log-probs; with `kept`
    entropy_full: torch.Tensor | None = None  # (N,) full-vocabulary entropy; with `kept`
    kept_kl: torch.Tensor | None = None  # (N,) KL(engine ‖ model) over K; with `kept.logprobs` (NaN: no set)


def resolve_impl(impl: str, device: torch.device) -> str:
    """ "auto" -> "triton" on CUDA when triton is installed, "torch" elsewhere; "torch" and "triton" are
    returned as given.

    UsageError when "triton" cannot run: E509 when the triton package is missing (it comes with CUDA builds of
    torch, or the `gpu` extra), E508 when `device` is not CUDA and the Triton interpreter (TRITON_INTERPRET=1)
    is off.
    """
    if impl not in IMPLS:
        raise UsageError(Code.BAD_OPTION_VALUE, f"impl {impl!r} is not one of {', '.join(IMPLS)}")
    if impl == "auto":
        return (
            "triton" if device.type == "cuda" and importlib.util.find_spec("triton") is not None else "torch"
        )
    if impl == "triton":
        try:
            import triton
        except ImportError:
            raise UsageError(
                Code.MISSING_PACKAGE,
                "impl 'triton' needs the triton package, which is not installed",
                "use --impl torch, or install it: pip install 'pgdiag[gpu]' (CUDA builds of torch bring it)",
            ) from None
        if device.type != "cuda" and not triton.knobs.runtime.interpret:
            raise UsageError(
                Code.DEVICE_UNAVAILABLE,
                f"impl 'triton' needs a CUDA device, got {device.type}",
                "use --impl torch (the default off CUDA), or TRITON_INTERPRET=1 for the slow Triton interpreter",
            )
    return impl


def lm_head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    head_dtype: str = "bf16",
    impl: str = "auto",
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
    ignore_index: int = -100,
    kept: KeptSet | None = None,
) -> TokenLogprobs:
    """Per-token logprobs of `targets` and entropies under ``softmax(hidden @ weight.T / temperature)``.

    hidden (N, d) bf16/fp16/fp32; weight (V_local, d), this rank's rows ``[vocab_start, vocab_start +
    V_local)`` of the head; targets (N,) integer global token ids, or `ignore_index`. head_dtype "bf16": 16-bit
    operands with fp32 products and sums; "fp32": the fp32 head of an engine (fp32 hidden, or a bf16 hidden
    passed as is: its values are exact, and the kernel then needs one MMA per tile instead of three). With `tp_group`,
    every rank of the group calls this with its own shard and the same hidden/targets; one all-gather of
    16 bytes a token merges the shards. Without it, W is the whole head (or one shard used alone).
    `kept` (N tokens, global ids in CSR or packed bitmasks): ``logprobs`` and ``entropy`` are renormalised over
    each token's kept set (full where it is empty), with ``kept_mass``, ``logprobs_full`` and ``entropy_full``
    beside them, from the same head pass; under TP the kept partials join the same one all-gather (32 bytes a
    token). A target outside its non-empty kept set raises E221.
    """
    _check_arguments(hidden, weight, targets, temperature, head_dtype)
    resolved = resolve_impl(impl, hidden.device)
    ignored = targets == ignore_index  # (N,) bool
    out_of_range = (targets < 0) & ~ignored  # (N,) checked with the other flags at the end: one host sync
    offsets_wrong = None if kept is None else _kept_offsets_wrong(kept, targets)  # () bool
    if kept is not None and kept.logprobs is not None:  # engine_dot repeats each token by its set's size
        early = {"out_of_range": out_of_range, "offsets_wrong": offsets_wrong}
        _raise_problems(_any_rows(early), early, targets, ignore_index)
    tp_active = tp_group is not None and dist.get_world_size(tp_group) > 1
    local_targets = targets.long() - vocab_start  # (N,)
    in_shard = (local_targets >= 0) & (local_targets < weight.shape[0]) & ~ignored
    local_targets = torch.where(in_shard, local_targets, -1)

    # 1. this shard's partials (S pieces) merged into (4, N)
    from pgdiag.kernels import lm_head_logprobs_ref as reference

    backend = reference
    if resolved == "triton":  # imported here so that impl="torch" works where Triton is not installed
        from pgdiag.kernels import lm_head_logprobs_triton as backend
    merged_kept = pz = None
    if kept is None:
        partials = backend.lm_head_partials(
            hidden, weight, local_targets, temperature=temperature, head_dtype=head_dtype
        )  # (S, 4, N)
        merged = merge_partials(partials)  # (4, N)
    else:  # the full and the kept partials from one head pass a chunk of tokens
        kept = kept.to(hidden.device)

        def head_of(module: ModuleType) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
            def head(
                chunk_hidden: torch.Tensor, chunk_targets: torch.Tensor, words: torch.Tensor
            ) -> torch.Tensor:
                return module.lm_head_partials(
                    chunk_hidden,
                    weight,
                    chunk_targets,
                    temperature=temperature,
                    head_dtype=head_dtype,
                    kept_words=words,
                )  # (S, 8, C)

            return head

        shard = {"vocab_start": vocab_start, "vocab_local": weight.shape[0], "impl": resolved}
        merged, merged_kept, underflow = kept_head_partials(
            head_of(backend), hidden, local_targets, kept, **shard
        )  # (4, N), (4, N), (N,) bool

        def rescore() -> None:  # rows whose K underflowed in the Triton head, scored again by the reference
            rescore_underflow(
                head_of(reference), hidden, local_targets, kept, merged_kept, underflow, **shard
            )

        if tp_active:
            if bool(underflow.any()):  # before the gather: each rank fixes its own shard's partials
                rescore()
            underflow = None
        if kept.logprobs is not None:
            pz = engine_dot(
                hidden,
                weight,
                targets,
                kept,
                vocab_start=vocab_start,
                temperature=temperature,
                head_dtype=head_dtype,
                impl=resolved,
            )  # (N,) fp64
    # 2. vocab-parallel: one all-gather of the (4, N) partials (with the kept ones: (8, N)), then the same merge
    #    on every rank
    if tp_active:
        pieces = [merged] if merged_kept is None else [merged, merged_kept]
        if pz is not None:
            pieces.append(pz.float()[None])  # Σ p_e (z_e − z_y) over this shard's ids: summed over the ranks
        gathered = gather_partials(torch.cat(pieces), tp_group)  # (world, 4, 8 or 9, N)
        merged = merge_partials(gathered[:, :PARTIAL_ROWS])
        if merged_kept is not None:
            merged_kept = merge_partials(gathered[:, PARTIAL_ROWS : 2 * PARTIAL_ROWS])
        if pz is not None:
            pz = gathered[:, 2 * PARTIAL_ROWS].double().sum(0)
    # 3. logprob and entropy; a target that no shard holds is out of the vocabulary
    logprobs, entropy, target_found = finish_partials(merged)
    missing = ~target_found & ~ignored
    head_mode = backend.head_mode_for(head_dtype, weight.dtype, hidden.dtype)
    masks = {"out_of_range": out_of_range, "offsets_wrong": offsets_wrong, "missing": missing}
    if kept is None or merged_kept is None:
        _raise_problems(_any_rows(masks), masks, targets, ignore_index)
        return TokenLogprobs(logprobs, entropy, resolved, head_dtype, head_mode)
    set_sizes = kept.set_sizes()  # (N,) ids or bits a token
    nonempty = (set_sizes > 0) & ~ignored
    scores = finish_kept(merged, merged_kept, nonempty, logprobs, entropy, set_sizes == 1)
    masks |= {"outside": ~scores.target_in_set & ~ignored, "underflow": underflow}
    found = _any_rows(masks)  # every check of the call in this one host sync
    _raise_problems(found, masks, targets, ignore_index)
    if found["underflow"]:  # rare: rows whose K underflowed in the Triton head, scored again, then the checks
        rescore()
        scores = finish_kept(merged, merged_kept, nonempty, logprobs, entropy, set_sizes == 1)
        masks["outside"] = ~scores.target_in_set & ~ignored
        _raise_problems(_any_rows(masks), masks, targets, ignore_index)
    return TokenLogprobs(
        torch.where(ignored, 0.0, scores.logprobs),
        scores.entropy,
        resolved,
        head_dtype,
        head_mode,
        kept_mass=scores.kept_mass,
        logprobs_full=scores.logprobs_full,
        entropy_full=scores.entropy_full,
        kept_kl=None if pz is None else kept_kl(scores, kept.engine_terms()[1], pz, kept.sizes() > 0),
    )


def _any_rows(masks: dict[str, torch.Tensor | None]) -> dict[str, bool]:
    """Whether each bool mask ((N,) or ()) has a set element, all read in one host sync (None: False)."""
    present = {name: mask for name, mask in masks.items() if mask is not None}
    read = torch.stack([mask.any() for mask in present.values()]).tolist() if present else []
    return {name: bool(read.pop(0)) if name in present else False for name in masks}


PROBLEMS = (  # the checks of `lm_head_logprobs`, in the order they are raised: (mask name, code, message, hint)
    (
        "out_of_range",
        Code.TOKEN_OUT_OF_VOCAB,
        "token id {target} < 0 at token {row} (ignore_index is {ignore_index})",
        "mask such tokens with ignore_index or fix the token ids",
    ),
    ("offsets_wrong", Code.BAD_TENSORS, "lm_head_logprobs: kept offsets must rise from 0 to len(ids)", None),
    (
        "missing",
        Code.TOKEN_OUT_OF_VOCAB,
        "token id {target} at token {row} is not in the vocabulary (no head row holds it)",
        "token ids must be < the head's vocab size; was the rollout tokenized for another model?",
    ),
    (
        "outside",
        Code.SAMPLED_OUTSIDE_KEPT,
        "token {row}: target {target} is not in its kept set",
        "the kept set of a position holds the token sampled there",
    ),
)


def _raise_problems(
    found: dict[str, bool], masks: dict[str, torch.Tensor | None], targets: torch.Tensor, ignore_index: int
) -> None:
    """Raise the first problem `found` (`_any_rows` of `masks`) in the order of `PROBLEMS`: a negative target
    (E208), kept offsets that do not rise from 0 to len(ids) (E513, a usage error), a target no head row holds
    (E208), a target outside its non-empty kept set (E221); the message names the first such token."""
    for name, code, message, hint in PROBLEMS:
        mask = masks.get(name)
        if not found.get(name) or mask is None:
            continue
        if hint is None:
            raise UsageError(code, message)
        row = int(mask.nonzero()[0, 0]) if mask.dim() else 0
        text = message.format(target=int(targets[row]), row=row, ignore_index=ignore_index)
        raise InvalidInputError(code, text, hint)


def _kept_offsets_wrong(kept: KeptSet, targets: torch.Tensor) -> torch.Tensor:
    """() bool tensor (no host sync): the offsets do not rise from 0 to len(ids). UsageError E513 at once when the
    kept sets' shapes do not describe the N target tokens."""
    offsets = kept.offsets
    if offsets.dim() != 1 or offsets.shape[0] != targets.shape[0] + 1 or kept.ids.dim() != 1:
        raise UsageError(
            Code.BAD_TENSORS,
            f"lm_head_logprobs: kept offsets {tuple(offsets.shape)} for {targets.shape[0]} tokens "
            f"(expected ({targets.shape[0] + 1},)), ids {tuple(kept.ids.shape)}",
        )
    offsets = offsets.to(targets.device)
    return (offsets[0] != 0) | (offsets[-1] != kept.ids.shape[0]) | (offsets[1:] < offsets[:-1]).any()


def _check_arguments(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float, head_dtype: str
) -> None:
    """Raise UsageError E503 for an option value out of range, E513 for tensors that do not fit together."""
    if not (temperature > 0.0 and temperature < float("inf")):
        raise UsageError(
            Code.BAD_OPTION_VALUE,
            f"lm_head_logprobs: temperature must be a positive finite number, got {temperature}",
        )
    if head_dtype not in HEAD_DTYPES:
        raise UsageError(
            Code.BAD_OPTION_VALUE,
            f"lm_head_logprobs: head_dtype {head_dtype!r} is not one of {', '.join(HEAD_DTYPES)}",
        )
    problems = []
    if hidden.dim() != 2 or weight.dim() != 2 or targets.dim() != 1:
        problems.append(
            f"expected hidden (N, d), weight (V, d), targets (N,); got {tuple(hidden.shape)}, "
            f"{tuple(weight.shape)}, {tuple(targets.shape)}"
        )
    elif hidden.shape[1] != weight.shape[1] or hidden.shape[0] != targets.shape[0]:
        problems.append(
            f"shapes disagree: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, "
            f"targets {tuple(targets.shape)}"
        )
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        problems.append(f"targets must be integer token ids, got {targets.dtype}")
    if hidden.device != weight.device or hidden.device != targets.device:
        problems.append(f"tensors on different devices: {hidden.device}, {weight.device}, {targets.device}")
    if problems:
        raise UsageError(Code.BAD_TENSORS, "lm_head_logprobs: " + "; ".join(problems))
