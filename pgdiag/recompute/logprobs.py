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

How, per part: samples are packed into ``batch_tokens`` budgets (`pgdiag.recompute.packing`, which owns the next-token
shift), the model body returns hidden states ``(N, H)``, the rows that predict loss tokens ``(K, H)`` go with the
head shard to `pgdiag.kernels.lm_head_logprobs` (fp32 statistics, temperature applied in the accumulator), and the
``(K,)`` results are scattered back into per-sample lists. What is read and in which order lives in
`pgdiag.recompute.inputs`; the part files, the manifest and the resume decision in `pgdiag.recompute.output`.

    result = recompute_rank("sample_data/run_a", "sample_data/tiny-qwen", dtype="fp32")  # one process
    result = pgdiag.recompute_logprobs("sample_data/run_a", "sample_data/tiny-qwen", tp=2)  # recompute.jobs
"""

from __future__ import annotations

import contextlib
import platform
import resource
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pgdiag.data.schema import LOGPROBS_SCHEMA
from pgdiag.data.seqhash import input_fingerprint
from pgdiag.data.writing import check_destination, directory_lock, write_json
from pgdiag.errors import Code, UsageError
from pgdiag.kernels import lm_head_logprobs, resolve_impl
from pgdiag.model.checkpoint import parse_dtype
from pgdiag.model.moe import resolve_expert_impl
from pgdiag.recompute.inputs import (
    ROUTES_COLUMN,
    Part,
    RecomputeInputs,
    RouteShape,
    plan_parts,
    read_inputs,
    resolve_temperature,
    with_uniform_temperature,
)
from pgdiag.recompute.kept_batch import KeptOutput, batch_kept, sum_floats_over_ranks
from pgdiag.recompute.kept_rules import KeptPlan, hidden_bias_warning, inexact_warnings, resolve_kept_set
from pgdiag.recompute.launch import ParallelLayout, barrier, current_layout, replica_parts
from pgdiag.recompute.output import (
    MANIFEST_NAME,
    clear_output,
    discard_empty_output,
    inspect_output,
    remove_temp_files,
    write_part,
)
from pgdiag.recompute.packing import pack_samples, plan_batches, plan_micro_batches
from pgdiag.recompute.routing import footer_entry, routing_counts, write_routing_summary
from pgdiag.recompute.settings import RecomputeSettings, ResolvedRecompute, resume_command

if TYPE_CHECKING:
    from pgdiag.data.runs import Run
    from pgdiag.model import CausalLM, ModelConfig

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


@dataclass(frozen=True)
class _Plan:
    """Everything decided before any weight is read: where, what, with which resolved settings, in which parts."""

    run: Run
    out_dir: Path
    tag: str
    spec: _ModelSpec
    inputs: RecomputeInputs
    resolved: ResolvedRecompute
    parts: list[Part]
    manifest: dict[str, Any]
    footer_base: dict[str, Any]
    warnings: tuple[str, ...]
    moe: bool
    kept: KeptPlan  # where the kept sets come from (`recompute.kept_rules`)


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
    prepared = _prepare(run, model, settings, layout, device)
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
    with _writer_lock(out_dir, layout, spec.device, created):
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
                )
                if len(done) < len(parts)
                else None
            )
            if model_obj is not None:
                _check_finite_weights(model_obj, spec, layout)
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
                counts = _compute_parts(
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
            counts = _sum_over_ranks(counts, layout, spec.device)
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
                _remove_empty(created)
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
        peak_memory_bytes=_peak_memory(spec.device),
        warnings=warnings,
        routing_disagree_frac=disagree,
        truncation_bias=bias,
    )


def _prepare(
    run: Run | str | Path,
    model: CausalLM | str | Path,
    settings: RecomputeSettings,
    layout: ParallelLayout,
    device: str | torch.device | None,
) -> _Plan:
    """Everything that needs no weights, so a refusal (E208, E502, E503, E506) costs no model load: the output
    directory, the model's config, the rows, the temperature, the resolved settings, the part plan, the manifest."""
    tag = settings.stream_tag
    run_obj = _as_run(run)
    out_dir = _output_dir(run_obj, tag, settings.out)
    check_destination(out_dir, [], overwrite=settings.overwrite, hint="--out takes a directory")
    spec = _model_spec(model, device=device, attn=settings.attn, dtype=settings.dtype)
    vocab_size = _softmax_vocab(settings.softmax_vocab, run_obj, int(spec.config.vocab_size))
    moe = spec.config.moe
    if settings.routing == "replay" and moe is None:
        raise UsageError(
            Code.MISSING_SETTING,
            f"--routing replay needs a mixture-of-experts model; {spec.config.architecture} is dense",
        )
    shape = RouteShape(len(moe.sparse_layer_indices), moe.top_k, moe.num_experts) if moe else None
    kept = resolve_kept_set(run_obj, settings.kept_set)
    inputs = read_inputs(
        run_obj,
        vocab_size,
        routes=shape,
        temperatures=settings.temperature == "auto",
        kept=kept.needs_recorded,
        sampling=kept.reconstructs is not None,
    )
    if settings.routing == "replay" and inputs.routed_experts is None:
        raise UsageError(
            Code.MISSING_SETTING,
            f"--routing replay: the run has no '{ROUTES_COLUMN}' column",
            "import the rollouts with their recorded routes (slime/miles rollout_routed_experts, prime-rl "
            "routed_experts), or use --routing recompute",
        )
    temp_value, temp_source, warnings = resolve_temperature(run_obj, inputs, settings.temperature)
    if temp_value is not None:
        inputs = with_uniform_temperature(inputs)
    if kept.kept_source != "none":
        warnings = (*warnings, *inexact_warnings(run_obj, temp_value))
    experts = "none"
    if moe:
        experts = resolve_expert_impl(settings.experts, spec.device, parse_dtype(settings.dtype, "--dtype"))
    resolved = ResolvedRecompute(
        dtype=settings.dtype,
        head_dtype=settings.head_dtype,
        temperature=temp_value,
        temperature_source=temp_source,
        softmax_vocab=vocab_size,
        impl=resolve_impl(settings.impl, spec.device),
        batch_tokens=settings.batch_tokens,
        order=settings.order,
        part_samples=settings.part_samples,
        tp=layout.tp_size,
        dp=layout.dp_size,
        entropy=settings.entropy,
        attn=spec.attn,
        micro_batch=settings.micro_batch,
        routing=settings.routing,
        experts=experts,
        kept_set=kept.kept_set,
        kept_source=kept.kept_source,
    )
    model_meta = spec.meta()
    parts = plan_parts(inputs, settings.part_samples)
    fingerprint = f"{input_fingerprint(inputs.keys(range(len(inputs.step)))):016x}"
    manifest = {
        "schema": LOGPROBS_SCHEMA,
        "tag": tag,
        "created_by": f"pgdiag {_version()}",
        "model": model_meta,
        "settings": resolved.as_dict(),
        "input_fingerprint": fingerprint,
        "n_samples": len(inputs.step),
        "parts": [{"path": p.relpath, **p.plan_entry()} for p in parts],
        "resume_command": resume_command(run_obj, model_meta.get("path"), tag, resolved, settings.out),
        "complete": False,
    }
    footer_base = {
        "model": model_meta,
        "settings": resolved.as_dict(),
        "env": _environment(spec.device),
        "input_fingerprint": fingerprint,
    }
    return _Plan(
        run_obj,
        out_dir,
        tag,
        spec,
        inputs,
        resolved,
        parts,
        manifest,
        footer_base,
        tuple(warnings),
        moe is not None,
        kept,
    )


