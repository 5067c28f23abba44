"""`pgdiag logprobs RUN --model CKPT` (alias `recompute`): recompute log-probs and entropy beside a run.

Thin shell over `pgdiag.recompute.jobs.recompute_logprobs` (which picks how to run: one process; every rank of
a ``torchrun`` job; or ``--tp N [--dp M]`` local workers it starts itself): parse options, call it once, render a
progress bar with tokens/s and ETA on stderr (global rank 0 only) and a summary; ``--json`` prints the result
object on stdout. Examples::

    pgdiag logprobs sample_data/run_a --model sample_data/tiny-qwen --dtype fp32
    pgdiag logprobs run/ --model ckpt/ --tp 2                         # starts 2 workers itself
    torchrun --nproc-per-node 4 -m pgdiag logprobs run/ --model ckpt/ --tp 2    # 2 replicas x TP 2
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, Task, TextColumn, TimeRemainingColumn
from rich.text import Text

from pgdiag.cli.common import Screen, execute, make_console, result_object
from pgdiag.cli.options import (
    MODEL,
    OUTPUT,
    PERFORMANCE,
    Fields,
    RunArg,
    choice_enum,
    option,
    same_named,
)
from pgdiag.cli.outputs import OutputSettings
from pgdiag.data.semantics import KEPT_SET_MODES
from pgdiag.recompute.inputs import DEFAULT_BATCH_TOKENS, DEFAULT_PART_SAMPLES
from pgdiag.recompute.settings import (
    ATTENTIONS,
    EXPERTS,
    HEAD_DTYPES,
    IMPLS,
    ORDERS,
    ROUTING_MODES,
    RecomputeSettings,
)

if TYPE_CHECKING:
    from pgdiag.recompute.forward import ProgressUpdate
    from pgdiag.recompute.logprobs import RecomputeResult

_PLAIN_PROGRESS_EVERY_S = 30.0


# bf16 and fp32 for body and head (fp16 bodies are for `pgdiag explain`'s matrix only)
Dtype = choice_enum("Dtype", HEAD_DTYPES)
Impl = choice_enum("Impl", IMPLS)
Order = choice_enum("Order", ORDERS)
Attention = choice_enum("Attention", ATTENTIONS)
Routing = choice_enum("Routing", ROUTING_MODES)
Experts = choice_enum("Experts", EXPERTS)
KeptSetMode = choice_enum("KeptSetMode", ("auto", *KEPT_SET_MODES))


class Device(StrEnum):
    cuda = "cuda"
    cpu = "cpu"


def _parse_temperature(value: str) -> float | str:
    if value == "auto":
        return "auto"
    try:
        number = float(value)
    except ValueError:
        raise typer.BadParameter(f"{value!r} is not 'auto' or a number") from None
    if not number > 0:
        raise typer.BadParameter(f"{value!r} must be > 0")
    return number


def _parse_softmax_vocab(value: str) -> int | str:
    if value in ("config", "tokenizer"):
        return value
    try:
        number = int(value)
    except ValueError:
        raise typer.BadParameter(f"{value!r} is not 'config', 'tokenizer' or a number") from None
    if number < 1:
        raise typer.BadParameter(f"{value!r} must be >= 1")
    return number


@dataclass(frozen=True)
class RecomputeOptions:
    """The options of `RecomputeSettings`, by the settings' own names."""

    dtype: Annotated[Dtype, typer.Option(help="Body compute dtype.", rich_help_panel=MODEL)] = Dtype.bf16
    head_dtype: Annotated[Dtype, option("--head-dtype", "LM head and softmax dtype.", MODEL)] = Dtype.fp32
    reference: Annotated[bool, option("--reference", "fp32 body and head, tag rc_ref.", MODEL)] = False
    temperature: Annotated[
        str,
        typer.Option(
            help="'auto': the run's temperature_tok per token, else its temperature per row (unusable values "
            "are refused, E219), else its sampling metadata, else 1.0; or a number > 0 for every token.",
            rich_help_panel=MODEL,
        ),
    ] = "auto"
    softmax_vocab: Annotated[
        str,
        option(
            "--softmax-vocab",
            (
                "Softmax over the config's vocab_size, the run's tokenizer length, or the first N rows "
                "(tests the padded-vocabulary gotcha)."
            ),
            MODEL,
        ),
    ] = "config"
    attn: Annotated[
        Attention,
        typer.Option(
            help="Attention backend of the body: auto = varlen on CUDA when available, else sdpa.",
            rich_help_panel=MODEL,
        ),
    ] = Attention.auto
    routing: Annotated[
        Routing,
        typer.Option(
            help="MoE models: recompute = the router picks the experts; replay = use the experts recorded in the "
            "run's routed_experts column, recomputing only their weights. With the column, the per step and layer "
            "routing/disagree_frac goes to _routing.parquet in the stream.",
            rich_help_panel=MODEL,
        ),
    ] = Routing.recompute
    kept_set: Annotated[
        KeptSetMode,
        typer.Option(
            help="Score each token over the engine's kept set K (top-k/top-p/min-p survivors, renormalised): "
            "recorded = the run's sampling_kept_* columns; reconstruct[:vllm|:sglang] = rebuild K from the "
            "model and the run's top_k/top_p/min_p in that engine's order; off = the full vocabulary. auto = "
            "recorded when K is recorded and the rollout stream is renormalised (docs/schema.md, stream "
            "semantics), else off. With any K the stream also gets kept_mass and logprobs_full.",
            rich_help_panel=MODEL,
        ),
    ] = KeptSetMode.auto
    impl: Annotated[
        Impl,
        typer.Option(help="LM-head kernel: auto = triton on CUDA, else torch.", rich_help_panel=PERFORMANCE),
    ] = Impl.auto
    experts: Annotated[
        Experts,
        typer.Option(
            help="MoE expert compute: auto = grouped GEMM on CUDA in bf16, else a loop over experts.",
            rich_help_panel=PERFORMANCE,
        ),
    ] = Experts.auto
    batch_tokens: Annotated[
        int,
        option("--batch-tokens", "Tokens per forward per replica.", PERFORMANCE, min=1),
    ] = DEFAULT_BATCH_TOKENS
    micro_batch: Annotated[
        int | None,
        option(
            "--micro-batch",
            (
                "Forward a fixed number of samples at a time (mimics a trainer's batch shape) instead of "
                "packing into --batch-tokens."
            ),
            PERFORMANCE,
            min=1,
        ),
    ] = None
    order: Annotated[
        Order,
        typer.Option(help="Pack longest first (length) or in stored order.", rich_help_panel=PERFORMANCE),
    ] = Order.length
    tag: Annotated[
        str | None, typer.Option(help="Stream tag (default rc_<dtype>_<head_dtype>).", rich_help_panel=OUTPUT)
    ] = None
    out: Annotated[
        Path | None,
        option("--out", "Output directory (default RUN/logprobs/<tag>).", OUTPUT),
    ] = None
    entropy: Annotated[bool, option("--entropy/--no-entropy", "Write the entropy column.", OUTPUT)] = True
    resume: Annotated[
        bool,
        option("--resume/--no-resume", "Skip parts already written by an interrupted job.", OUTPUT),
    ] = True
    part_samples: Annotated[int, option("--part-samples", "Samples per output part.", OUTPUT, min=1)] = (
        DEFAULT_PART_SAMPLES
    )

    def settings(self, *, overwrite: bool) -> RecomputeSettings:
        """The frozen `RecomputeSettings` (`--reference`: fp32 body and head, tag rc_ref)."""
        body, head = (Dtype.fp32, Dtype.fp32) if self.reference else (self.dtype, self.head_dtype)
        return same_named(
            RecomputeSettings,
            self,
            tag=self.tag or ("rc_ref" if self.reference else None),
            dtype=body.value,
            head_dtype=head.value,
            temperature=_parse_temperature(self.temperature),
            softmax_vocab=_parse_softmax_vocab(self.softmax_vocab),
            overwrite=overwrite,
        )


