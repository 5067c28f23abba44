"""Every command-line option of pgdiag, declared once, and the option groups commands share.

An option used by several commands (`--html`, `--divisor`, `--aggregation`, ...) is one `Annotated` alias here,
with one help text. Options that always travel together are a frozen dataclass (a *group*: `RunInputs`,
`CheckOptions`, `GateOptions`, `MetricOptions`, `OutputSettings`); a command takes a group as one parameter and
`flat_command` spreads its fields into Typer options, so a command names each group once and gets it back built.
A command that offers only some fields of a group says which with ``Annotated[Group, Fields("a", "b")]``; the
others keep their defaults.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass, fields
from enum import Enum, StrEnum
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from pgdiag.data.validate import CheckSettings
from pgdiag.metrics.settings import MetricSettings

# Help panels.
INPUTS = "Inputs"
STREAMS = "Streams"
ALIGNMENT = "Alignment"
METRICS = "Metrics"
MODEL = "Model"
PERFORMANCE = "Performance"
THRESHOLDS = "Thresholds"
OUTPUT = "Output"
SAFETY = "Safety"

_METRIC_DEFAULTS = MetricSettings()
SettingsT = TypeVar("SettingsT")  # a settings dataclass (`same_named`)


class KeyStyle(StrEnum):
    pgdiag = "pgdiag"
    fast_llm = "fast-llm"
    verl = "verl"
    trl = "trl"
    liger = "liger"
    miles = "miles"
    pipelinerl = "pipelinerl"


class MetricReduction(StrEnum):
    token = "token"
    sample = "sample"
    document = "document"


class Level(StrEnum):
    token = "token"
    sequence = "sequence"


class EmptySeqs(StrEnum):
    count = "count"
    skip = "skip"


class MetricBreakdown(StrEnum):
    lag = "lag"


# the defaults of the enum options: MetricSettings' own
_KEY_STYLE = KeyStyle(_METRIC_DEFAULTS.key_style)
_LEVEL = Level(_METRIC_DEFAULTS.level)
_EMPTY_SEQS = EmptySeqs(_METRIC_DEFAULTS.empty_seqs)
_METRIC_REDUCTION = MetricReduction(_METRIC_DEFAULTS.metric_reduction)


def option(flag: str, text: str, panel: str, *short: str, **extra: Any) -> Any:
    """A Typer option: its flag, help text and help panel, then short flags and any other `typer.Option` keyword."""
    return typer.Option(flag, *short, help=text, rich_help_panel=panel, **extra)


RunArg = Annotated[
    str,
    typer.Argument(help="A run directory, a directory of Parquet files, a .parquet file, or a quoted glob."),
]
StepsOpt = Annotated[
    str | None, option("--steps", "Steps to read: N, A-B (inclusive), comma lists, or 'last'.", INPUTS)
]
RunNameOpt = Annotated[str | None, option("--run", "Keep only rows of this run label.", INPUTS)]
LabelOpt = Annotated[str | None, option("--label", "Override the run label shown in reports.", INPUTS)]
AttachOpt = Annotated[
    list[Path] | None, option("--attach", "Attach a recompute output directory (repeatable).", INPUTS)
]
IgnoreOpt = Annotated[
    list[str] | None, option("--ignore", "Silence a check code, e.g. W217 (repeatable).", ALIGNMENT)
]
StrictOpt = Annotated[bool, option("--strict/--no-strict", "Warnings exit 1.", ALIGNMENT)]
MaxExamplesOpt = Annotated[
    int, option("--max-examples", "Locations listed per check message.", ALIGNMENT, min=1)
]
FailOnOpt = Annotated[
    list[str] | None,
    option("--fail-on", "Gate: exit 1 when EXPR holds, e.g. 'policy/clip_frac_binding>0.2'.", THRESHOLDS),
]
WarnOnOpt = Annotated[
    list[str] | None, option("--warn-on", "Gate: print a warning when EXPR holds.", THRESHOLDS)
]
ProfileOpt = Annotated[
    str | None,
    option("--profile", "Threshold set: recommended, nemo, verl, slime, deterministic, exact.", THRESHOLDS),
]
ExitZeroOpt = Annotated[bool, option("--exit-zero", "Exit 0 when a gate fails (2 and 3 stay).", THRESHOLDS)]
JsonOpt = Annotated[
    bool, option("--json", "Print the result object as JSON on stdout (and nothing else there).", OUTPUT)
]
OutOpt = Annotated[
    Path | None, option("--out", "Write the report: a directory or a .parquet file name.", OUTPUT)
]
HtmlOpt = Annotated[
    Path | None, option("--html", "Write a one-file HTML report (verdict, tables, plots).", OUTPUT)
]
PlotOpt = Annotated[
    Path | None, option("--plot", "Write the command's figure here (.png/.svg/.pdf).", OUTPUT)
]
OverwriteOpt = Annotated[bool, option("--overwrite", "Replace existing output files.", OUTPUT)]
ToTensorboardOpt = Annotated[
    Path | None,
    option("--to-tensorboard", "Write the per-step scalars as TensorBoard events in this directory.", OUTPUT),
]
ToWandbOpt = Annotated[
    str | None,
    option(
        "--to-wandb",
        "Log the per-step scalars as a W&B run of this project (offline unless WANDB_MODE is set).",
        OUTPUT,
        metavar="PROJECT",
    ),
]
WandbDirOpt = Annotated[
    Path | None,
    option(
        "--wandb-dir",
        "Where --to-wandb writes its wandb/ folder [default: beside the --out report, else here].",
        OUTPUT,
    ),
]
QuietOpt = Annotated[
    bool, option("--quiet", "No tables or progress; errors still go to stderr.", OUTPUT, "-q")
]
VerboseOpt = Annotated[bool, option("--verbose", "More detail.", OUTPUT, "-v")]

# metric options (metrics; compare --metrics and drift take some of them)
NewOpt = Annotated[
    str | None,
    option("--new", "Stream of the evaluated policy (default: new, else the single recompute tag).", STREAMS),
]
OldOpt = Annotated[
    str | None, option("--old", "Stream of the behaviour policy (default: old, else rollout).", STREAMS)
]
AggregationOpt = Annotated[
    str | None,
    option(
        "--aggregation",
        "Headline loss/pg mode: token_mean, sample_mean, prompt_mean, constant, seq_mean_token_sum, token_sum, "
        "gspo_seq_mean, gspo_length_prop, gspo_token_mean, or a framework alias (verl seq-mean-token-sum-norm, "
        "TRL dr_grpo, fast-llm:grpo, ...). All modes are always reported. Default: token_mean; under "
        "--key-style, the framework's own default.",
        METRICS,
    ),
]
DivisorOpt = Annotated[
    float | None,
    option("--divisor", "L of the `constant` loss mode (loss = sum / (L * S)); required for it.", METRICS),
]
EpsLowOpt = Annotated[float, option("--eps-low", "Clip band low side: ratio < 1 - eps-low.", METRICS)]
EpsHighOpt = Annotated[float, option("--eps-high", "Clip band high side: ratio > 1 + eps-high.", METRICS)]
KeyStyleOpt = Annotated[
    KeyStyle,
    option("--key-style", "A framework's own keys with its exact definitions (docs/key-styles.md).", METRICS),
]


@dataclass(frozen=True)
class Fields:
    """``Annotated[Group, Fields(...)]``: the fields of a group a command offers (the rest keep their defaults)."""

    names: tuple[str, ...]

    def __init__(self, *names: str) -> None:
        object.__setattr__(self, "names", names)


def flat_command(func: Callable[..., None]) -> Callable[..., None]:
    """`func` with every group parameter spread into its fields' Typer options and rebuilt before the call."""
    hints = typing.get_type_hints(func, include_extras=True)
    parameters: list[inspect.Parameter] = []
    groups: dict[str, tuple[type, list[str]]] = {}
    for name, parameter in inspect.signature(func).parameters.items():
        hint, offered = hints[name], None
        if typing.get_origin(hint) is Annotated:
            base, *extras = typing.get_args(hint)
            marks = [e for e in extras if isinstance(e, Fields)]
            if dataclasses.is_dataclass(base) and marks:
                hint, offered = base, marks[0].names
        if not (isinstance(hint, type) and dataclasses.is_dataclass(hint)):
            parameters.append(parameter.replace(annotation=hint))
            continue
        field_hints = typing.get_type_hints(hint, include_extras=True)
        names = [f.name for f in fields(hint) if f.init and (offered is None or f.name in offered)]
        defaults = {f.name: f.default for f in fields(hint)}
        parameters += [
            inspect.Parameter(
                n, inspect.Parameter.KEYWORD_ONLY, default=defaults[n], annotation=field_hints[n]
            )
            for n in names
        ]
        groups[name] = (hint, names)

    @functools.wraps(func)
    def command(**values: Any) -> None:
        for name, (group, names) in groups.items():
            values[name] = group(**{n: values.pop(n) for n in names})
        func(**values)

    del command.__wrapped__  # Typer reads the spread signature, not func's
    command.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in parameters}
    return command