def _version() -> str:
    from pgdiag import __version__

    return __version__


def _as_run(run: Run | str | Path) -> Run:
    from pgdiag.data.runs import read_run

    return read_run(run) if isinstance(run, (str, Path)) else run


def _output_dir(run: Run, tag: str, out: str | Path | None) -> Path:
    if out is not None:
        return Path(out)
    if run.root is None:
        raise UsageError(
            Code.MISSING_SETTING,
            "RUN is not a run directory, so the recompute output has no home",
            "pass --out DIR",
        )
    return Path(run.root) / "logprobs" / tag


@dataclass(frozen=True)
class _ModelSpec:
    """The model before its weights are read: config, resolved device and attention backend, how to load it."""

    source: CausalLM | Path
    config: ModelConfig
    device: torch.device
    attn: str

    def meta(self) -> dict[str, Any]:
        """The ``pgdiag.recompute.model`` metadata."""
        return {
            "path": str(self.source.resolve()) if isinstance(self.source, Path) else None,
            "architecture": self.config.architecture,
            "config_sha256": self.config.config_sha256,
            "storage_dtype": self.config.storage_dtype,
        }

    def load(self, *, dtype: str, head_dtype: str, tp_group: Any, experts: str) -> CausalLM:
        """This rank's shard of the model (a model passed in already loaded is returned as it is)."""
        if not isinstance(self.source, Path):
            return self.source
        from pgdiag.model import load_model

        return load_model(
            self.source,
            dtype=dtype,
            head_dtype=head_dtype,
            device=self.device,
            tp_group=tp_group,
            attention=self.attn,
            experts="loop" if experts == "none" else experts,
            # one compiled kernel each for RMSNorm, RoPE and SwiGLU: +28% tokens/s on an H100 (docs/benchmarks.md)
            fuse_pointwise=torch.device(self.device).type == "cuda",
        )