ModelOpt = Annotated[
    Path,
    option("--model", "Checkpoint directory (config.json + safetensors).", MODEL),
]


def logprobs(
    run: RunArg,
    *,
    model: ModelOpt,
    options: RecomputeOptions,
    tp: Annotated[
        int | None,
        option("--tp", "Tensor-parallel degree (default: the torchrun world / dp).", PERFORMANCE, min=1),
    ] = None,
    dp: Annotated[int | None, option("--dp", "Data-parallel replicas.", PERFORMANCE, min=1)] = None,
    device: Annotated[
        Device | None,
        typer.Option(help="cuda or cpu (default: cuda when available).", rich_help_panel=PERFORMANCE),
    ] = None,
    output: Annotated[OutputSettings, Fields("overwrite", "json_out", "quiet", "verbose")],
) -> None:
    """Recompute per-token log-probs and entropy of RUN's stored tokens with a checkpoint, at loss positions."""
    rank = int(os.environ.get("RANK", "0"))

    def body(screen: Screen) -> dict[str, Any]:
        from pgdiag.recompute.jobs import recompute_logprobs

        settings = options.settings(overwrite=output.overwrite)
        where = None if device is None else device.value
        progress = ProgressRenderer(quiet=output.quiet)
        result = recompute_logprobs(run, str(model), settings, tp=tp, dp=dp, device=where, progress=progress)
        if result is None:  # a non-zero rank of a torchrun job: rank 0 reports
            return result_object("logprobs")
        _render_summary(screen.results, result, verbose=output.verbose)
        return _result_json(result, run)

    execute("logprobs", body, json_out=output.json_out and rank == 0, quiet=output.quiet or rank != 0)