def same_named(target: type[SettingsT], group: Any, **given: Any) -> SettingsT:
    """The settings dataclass `target` built from the fields of the option group `group` that it has by the same
    name (an enum member as its value), with `given` on top: the one place an option group's fields are copied
    into its settings, so a field added to both needs no third line."""
    wanted = {f.name for f in fields(target) if f.init}
    values = {f.name: getattr(group, f.name) for f in fields(group) if f.name in wanted}
    values = {name: value.value if isinstance(value, Enum) else value for name, value in values.items()}
    return target(**{**values, **given})


def choice_enum(name: str, values: tuple[str, ...]) -> type[StrEnum]:
    """A Typer choice over `values`, the settings' own tuple, so each list of choices is written once (member
    names: the values with ``:`` and ``-`` as ``_``)."""
    return StrEnum(name, [(value.replace(":", "_").replace("-", "_"), value) for value in values])


def listed(values: list[Any] | None) -> tuple[Any, ...]:
    """A repeatable option's values as a tuple (Typer gives None when absent)."""
    return tuple(values or ())


@dataclass(frozen=True)
class RunInputs:
    """Which rows of a run to read: `--steps`, `--run`, `--label`, `--attach`."""

    steps: StepsOpt = None
    run_name: RunNameOpt = None
    label: LabelOpt = None
    attach: AttachOpt = None

    def read(self, path: str, *, first: bool = True) -> Any:
        """The `Run` at `path`; `--label` and `--attach` apply to the first run of a command only."""
        from pgdiag.data.runs import read_run

        if not first:
            return read_run(path, steps=self.steps, run=self.run_name)
        named = {} if self.label is None else {"label": self.label}
        return read_run(path, **named, attach=listed(self.attach), steps=self.steps, run=self.run_name)


