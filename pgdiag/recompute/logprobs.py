"""Recompute per-token log-probs and entropies of a run's stored tokens with a checkpoint (`pgdiag logprobs`).

What: `recompute_rank(run, model)` teacher-forces every sample of a run through the model and writes a
`pgdiag.logprobs/v1` stream beside it (docs/recompute.md): ``RUN/logprobs/<tag>/step=<S>/part-<NNNNN>
.parquet`` with full-length, token-aligned ``logprobs`` and ``entropy`` lists that are non-null exactly on loss
positions, and ``_manifest.json`` (settings, input fingerprint, part plan) written before work starts and again
with ``complete: true`` as the last file.

Why this shape: recompute is the expensive step, so it must survive interruption and scale out. The input is cut
into a deterministic part plan (per step, ``part_samples`` samples ordered by group_id, sample_id); each part is
computed and written atomically on its own, so ``resume`` skips parts whose footer matches the plan and a crash
loses at most the parts in flight. Data-parallel replicas own whole parts (part i goes to replica i mod dp) and
their TP rank 0 writes them; the vocab-parallel head is never gathered.

How: this module only orders the steps of one recompute (decide, lock, load, compute, mark complete). What is
decided before any weight is read lives in `pgdiag.recompute.plan` (inputs in `pgdiag.recompute.inputs`, the model
in `pgdiag.recompute.model_spec`); the forward passes and scoring of each part in `pgdiag.recompute.forward`; the
part files, the manifest and the resume decision in `pgdiag.recompute.output`; the one-writer lock and what ranks
agree on in `pgdiag.recompute.ranks`; the NaN/inf refusals (E612) in `pgdiag.recompute.finite`.

    result = recompute_rank("sample_data/run_a", "sample_data/tiny-qwen", dtype="fp32")  # one process
    result = pgdiag.recompute_logprobs("sample_data/run_a", "sample_data/tiny-qwen", tp=2)  # recompute.jobs
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pgdiag.data.writing import write_json
from pgdiag.errors import Code, UsageError
from pgdiag.recompute.environment import peak_memory
from pgdiag.recompute.finite import check_finite_weights
from pgdiag.recompute.forward import ProgressUpdate, compute_parts
from pgdiag.recompute.kept_batch import sum_floats_over_ranks
from pgdiag.recompute.kept_rules import hidden_bias_warning
from pgdiag.recompute.launch import ParallelLayout, barrier, current_layout, replica_parts
from pgdiag.recompute.model_spec import start_stream
from pgdiag.recompute.output import (
    MANIFEST_NAME,
    clear_output,
    discard_empty_output,
    inspect_output,
    remove_temp_files,
)
from pgdiag.recompute.plan import plan_recompute
from pgdiag.recompute.ranks import remove_empty_dirs, sum_over_ranks, writer_lock
from pgdiag.recompute.routing import write_routing_summary
from pgdiag.recompute.settings import RecomputeSettings, ResolvedRecompute

if TYPE_CHECKING:
    from pgdiag.data.runs import Run
    from pgdiag.model import CausalLM
    from pgdiag.model.weight_stream import WeightStream


@dataclass(frozen=True)
class RecomputeResult:
    """What a recompute wrote: the stream directory, its tag, counts over all replicas, wall time, settings."""

    path: Path
    tag: str
    n_samples: int  # samples in the plan (computed now or found on disk)
    n_tokens: int  # tokens forwarded in this call
    n_loss_tokens: int  # log-probs written in this call
    seconds: float
    settings: ResolvedRecompute
    parts_computed: int
    parts_skipped: int
    peak_memory_bytes: int
    warnings: tuple[str, ...] = ()
    routing_disagree_frac: float | None = (
        None  # MoE with recorded routes: tokens x layers whose top-k set differs
    )
    truncation_bias: float | None = None  # mean -log kept mass over the loss tokens computed now (K known)


def recompute_rank(
    run: Run | str | Path,
    model: CausalLM | str | Path,
    settings: RecomputeSettings | None = None,
    *,
    tp_group: torch.distributed.ProcessGroup | None = None,
    device: str | torch.device | None = None,
    progress: Callable[[ProgressUpdate], None] | None = None,
) -> RecomputeResult:
    """Recompute log-probs and entropy of `run` (a `pgdiag.Run` or a path) with `model` (a checkpoint directory or
    a loaded `pgdiag.model.CausalLM`) under `settings` (`RecomputeSettings`: tag, dtypes, temperature, packing,
    output, MoE routing) and write them as the stream ``settings.stream_tag``.

    Raises UsageError E503 (bad option value), E506 (a setting needs what is missing), E508 (CUDA unavailable), E502
    (output exists: complete, without resume, or made with other settings or inputs; pass `overwrite`), E519
    (another process is writing this tag now), E60x/E612 (checkpoint refused, NaN or inf weights or activations);
    InvalidInputError E102/E103/E201-E213 (bad rollouts, by the row rules of `pgdiag check`) and E219 (a
    temperature `--temperature auto` cannot use). Every refusal comes before anything is written.
    Under torch.distributed every rank calls this with the same arguments and its own `tp_group`;
    `pgdiag.recompute_logprobs` (`recompute.jobs`) starts the ranks, or runs this once in a plain process.
    MoE models: when the run has a ``routed_experts`` column, the per step and layer fraction of tokens whose
    router top-k differs from the recorded one is written to ``_routing.parquet`` in the stream
    (`pgdiag.recompute.routing`). `settings.kept_set` (docs/recompute.md, "Kept sets"): ``recorded`` /
    ``reconstruct[:vllm|:sglang]`` score each token over its kept set K (renormalised), ``off`` over the full
    vocabulary, ``auto`` picks by the stream semantics (`pgdiag.recompute.kept_rules`); with any source of K the
    stream also holds ``kept_mass`` and ``logprobs_full``.
    """
    start_time = time.perf_counter()
    settings = settings or RecomputeSettings()
    layout = current_layout(tp_group)
    # the weights start streaming onto the GPU now, while the run is read and CUDA and the compiler warm up
    stream = start_stream(model, settings, layout, device)
    try:
        return _recompute(run, model, settings, layout, tp_group, device, progress, stream, start_time)
    finally:
        if stream is not None:
            stream.close()


def _recompute(
    run: Run | str | Path,
    model: CausalLM | str | Path,
    settings: RecomputeSettings,
    layout: ParallelLayout,
    tp_group: torch.distributed.ProcessGroup | None,
    device: str | torch.device | None,
    progress: Callable[[ProgressUpdate], None] | None,
    stream: WeightStream | None,
    start_time: float,
) -> RecomputeResult:
    """`recompute_rank`'s steps, with the weights taken from `stream` where it holds them."""
    prepared = plan_recompute(run, model, settings, layout, device)
    out_dir, manifest, parts, footer_base, tag = (
        prepared.out_dir,
        prepared.manifest,
        prepared.parts,
        prepared.footer_base,
        prepared.tag,
    )
    spec, inputs, resolved, warnings = prepared.spec, prepared.inputs, prepared.resolved, prepared.warnings
    moe, plan = prepared.moe, prepared.kept
    resume, overwrite = settings.resume, settings.overwrite

    # 1. decide (every rank, before anyone writes): fresh, resume, or refuse (E502 costs no lock, no load).
    done = inspect_output(out_dir, manifest, parts, footer_base, resume=resume, overwrite=overwrite, tag=tag)

    # 2. one writer per tag: global rank 0 holds the tag directory's lock until the end (a second writer gets
    #    E519 at once, before it loads any weights), decides again under it (another writer may have finished
    #    meanwhile), loads the weights, removes the temp files a killed writer left, and writes the manifest.
    #    A failure or interruption before any part is on disk (a refused checkpoint, E60x, E612, included)
    #    removes what it wrote (a later `pgdiag check` sees no incomplete recompute); parts stay for resume.
    #    Every rank loads when any part is pending, so a load error is raised on all ranks alike and none waits
    #    at a barrier.
    disagree: float | None = None
    created = [
        d for d in (out_dir, *out_dir.parents) if not d.exists()
    ]  # removed again on failure when empty
    with writer_lock(out_dir, layout, spec.device, created):
        try:
            if (
                inspect_output(
                    out_dir, manifest, parts, footer_base, resume=resume, overwrite=overwrite, tag=tag
                )
                != done
            ):
                raise UsageError(
                    Code.OUTPUT_BUSY, f"{out_dir}: another process changed this output while the recompute started",
                    "run again",
                )  # fmt: skip
            model_obj = (
                spec.load(
                    dtype=resolved.dtype,
                    head_dtype=resolved.head_dtype,
                    tp_group=tp_group,
                    experts=resolved.experts,
                    stream=stream,
                )
                if len(done) < len(parts)
                else None
            )
            if model_obj is not None:
                check_finite_weights(model_obj, spec, layout)
                warnings = (*(f"{code}: {message}" for code, message in model_obj.load_warnings), *warnings)
            barrier()  # every rank has decided before rank 0 writes
            if layout.is_main:
                if overwrite:
                    clear_output(out_dir)
                else:
                    remove_temp_files(out_dir)
                write_json(manifest, out_dir / MANIFEST_NAME)
            barrier()

            # 3. compute this replica's pending parts; TP rank 0 writes them
            owned = replica_parts(len(parts), layout.dp_rank, layout.dp_size)
            mine = [parts[i] for i in owned if parts[i].relpath not in done]
            counts = [0, 0, 0]
            bias_sum = [0.0, 0.0]  # sum of -log kept mass over loss tokens, and their count
            if mine and model_obj is not None:
                counts = compute_parts(
                    model_obj,
                    inputs,
                    mine,
                    out_dir,
                    resolved,
                    footer_base,
                    layout,
                    progress,
                    tp_group=tp_group,
                    tag=tag,
                    plan=plan,
                    bias_sum=bias_sum,
                )
            counts = sum_over_ranks(counts, layout, spec.device)
            bias_sum = sum_floats_over_ranks(bias_sum, layout.world_size, layout.is_writer, spec.device)
            barrier()

            # 4. the marker, last: global rank 0 checks every planned part is on disk
            if layout.is_main:
                missing = [p.relpath for p in parts if not (out_dir / p.relpath).is_file()]
                if missing:
                    raise RuntimeError(
                        f"{len(missing)} planned parts missing after recompute (first: {missing[0]})"
                    )
                disagree = write_routing_summary(out_dir, [p.relpath for p in parts]) if moe else None
                write_json({**manifest, "complete": True}, out_dir / MANIFEST_NAME)
            barrier()
        except BaseException:
            if layout.is_main:
                discard_empty_output(out_dir)
                remove_empty_dirs(created)
            raise

    bias = bias_sum[0] / bias_sum[1] if bias_sum[1] else None
    warnings = (*warnings, *hidden_bias_warning(plan, bias))
    return RecomputeResult(
        path=out_dir,
        tag=tag,
        n_samples=len(inputs.step),
        n_tokens=counts[0],
        n_loss_tokens=counts[1],
        seconds=time.perf_counter() - start_time,
        settings=resolved,
        parts_computed=counts[2],
        parts_skipped=len(done),
        peak_memory_bytes=peak_memory(spec.device),
        warnings=warnings,
        routing_disagree_frac=disagree,
        truncation_bias=bias,
    )