def _model_spec(
    model: CausalLM | str | Path, *, device: str | torch.device | None, attn: str, dtype: str
) -> _ModelSpec:
    """Read the checkpoint's config (not its weights) and resolve the device and attention backend."""
    if not isinstance(model, (str, Path)):
        return _ModelSpec(model, model.config, model.lm_head_weight.device, str(model.attention_backend))
    from pgdiag.model import read_model_config
    from pgdiag.model.attention import resolve_attention_backend
    from pgdiag.model.checkpoint import parse_dtype

    where = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if where.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(
            Code.DEVICE_UNAVAILABLE, f"device {where} requested but CUDA is not available", "use --device cpu"
        )
    config = read_model_config(model)
    backend = resolve_attention_backend(attn, where, parse_dtype(dtype, "--dtype"))
    return _ModelSpec(Path(model), config, where, backend)


def _nonfinite_count(values: torch.Tensor) -> int:
    """Elements of `values` that are NaN or inf; a sum first (NaN and inf propagate into it), so a finite
    tensor costs one reduction and no (N,)-sized temporary."""
    if torch.isfinite(values.sum(dtype=torch.float32)):
        return 0
    return sum(int((~torch.isfinite(chunk)).sum()) for chunk in values.detach().reshape(-1).split(1 << 24))


def _check_finite_weights(model: CausalLM, spec: _ModelSpec, layout: ParallelLayout) -> None:
    """E612 when a weight of the loaded model holds NaN or inf (before anything is written). Every rank checks
    its shard and learns whether any rank found one, so all ranks raise and none waits at a barrier."""
    bad = next(((n, c) for n, p in model.named_parameters() if (c := _nonfinite_count(p))), None)
    if not _any_rank(bad is not None, layout, spec.device):
        return
    where = str(spec.source) if isinstance(spec.source, Path) else "the model"
    hint = "the checkpoint is damaged (a diverged run or a faulty conversion?): recompute with another checkpoint"
    if bad is None:
        raise UsageError(
            Code.NON_FINITE_MODEL, f"{where}: a weight of another tensor-parallel rank holds NaN or inf", hint
        )
    name, count = bad
    if isinstance(spec.source, Path):
        from pgdiag.model.checkpoint import open_tensor_source

        with open_tensor_source(spec.source) as source:
            where = str(source.file_of(name) or spec.source)
    dtype = str(dict(model.named_parameters())[name].dtype).removeprefix("torch.")
    raise UsageError(
        Code.NON_FINITE_MODEL,
        f"{where}: tensor '{name}' holds {count} NaN or inf values (loaded as {dtype})",
        hint,
    )


