"""What a recompute is asked to do (`RecomputeSettings`) and what it resolved to (`ResolvedRecompute`).

`RecomputeSettings` is the frozen request of `pgdiag logprobs` and `pgdiag.recompute_logprobs`, validated when
built (E503, before any weights or rows are read); `ResolvedRecompute` is what the recompute made of it on this
machine and run (the impl and attention backend picked, the temperature found, TP x DP), recorded in the
manifest and every part's footer, so a resume must match it exactly. Torch-free: the CLI builds settings without
importing torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pgdiag.data.schema import BASE_STREAMS, TAG_PATTERN
from pgdiag.errors import Code, UsageError
from pgdiag.recompute.inputs import DEFAULT_BATCH_TOKENS, DEFAULT_PART_SAMPLES

if TYPE_CHECKING:
    from pgdiag.data.runs import Run

DTYPES = ("bf16", "fp32", "fp16")  # body dtypes (fp16: the recompute matrix of `pgdiag explain`)
HEAD_DTYPES = ("bf16", "fp32")
IMPLS = ("auto", "triton", "torch")
ORDERS = ("length", "source")
ATTENTIONS = ("auto", "sdpa", "varlen")
ROUTING_MODES = ("recompute", "replay")
EXPERTS = ("auto", "loop", "grouped")


@dataclass(frozen=True)
class RecomputeSettings:
    """The settings of one recompute (docs/recompute.md), validated when built (UsageError E503).

    `tag` None: ``rc_<dtype>_<head_dtype>``. `temperature` "auto": the run's per-token, per-row or sampling
    temperature, else 1.0. `softmax_vocab` restricts the softmax to the first N head rows ("tokenizer": the run's
    recorded tokenizer length). `kept_set` scores each token over its kept set K (docs/recompute.md, "Kept
    sets"). `micro_batch` forwards a fixed number of samples at a time instead of packing into
    `batch_tokens`. `out` None: ``RUN/logprobs/<tag>``. MoE: `routing` "replay" runs the experts recorded in the
    run's ``routed_experts`` column; `experts` picks the expert compute.
    """

    tag: str | None = None
    dtype: str = "bf16"
    head_dtype: str = "fp32"
    temperature: float | Literal["auto"] = "auto"
    impl: str = "auto"
    batch_tokens: int = DEFAULT_BATCH_TOKENS
    order: str = "length"
    micro_batch: int | None = None
    softmax_vocab: int | Literal["config", "tokenizer"] = "config"
    attn: str = "auto"
    out: str | Path | None = None
    resume: bool = True
    overwrite: bool = False
    part_samples: int = DEFAULT_PART_SAMPLES
    entropy: bool = True
    routing: str = "recompute"
    experts: str = "auto"
    kept_set: str = "auto"  # auto | recorded | reconstruct[:vllm|:sglang] | off (`recompute.kept_rules`)

    def __post_init__(self) -> None:
        for name, choices in (
            ("dtype", DTYPES),
            ("head_dtype", HEAD_DTYPES),
            ("impl", IMPLS),
            ("order", ORDERS),
            ("attn", ATTENTIONS),
            ("routing", ROUTING_MODES),
            ("experts", EXPERTS),
        ):
            if getattr(self, name) not in choices:
                raise UsageError(
                    Code.BAD_OPTION_VALUE,
                    f"{name} {getattr(self, name)!r} is not one of {', '.join(choices)}",
                )
        if self.batch_tokens < 1 or self.part_samples < 1:
            raise UsageError(
                Code.BAD_OPTION_VALUE,
                f"batch_tokens ({self.batch_tokens}) and part_samples ({self.part_samples}) must be >= 1",
            )
        if self.micro_batch is not None and self.micro_batch < 1:
            raise UsageError(Code.BAD_OPTION_VALUE, f"micro_batch must be >= 1, got {self.micro_batch}")
        temperature = self.temperature
        if temperature != "auto" and not (
            isinstance(temperature, int | float) and not isinstance(temperature, bool) and temperature > 0
        ):
            raise UsageError(
                Code.BAD_OPTION_VALUE, f"temperature must be 'auto' or a positive number, got {temperature!r}"
            )
        if not TAG_PATTERN.fullmatch(self.stream_tag) or self.stream_tag in BASE_STREAMS:
            raise UsageError(
                Code.BAD_OPTION_VALUE,
                f"invalid tag {self.stream_tag!r}",
                "use [a-z][a-z0-9_]{0,39}, not rollout/old/ref/new",
            )

    @property
    def stream_tag(self) -> str:
        """The tag the stream is written as: `tag`, else ``rc_<dtype>_<head_dtype>``."""
        return self.tag or default_tag(self.dtype, self.head_dtype)


@dataclass(frozen=True)
class ResolvedRecompute:
    """Every choice that changes the numbers of a recompute, resolved (impl, attention, temperature, TP x DP);
    a resume must match it exactly (else E502)."""

    dtype: str
    head_dtype: str
    temperature: float | None  # None: per-token values from `temperature_tok` / `temperature` columns
    temperature_source: str  # option, column (temperature_tok or temperature), sampling, default
    softmax_vocab: int  # rows of the head the softmax runs over (the config's vocab_size unless restricted)
    impl: str  # resolved: triton or torch
    batch_tokens: int
    order: str
    part_samples: int
    tp: int
    dp: int
    entropy: bool
    attn: str  # resolved attention backend of the model body
    micro_batch: int | None  # fixed samples per forward; None = pack into batch_tokens
    pack: bool = True
    deterministic: bool = False
    routing: str = "recompute"  # MoE: "recompute" (the router picks) or "replay" (the recorded experts)
    experts: str = "none"  # MoE expert compute, resolved: loop or grouped; "none" for a dense model
    kept_set: str = "off"  # scoring: recorded | reconstruct:<engine> (over K) | off (full vocabulary)
    kept_source: str = (
        "none"  # K of the kept mass: recorded | reconstruct:<engine> | none (recompute.kept_rules)
    )

    def as_dict(self) -> dict[str, Any]:
        """The settings as recorded in the manifest; the kept-set fields only when used (so that a recompute
        made before they existed still resumes)."""
        out = asdict(self)
        if self.kept_set == "off" and self.kept_source == "none":
            del out["kept_set"], out["kept_source"]
        return out


def default_tag(dtype: str, head_dtype: str) -> str:
    """``rc_<dtype>_<head_dtype>``, the tag of a recompute when none is given."""
    return f"rc_{dtype}_{head_dtype}"


def resume_command(
    run: Run, model_path: str | None, tag: str, settings: ResolvedRecompute, out: str | Path | None
) -> str:
    """The `pgdiag logprobs` command that reproduces these settings, so resumes an unfinished `tag` (the hint of
    warning W504). Options at their defaults are left out; a resolved impl/attention is left to resolve again."""
    where = run.root if run.root is not None else (run.paths[0] if run.paths else "RUN")
    words = ["pgdiag logprobs", str(where), "--model", model_path or "CKPT", "--tag", tag]
    words += ["--dtype", settings.dtype, "--head-dtype", settings.head_dtype]
    if settings.temperature_source == "option" and settings.temperature is not None:
        words += ["--temperature", f"{settings.temperature:g}"]
    if settings.impl == "triton":
        words += ["--impl", "triton"]
    optional = (
        ("--batch-tokens", settings.batch_tokens, DEFAULT_BATCH_TOKENS),
        ("--order", settings.order, "length"),
        ("--part-samples", settings.part_samples, DEFAULT_PART_SAMPLES),
        ("--micro-batch", settings.micro_batch, None),
    )
    words += [f"{option} {value}" for option, value, default in optional if value != default]
    if not settings.entropy:
        words.append("--no-entropy")
    if settings.kept_set != "off" or settings.kept_source != "none":
        words += ["--kept-set", settings.kept_set]
    if settings.tp > 1 or settings.dp > 1:
        words += ["--tp", str(settings.tp), "--dp", str(settings.dp)]
    if out is not None:
        words += ["--out", str(out)]
    return " ".join(words)