class _TokensPerSecond(ProgressColumn):
    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text("-- tok/s" if speed is None else f"{speed:,.0f} tok/s")


class ProgressRenderer:
    """Progress callback: a Rich bar (tokens, tok/s, ETA) on a terminal, one plain line every 30 s otherwise.

    Picklable until entered (the recompute's local workers receive it); the console is made on entry, in the
    process that renders (global rank 0).
    """

    def __init__(self, *, quiet: bool) -> None:
        self.quiet = quiet

    def __enter__(self) -> ProgressRenderer:
        self.console = make_console(quiet=self.quiet)
        self.live = self.console.is_terminal and not self.console.quiet
        self.progress = Progress(
            TextColumn("recompute"),
            BarColumn(),
            TextColumn("{task.completed:,.0f}/{task.total:,.0f} tokens"),
            _TokensPerSecond(),
            TimeRemainingColumn(),
            console=self.console,
            transient=True,
        )
        self.task: int | None = None
        self.start = time.perf_counter()
        self.last_line = self.start
        if self.live:
            self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live:
            self.progress.stop()

    def __call__(self, update: ProgressUpdate) -> None:
        if self.live:
            if self.task is None:
                self.task = self.progress.add_task("recompute", total=max(update.tokens_total, 1))
            self.progress.update(self.task, completed=update.tokens_done)
            return
        now = time.perf_counter()
        if now - self.last_line >= _PLAIN_PROGRESS_EVERY_S and not self.console.quiet:
            self.last_line = now
            rate = update.tokens_done / max(now - self.start, 1e-9)
            eta = (update.tokens_total - update.tokens_done) / rate if rate > 0 else float("inf")
            self.console.print(
                f"recompute: {update.tokens_done:,}/{update.tokens_total:,} tokens, part "
                f"{update.parts_done}/{update.parts_total}, {rate:,.0f} tok/s, ETA {eta:,.0f} s",
                markup=False,
            )


def _render_summary(console: Console, result: RecomputeResult, *, verbose: bool) -> None:
    rate = result.n_tokens / result.seconds if result.seconds > 0 else 0.0
    settings = result.settings
    lines = [
        f"logprobs/{result.tag}: {result.n_samples:,} samples ({result.parts_computed} parts computed, "
        f"{result.parts_skipped} resumed), {result.n_tokens:,} tokens in {result.seconds:.1f} s "
        f"({rate:,.0f} tok/s), peak memory {result.peak_memory_bytes / 2**20:,.0f} MiB",
        f"dtype {settings.dtype}, head {settings.head_dtype}, impl {settings.impl}, temperature "
        f"{settings.temperature if settings.temperature is not None else 'per-token'} ({settings.temperature_source}), "
        f"tp {settings.tp} x dp {settings.dp} -> {result.path}",
    ]
    if result.routing_disagree_frac is not None:
        lines.append(
            f"routing ({settings.routing}): {result.routing_disagree_frac:.2%} of recorded token x layer routes "
            f"differ from the router's top-k -> {result.path / '_routing.parquet'}"
        )
    if result.truncation_bias is not None:
        lines.append(
            f"kept sets ({settings.kept_set}, K {settings.kept_source}): mean -log kept mass "
            f"{result.truncation_bias:.4g} nats a loss token -> kept_mass, logprobs_full in the stream"
        )
    for line in lines:
        console.print(line, markup=False, soft_wrap=True)
    for warning in result.warnings:
        console.print(Text.assemble(("warning", "yellow"), f" {warning}"), soft_wrap=True)
    if verbose:
        console.print(f"settings: {result.settings.as_dict()}", markup=False, soft_wrap=True)


def _result_json(result: RecomputeResult, run: str) -> dict[str, Any]:
    rate = result.n_tokens / result.seconds if result.seconds > 0 else None
    checks = [
        {
            "code": w.split(":", 1)[0],
            "severity": "warning",
            "count": 1,
            "message": w.split(": ", 1)[-1],
            "examples": [],
        }
        for w in result.warnings
    ]
    return result_object(
        "logprobs",
        inputs={"runs": [run], "n_samples": result.n_samples, "n_tokens": result.n_tokens},
        summary={
            result.tag: {
                "path": str(result.path),
                "n_samples": result.n_samples,
                "n_tokens": result.n_tokens,
                "n_loss_tokens": result.n_loss_tokens,
                "tokens_per_s": rate,
                "seconds": result.seconds,
                "parts_computed": result.parts_computed,
                "parts_skipped": result.parts_skipped,
                "peak_memory_bytes": result.peak_memory_bytes,
                "routing/disagree_frac": result.routing_disagree_frac,
                "mismatch/truncation_bias": result.truncation_bias,
                "settings": result.settings.as_dict(),
            }
        },
        checks=checks,
        files={"logprobs": str(result.path)},
    )
