"""What a recompute decides before any weight is read: output directory, model spec, inputs, settings, parts.

What: `plan_recompute(run, model, settings, layout, device)` returns a `RecomputePlan`: where the stream goes, the
model's config (`pgdiag.recompute.model_spec`), the checked input rows (`pgdiag.recompute.inputs`), the temperature
and kept-set rules applied, the `ResolvedRecompute` settings, the part plan, the manifest and the footer shared by
every part.

Why apart: every refusal that needs no weights (E208, E502, E503, E506, E219) is raised here, so it costs no model
load and nothing is written; `pgdiag.recompute.logprobs` then only orders load, compute and write.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pgdiag import __version__
from pgdiag.data.schema import LOGPROBS_SCHEMA
from pgdiag.data.seqhash import input_fingerprint
from pgdiag.data.writing import check_destination
from pgdiag.errors import Code, UsageError
from pgdiag.kernels import resolve_impl
from pgdiag.model.checkpoint import parse_dtype
from pgdiag.model.moe import resolve_expert_impl
from pgdiag.recompute.environment import environment
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
from pgdiag.recompute.kept_rules import KeptPlan, inexact_warnings, resolve_kept_set
from pgdiag.recompute.launch import ParallelLayout
from pgdiag.recompute.model_spec import ModelSpec, read_model_spec
from pgdiag.recompute.settings import RecomputeSettings, ResolvedRecompute, resume_command

if TYPE_CHECKING:
    from pgdiag.data.runs import Run
    from pgdiag.model import CausalLM


@dataclass(frozen=True)
class RecomputePlan:
    """Everything decided before any weight is read: where, what, with which resolved settings, in which parts."""

    run: Run
    out_dir: Path
    tag: str
    spec: ModelSpec
    inputs: RecomputeInputs
    resolved: ResolvedRecompute
    parts: list[Part]
    manifest: dict[str, Any]
    footer_base: dict[str, Any]
    warnings: tuple[str, ...]
    moe: bool
    kept: KeptPlan  # where the kept sets come from (`recompute.kept_rules`)


def plan_recompute(
    run: Run | str | Path,
    model: CausalLM | str | Path,
    settings: RecomputeSettings,
    layout: ParallelLayout,
    device: str | torch.device | None,
) -> RecomputePlan:
    """Everything that needs no weights, so a refusal (E208, E502, E503, E506) costs no model load: the output
    directory, the model's config, the rows, the temperature, the resolved settings, the part plan, the manifest."""
    tag = settings.stream_tag
    run_obj = _as_run(run)
    out_dir = _output_dir(run_obj, tag, settings.out)
    check_destination(out_dir, [], overwrite=settings.overwrite, hint="--out takes a directory")
    spec = read_model_spec(model, device=device, attn=settings.attn, dtype=settings.dtype)
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
        "created_by": f"pgdiag {__version__}",
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
        "env": environment(spec.device),
        "input_fingerprint": fingerprint,
    }
    return RecomputePlan(
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