def _softmax_vocab(option: int | str, run: Run, config_vocab: int) -> int:
    """The number of head rows the softmax runs over: the config's vocab_size, the run's tokenizer length, or N."""
    if option == "config":
        return config_vocab
    if option == "tokenizer":
        tokenizer = (run.meta or {}).get("tokenizer") or {}
        length = tokenizer.get("tokenizer_len") if isinstance(tokenizer, dict) else None
        if not isinstance(length, int):
            raise UsageError(
                Code.MISSING_SETTING,
                "--softmax-vocab tokenizer: the run records no tokenizer length",
                "pass a number",
            )
        option = length
    if not isinstance(option, int) or not 1 <= option <= config_vocab:
        raise UsageError(
            Code.BAD_OPTION_VALUE,
            f"softmax_vocab must be 'config', 'tokenizer' or 1..{config_vocab}, got {option!r}",
        )
    return option


def _head_rows(model: CausalLM, softmax_vocab: int) -> torch.Tensor:
    """(V_used, H) this rank's head rows below `softmax_vocab` (all of them unless the softmax is restricted)."""
    weight = model.lm_head_weight  # (V_local, H)
    keep = min(max(softmax_vocab - int(model.vocab_start), 0), weight.shape[0])
    return weight if keep == weight.shape[0] else weight[:keep]


def _compute_parts(
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
                if _nonfinite_count(hidden):
                    _raise_overflow(hidden, inputs, packed.target_sample, settings.dtype)
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


def _raise_overflow(
    hidden: torch.Tensor, inputs: RecomputeInputs, target_sample: np.ndarray, dtype: str
) -> None:
    """E612 naming the first sample whose final hidden states (K, H) hold NaN or inf (finite weights, so the
    forward overflowed)."""
    row = int(target_sample[int((~torch.isfinite(hidden).all(dim=1)).nonzero()[0, 0])])
    raise UsageError(
        Code.NON_FINITE_MODEL,
        f"{inputs.source}: step {int(inputs.step[row])}, sample {inputs.sample_id[row]}: the model's hidden states "
        f"hold NaN or inf (the forward overflows in {dtype})",
        "recompute with --dtype fp32"
        if dtype != "fp32"
        else "the checkpoint's activations overflow even in fp32",
    )


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


@contextlib.contextmanager
def _writer_lock(
    out_dir: Path, layout: ParallelLayout, device: torch.device, created: list[Path]
) -> Iterator[None]:
    """Global rank 0 creates `out_dir` and holds its exclusive lock (`pgdiag.data.writing.directory_lock`)
    while the block runs; when another process holds it, every rank raises E519 (nothing of ours written)."""
    with contextlib.ExitStack() as held:
        busy: UsageError | None = None
        if layout.is_main:
            out_dir.mkdir(parents=True, exist_ok=True)
            try:
                held.enter_context(directory_lock(out_dir, wait=False))
            except UsageError as error:
                busy = error
        if _any_rank(busy is not None, layout, device):
            if layout.is_main:
                _remove_empty(created)
            raise busy or UsageError(
                Code.OUTPUT_BUSY, f"{out_dir}: another process is writing this output now"
            )
        yield


def _remove_empty(directories: list[Path]) -> None:
    """Remove those of `directories` (made by this recompute, deepest first) that are empty."""
    for directory in directories:
        if directory.is_dir() and not any(directory.iterdir()):
            directory.rmdir()


def _any_rank(flag: bool, layout: ParallelLayout, device: torch.device) -> bool:
    """Whether `flag` holds on any rank (every rank must call this)."""
    if layout.world_size == 1:
        return flag
    value = torch.tensor([int(flag)], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return bool(value.item())


def _sum_over_ranks(counts: list[int], layout: ParallelLayout, device: torch.device) -> list[int]:
    """Totals over DP replicas (TP ranks of a replica count the same tokens, so only TP rank 0 contributes)."""
    if layout.world_size == 1:
        return counts
    mine = counts if layout.is_writer else [0] * len(counts)
    total = torch.tensor(mine, dtype=torch.int64, device=device)
    torch.distributed.all_reduce(total)
    return [int(v) for v in total.tolist()]


def _environment(device: torch.device) -> dict[str, Any]:
    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {
        "pgdiag": _version(),
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "device": name,
    }


def _peak_memory(device: torch.device) -> int:
    """Peak CUDA memory allocated on `device`, else the process's peak resident set size, in bytes."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
