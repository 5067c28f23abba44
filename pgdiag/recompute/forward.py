"""The forward passes of a recompute: every pending part packed, run through the model, scored, and written.

What: `compute_parts(model, inputs, parts, ...)` packs each part's samples into ``batch_tokens`` budgets
(`pgdiag.recompute.packing`, which owns the next-token shift), runs the model body to hidden states ``(N, H)``,
sends the rows that predict loss tokens ``(K, H)`` with the head shard to `pgdiag.kernels.lm_head_logprobs` (fp32
statistics, temperature applied in the accumulator; one call per temperature when they differ per token),
scatters the ``(K,)`` results back into the part's token-aligned arrays and writes the part
(`pgdiag.recompute.output.write_part`, TP rank 0 only). It reports a `ProgressUpdate` after every forward.

Why apart: this is the inner loop, the only code that touches the weights; `pgdiag.recompute.logprobs` decides
which parts are pending and what happens around them. Kept sets come from `pgdiag.recompute.kept_batch`,
MoE routing counts from `pgdiag.recompute.routing`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pgdiag.kernels import lm_head_logprobs
from pgdiag.recompute.finite import nonfinite_count, raise_overflow
from pgdiag.recompute.kept_batch import KeptOutput, batch_kept
from pgdiag.recompute.output import write_part
from pgdiag.recompute.packing import pack_samples, plan_batches, plan_micro_batches
from pgdiag.recompute.routing import footer_entry, routing_counts

if TYPE_CHECKING:
    from pgdiag.model import CausalLM
    from pgdiag.recompute.inputs import Part, RecomputeInputs
    from pgdiag.recompute.kept_rules import KeptPlan
    from pgdiag.recompute.launch import ParallelLayout
    from pgdiag.recompute.settings import ResolvedRecompute

_IGNORED = -100


@dataclass(frozen=True)
class ProgressUpdate:
    """Progress of this replica, sent after every forward (global rank 0 renders it)."""

    parts_done: int
    parts_total: int
    samples_done: int
    samples_total: int
    tokens_done: int  # tokens forwarded (the throughput measure)
    tokens_total: int


def compute_parts(
    model: CausalLM,
    inputs: RecomputeInputs,
    parts: list[Part],
    out_dir: Path,
    settings: ResolvedRecompute,
    footer_base: dict[str, Any],
    layout: ParallelLayout,
    progress: Callable[[ProgressUpdate], None] | None,
    *,
    tp_group: Any,
    tag: str,
    plan: KeptPlan,
    bias_sum: list[float],
) -> list[int]:
    """Compute and write `parts`; returns [tokens forwarded, loss tokens, parts computed]. With a source of
    kept sets (`plan`), adds the sum of -log kept mass over the loss tokens and their count to `bias_sum`."""
    device = model.lm_head_weight.device
    lengths = np.diff(inputs.offsets)
    cumulative = np.concatenate([[0], np.cumsum(inputs.loss_mask, dtype=np.int64)])  # (T_total+1,)
    n_loss = cumulative[inputs.offsets[1:]] - cumulative[inputs.offsets[:-1]]  # (S,)
    active = [(p, np.arange(p.start, p.stop)[n_loss[p.start : p.stop] > 0]) for p in parts]
    tokens_total = int(sum(lengths[rows].sum() for _, rows in active))
    samples_total = sum(p.stop - p.start for p in parts)
    tokens_done = samples_done = loss_done = 0
    head = _head_rows(model, settings.softmax_vocab)  # (V_used, H)
    ids_rows = [inputs.input_ids[inputs.offsets[r] : inputs.offsets[r + 1]] for r in range(len(lengths))]
    mask_rows = [inputs.loss_mask[inputs.offsets[r] : inputs.offsets[r + 1]] for r in range(len(lengths))]
    moe = model.config.moe
    sparse_layers = moe.sparse_layer_indices if moe else ()
    for done_parts, (part, rows) in enumerate(active):
        logprobs = np.zeros(int(inputs.offsets[part.stop] - inputs.offsets[part.start]), dtype=np.float32)
        entropy = np.zeros_like(logprobs)
        with_kl = plan.needs_recorded and inputs.kept is not None and inputs.kept.logprobs is not None
        kept_cols = (
            None if plan.kept_source == "none" else KeptOutput.zeros(logprobs.shape[0], with_kl=with_kl)
        )
        base = int(inputs.offsets[part.start])
        route_tokens = np.zeros(len(sparse_layers), dtype=np.int64)
        route_disagree = np.zeros(len(sparse_layers), dtype=np.int64)
        with torch.inference_mode():
            if settings.micro_batch is None:
                batches = plan_batches(lengths[rows], settings.batch_tokens, order=settings.order)
            else:
                batches = plan_micro_batches(lengths[rows], settings.micro_batch, order=settings.order)
            for batch in batches:
                packed = pack_samples(ids_rows, mask_rows, rows[batch])
                recorded = _recorded_routes(inputs, packed.sample_index)  # (N, L, k) or None
                trunk = model.forward_packed(
                    packed.input_ids.to(device),
                    packed.position_ids.to(device),
                    packed.cu_seqlens.to(device),
                    replay_experts=recorded if settings.routing == "replay" else None,
                )
                if recorded is not None:
                    tokens, disagree = routing_counts(recorded, trunk.router_topk)
                    route_tokens += tokens
                    route_disagree += disagree
                hidden = trunk.hidden  # (N, H)
                hidden = hidden.index_select(0, packed.hidden_index.to(device))  # (K, H)
                if nonfinite_count(hidden):
                    raise_overflow(hidden, inputs, packed.target_sample, settings.dtype)
                targets = packed.targets.to(device)  # (K,)
                flat = inputs.offsets[packed.target_sample] + packed.target_pos  # (K,) run token index
                for temp, select in _temperature_groups(settings.temperature, inputs.temperature, flat):
                    group_hidden = hidden if select is None else hidden[select.to(device)]
                    group_flat = flat if select is None else flat[select.numpy()]
                    group_samples = (
                        packed.target_sample if select is None else packed.target_sample[select.numpy()]
                    )
                    kept = batch_kept(
                        plan,
                        inputs,
                        group_flat,
                        group_samples,
                        hidden=group_hidden,
                        head=head,
                        temperature=temp,
                        head_dtype=settings.head_dtype,
                        tp_group=tp_group,
                        vocab_start=int(model.vocab_start),
                    )
                    result = lm_head_logprobs(
                        group_hidden,
                        head,
                        targets if select is None else targets[select.to(device)],
                        temperature=temp,
                        head_dtype=settings.head_dtype,
                        impl=settings.impl,
                        tp_group=tp_group,
                        vocab_start=int(model.vocab_start),
                        ignore_index=_IGNORED,
                        kept=kept,
                    )
                    where = group_flat - base
                    scored_full = kept is not None and plan.kept_set == "off"
                    lp = result.logprobs_full if scored_full else result.logprobs
                    ent = result.entropy_full if scored_full else result.entropy
                    logprobs[where] = lp.float().cpu().numpy()  # type: ignore[union-attr]
                    entropy[where] = ent.float().cpu().numpy()  # type: ignore[union-attr]
                    if kept_cols is not None and result.kept_mass is not None:
                        kept_cols.put(where, result.kept_mass, result.logprobs_full, bias_sum, result.kept_kl)
                tokens_done += packed.n_tokens
                loss_done += packed.n_targets
                samples_done += int(packed.sample_index.shape[0])
                if progress is not None:
                    progress(
                        ProgressUpdate(
                            done_parts, len(parts), samples_done, samples_total, tokens_done, tokens_total
                        )
                    )
        if layout.is_writer:
            routing = (
                footer_entry(sparse_layers, route_tokens, route_disagree) if route_tokens.any() else None
            )
            write_part(
                inputs, part, logprobs, entropy, out_dir, footer_base, with_entropy=settings.entropy, tag=tag,
                routing=routing, kept=None if kept_cols is None else kept_cols.columns(),
            )  # fmt: skip
        samples_done += (part.stop - part.start) - len(rows)
        if progress is not None:
            progress(
                ProgressUpdate(
                    done_parts + 1, len(parts), samples_done, samples_total, tokens_done, tokens_total
                )
            )
    return [tokens_done, loss_done, len(parts)]


def _head_rows(model: CausalLM, softmax_vocab: int) -> torch.Tensor:
    """(V_used, H) this rank's head rows below `softmax_vocab` (all of them unless the softmax is restricted)."""
    weight = model.lm_head_weight  # (V_local, H)
    keep = min(max(softmax_vocab - int(model.vocab_start), 0), weight.shape[0])
    return weight if keep == weight.shape[0] else weight[:keep]


def _recorded_routes(inputs: RecomputeInputs, sample_index: np.ndarray) -> torch.Tensor | None:
    """(N, L, k) int64 recorded experts of the packed samples' tokens, or None when the run records none."""
    if inputs.routed_experts is None:
        return None
    tokens = np.concatenate(
        [np.arange(inputs.offsets[r], inputs.offsets[r + 1]) for r in sample_index.tolist()]
    )
    return torch.from_numpy(inputs.routed_experts[tokens].astype(np.int64))


def _temperature_groups(
    uniform: float | None, per_token: np.ndarray | None, flat: np.ndarray
) -> list[tuple[float, torch.Tensor | None]]:
    """[(temperature, target selection or None for all)] for one batch's targets at run-token indices `flat`."""
    if uniform is not None or per_token is None:
        return [(1.0 if uniform is None else uniform, None)]
    temps = per_token[flat]  # (K,)
    return [(float(t), torch.from_numpy(np.flatnonzero(temps == t))) for t in np.unique(temps)]