@dataclass(frozen=True)
class CheckOptions:
    """`--ignore` and `--max-examples`: what the input checks report."""

    ignore: IgnoreOpt = None
    max_examples: MaxExamplesOpt = CheckSettings().max_examples

    def settings(self) -> CheckSettings:
        return CheckSettings(ignore=listed(self.ignore), max_examples=self.max_examples)


@dataclass(frozen=True)
class GateOptions:
    """`--fail-on`, `--warn-on`, `--profile`, `--strict`, `--exit-zero`: the gates and the exit rule."""

    fail_on: FailOnOpt = None
    warn_on: WarnOnOpt = None
    profile: ProfileOpt = None
    strict: StrictOpt = False
    exit_zero: ExitZeroOpt = False

    def settings(self) -> Any:
        """The `report.gates.GateSettings` (a report's default gates apply beside them: `report.gates.outcome`)."""
        from pgdiag.report.gates import GateSettings

        return same_named(GateSettings, self, fail_on=listed(self.fail_on), warn_on=listed(self.warn_on))


LossesOpt = Annotated[
    str | None,
    option(
        "--losses",
        "Gradient parity of two losses FORM@MODE,FORM@MODE (docs/whatif.md).",
        METRICS,
    ),
]


def loss_folds(run: Any, losses: str | None, divisor: float | None) -> list[Any]:
    """`--losses A,B`: the loss-parity fold of `run` that `metrics` and `compare` feed (none without the option)."""
    if losses is None:
        return []
    from pgdiag.analysis.loss_fold import LossParitySettings, loss_parity_fold

    return [loss_parity_fold(run, LossParitySettings(losses, divisor=divisor))]


@dataclass(frozen=True)
class MetricOptions:
    """Every option of `MetricSettings` (and its `ClipBand` and `StyleOptions`), by its flat name."""

    new: NewOpt = None
    old: OldOpt = None
    stream_a: Annotated[
        str | None, option("--stream-a", "Mismatch pair, sampling side (default: rollout).", STREAMS)
    ] = None
    stream_b: Annotated[
        str | None, option("--stream-b", "Mismatch pair, evaluated side (default: old, else new).", STREAMS)
    ] = None
    ref: Annotated[
        str | None, option("--ref", "Reference-policy stream (default: ref when present).", STREAMS)
    ] = None
    entropy: Annotated[
        str | None, option("--entropy", "Recompute tag whose entropy feeds entropy/*.", STREAMS)
    ] = None
    aggregation: AggregationOpt = _METRIC_DEFAULTS.aggregation
    divisor: DivisorOpt = None
    grad_divisor: Annotated[
        float | None,
        option(
            "--grad-divisor",
            "Extra gradient scale under a separate divisor G (grad/grad_divisor_*).",
            METRICS,
        ),
    ] = None
    eps_low: EpsLowOpt = _METRIC_DEFAULTS.clip.eps_low
    eps_high: EpsHighOpt = _METRIC_DEFAULTS.clip.eps_high
    dual_clip: Annotated[
        float | None,
        option("--dual-clip", "Dual clip C > 1 for A < 0 (off by default; verl always uses 3).", METRICS),
    ] = None
    level: Annotated[
        Level, option("--level", "Ratio level for key styles (token or sequence = GSPO).", METRICS)
    ] = _LEVEL
    empty_seqs: Annotated[
        EmptySeqs,
        option("--empty-seqs", "Whether fully masked samples count in S for the loss modes.", METRICS),
    ] = _EMPTY_SEQS
    metric_reduction: Annotated[
        MetricReduction,
        option(
            "--metric-reduction",
            "How per-token metrics are averaged: token (sum/N), sample (mean of sample means), document.",
            METRICS,
        ),
    ] = _METRIC_REDUCTION
    docs_per_step: Annotated[
        int | None,
        option(
            "--docs-per-step",
            "Ignore `step`; cut rows, in read order, into steps of N documents (Fast-LLM schedule).",
            METRICS,
            min=1,
        ),
    ] = None
    key_style: KeyStyleOpt = _KEY_STYLE
    zero_std_atol: Annotated[
        float, option("--zero-std-atol", "Tolerance of the zero-std group test.", METRICS)
    ] = _METRIC_DEFAULTS.zero_std_atol
    identity: Annotated[
        bool,
        option(
            "--identity",
            "Step-0 identity check: fail unless policy/logratio_absmax <= --identity-tol.",
            THRESHOLDS,
        ),
    ] = False
    identity_tol: Annotated[
        float, option("--identity-tol", "Tolerance of --identity in nats (0 = bit-identical).", THRESHOLDS)
    ] = _METRIC_DEFAULTS.identity_tol
    loss_name: Annotated[str | None, option("--loss-name", "fast-llm: key prefix (grpo).", METRICS)] = None
    rollout_is: Annotated[str | None, option("--rollout-is", "verl: rollout IS level (token).", METRICS)] = (
        None
    )
    rollout_is_threshold: Annotated[
        float | None, option("--rollout-is-threshold", "verl: rollout IS threshold (2.0).", METRICS)
    ] = None
    beta: Annotated[float | None, option("--beta", "trl/liger: KL coefficient beta.", METRICS)] = None
    no_vllm_is: Annotated[bool, option("--no-vllm-is", "trl: disable the vLLM IS correction.", METRICS)] = (
        False
    )
    no_kl_bias_correction: Annotated[
        bool,
        option(
            "--no-kl-bias-correction",
            "trl: use_bias_correction_kl=False (KL term not multiplied by the ratio).",
            METRICS,
        ),
    ] = False
    pad_width: Annotated[int | None, option("--pad-width", "liger: padded width T'.", METRICS)] = None
    tis: Annotated[
        bool, option("--tis", "miles: --use-tis (TIS-weighted pg_loss, tis and ois keys).", METRICS)
    ] = False
    mismatch_metrics: Annotated[
        bool,
        option(
            "--mismatch-metrics",
            "miles: --get-mismatch-metrics (the same TIS branch: weighted pg_loss, tis and ois keys).",
            METRICS,
        ),
    ] = False
    batch_size: Annotated[int | None, option("--batch-size", "pipelinerl: RLConfig.batch_size.", METRICS)] = (
        None
    )
    group_normalize: Annotated[
        bool, option("--group-normalize", "pipelinerl: group_normalization.", METRICS)
    ] = False
    kl_coef: Annotated[float | None, option("--kl-coef", "pipelinerl: kl_coef (0.1).", METRICS)] = None
    by: Annotated[
        list[MetricBreakdown] | None,
        option(
            "--by",
            "Breakdown beside step and all: lag (docs/metrics.md).",
            METRICS,
        ),
    ] = None

    def settings(self) -> MetricSettings:
        """The `MetricSettings` of these options (validated: E503/E506/E507 before any data is read)."""
        flat = {f.name: getattr(self, f.name) for f in fields(self)}
        flat["vllm_is"] = not flat.pop("no_vllm_is")
        flat["kl_bias_correction"] = not flat.pop("no_kl_bias_correction")
        flat = {k: v.value if isinstance(v, StrEnum) else v for k, v in flat.items()}
        flat["by"] = tuple(b.value if isinstance(b, StrEnum) else b for b in flat["by"] or ())
        return MetricSettings.from_options(**flat)
