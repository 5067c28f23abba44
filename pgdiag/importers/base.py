"""The importer interface: options, one imported step, presets, the preset registry and the import errors.

A *preset* turns one framework's rollout dump into canonical rows (docs/schema.md), one optimizer step at a
time. It is a module ``pgdiag.importers.<name>`` exposing ``PRESET = Preset(name, description, read)``;
`read(src, options)` yields `ImportedStep`s in step order and never loads more than one step's data at once.
Everything common to all presets happens in the writer (`pgdiag.importers.writer`), not in the preset:
``run``, ``seq_hash``, the ``"{step}:{row}"`` sample-id fallback, group ids by ``--group-by``, ``prompt_len``
when absent, ``--shift``, degenerate-stream detection over the whole import, validation and the atomic
directory layout.

What a preset must hand over in `ImportedStep.rows` (a polars DataFrame, one row per sample):

* canonical column names (docs/schema.md): ``input_ids`` list<int>, ``loss_mask`` list<bool> and at least one
  stream (``rollout_logprobs``, ``old_logprobs``, ``ref_logprobs``, ``new_logprobs``); optional ``sample_id``,
  ``segment_idx``, ``group_id``, ``prompt_len``, ``advantages``, ``advantage``, ``reward``,
  ``reward_components``, ``finish_reason``, ``policy_version``, ``temperature``, ``temperature_tok``, ``env``...
* every per-token list **token-aligned and full length** (``len == len(input_ids)``): the preset knows its
  layout and places values with `pgdiag.importers.alignment` (`response_aligned`, `right_aligned_block`,
  `next_token`); padding removed by recorded lengths, never by matching pad ids;
* ``loss_mask`` already the product of every mask the trainer's loss applies;
* values on loss positions never changed (a 0.0 there stays and fails E206); off the loss mask they may hold
  anything: the writer nulls every stream and ``advantages`` there ("masks, not values"), and a preset
  never locates masked positions by testing values;
* no ``step`` or ``run`` column needed (the writer sets ``step`` from `ImportedStep.step`).

Refusals are raised as the errors below, each naming the file, the field and the expectation:
`unsafe_global` (E701, exit 2), `text_only` (E702, exit 2), `bad_layout` (E703, exit 3).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from pgdiag.errors import Code, InvalidInputError, UsageError

GROUP_BY_CHOICES = ("auto", "field", "prompt")  # plus "contiguous:N"
TEMPERED_CHOICES = ("yes", "no", "unknown")
LOGPROBS_MODES = ("raw", "processed", "unknown")

# Preset name -> (module, one-line description), in the order `pgdiag import --help` lists them.
# Modules are imported only when their preset is used, so each preset costs nothing until then.
PRESET_MODULES: dict[str, tuple[str, str]] = {
    "verl": ("pgdiag.importers.verl", "verl hook files step_<S>.pt, or RolloutSkip gen_batch.dp"),
    "trl": ("pgdiag.importers.trl", "TRL GRPOTrainer hook files step_<S>[.rank<R>].pt"),
    "nemo-rl": ("pgdiag.importers.nemo_rl", "NeMo-RL train_data_step<N>.jsonl"),
    "slime": ("pgdiag.importers.slime", "slime --dump-details rollout_data/ and train_data/ .pt"),
    "miles": ("pgdiag.importers.miles", "miles rollout_data/, train_data/ .pt or dashboard_columns/"),
    "skyrl": ("pgdiag.importers.skyrl", "SkyRL dumped_data/global_step_<N>_training_input.pkl"),
    "prime-rl": ("pgdiag.importers.prime_rl", "prime-rl 0.8.0 rollouts/step_<n>/rank_<r>.bin"),
    "openrlhf": ("pgdiag.importers.openrlhf", "OpenRLHF hook files step_<S>.pt"),
    "pipelinerl": ("pgdiag.importers.pipelinerl", "PipelineRL actor or training_data streams (JSONL)"),
    "fast-llm": ("pgdiag.importers.fast_llm", "Fast-LLM capture files capture_<S>.jsonl"),
    "verl-jsonl": ("pgdiag.importers.verl_jsonl", "verl rollout_data_dir <step>.jsonl (text; --retokenize)"),
    "canonical": ("pgdiag.importers.canonical", "Parquet or JSONL rows in pgdiag's own columns (--map)"),
}


@dataclass(frozen=True)
class ImportOptions:
    """Every common option of ``pgdiag import``; the defaults here are the only defaults.

    `shifts` holds ``(column, K)`` pairs, column None meaning every per-token column except ``input_ids``;
    `maps` holds ``(source_column, canonical_column)`` pairs. Sampling values given here are the fallback
    when the source records none; `tempered` is ``"yes"``, ``"no"`` or ``"unknown"``.
    """

    step: int | None = None  # step of a source that records none
    label: str | None = None  # run label (default: the output directory's name)
    group_by: str = "auto"  # auto | field | prompt | contiguous:N
    shifts: tuple[tuple[str | None, int], ...] = ()
    maps: tuple[tuple[str, str], ...] = ()
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    logprobs_mode: str | None = None  # raw | processed | unknown
    tempered: str | None = None  # yes | no | unknown
    allow_unsafe_pickle: bool = False
    retokenize: bool = False
    tokenizer: Path | None = None

    def check(self) -> None:
        """Raise UsageError for an option outside its choices (E112 unparsable --group-by, E503, E506)."""
        if self.group_by not in GROUP_BY_CHOICES:
            prefix, _, size = self.group_by.partition(":")
            if prefix != "contiguous" or not size.isdigit() or int(size) < 1:
                raise UsageError(
                    Code.UNPARSABLE_OPTION,
                    f"--group-by {self.group_by!r}: expected auto, field, prompt or contiguous:N",
                    "e.g. --group-by contiguous:8 for 8 samples per prompt in row order",
                )
        if self.tempered is not None and self.tempered not in TEMPERED_CHOICES:
            raise UsageError(
                Code.BAD_OPTION_VALUE, f"--tempered {self.tempered!r}: expected yes, no or unknown"
            )
        if self.logprobs_mode is not None and self.logprobs_mode not in LOGPROBS_MODES:
            raise UsageError(
                Code.BAD_OPTION_VALUE,
                f"--logprobs-mode {self.logprobs_mode!r}: expected raw, processed or unknown",
            )
        if self.step is not None and self.step < 0:
            raise UsageError(Code.BAD_OPTION_VALUE, f"--step {self.step}: steps are >= 0")
        ranges = (  # sampling values a sampler can have (vLLM: top_k -1 or 0 means no top-k)
            ("temperature", self.temperature, "> 0", lambda v: v > 0),
            ("top-p", self.top_p, "in (0, 1]", lambda v: 0 < v <= 1),
            ("min-p", self.min_p, "in [0, 1]", lambda v: 0 <= v <= 1),
            ("top-k", self.top_k, ">= -1", lambda v: v >= -1),
        )
        for flag, value, rule, holds in ranges:
            if value is not None and not (math.isfinite(value) and holds(value)):
                raise UsageError(Code.BAD_OPTION_VALUE, f"--{flag} must be {rule}, got {value}")
        if self.retokenize and self.tokenizer is None:
            raise UsageError(
                Code.MISSING_SETTING, "--retokenize needs --tokenizer PATH (a tokenizer.json or its folder)"
            )

    def sampling_fallback(self) -> dict[str, Any]:
        """The sampling values given on the command line, unset ones left out."""
        values = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "logprobs_mode": self.logprobs_mode,
            "tempered": _tempered_value(self.tempered),
        }
        return {key: value for key, value in values.items() if value is not None}


def _tempered_value(tempered: str | None) -> bool | str | None:
    return {"yes": True, "no": False, "unknown": "unknown", None: None}[tempered]


@dataclass(frozen=True)
class DegenerateStream:
    """A stream a known configuration writes as zeros or as a copy of another stream (W701, W702).

    The writer tests the rule on the loss positions of every step; when it holds over the **whole** import the
    column is dropped from every step and `code` is reported with `message`. When it holds on some steps only,
    nothing is dropped and validation judges the values (a zero-filled stream then fails E206).
    `same_as` None means "exactly 0.0 on every loss position"; a column name means "bit-identical to that
    column on every loss position".
    """

    code: str  # W701 | W702
    column: str  # e.g. "old_logprobs"
    same_as: str | None
    message: str  # e.g. "prev_logprobs is 0.0 on every loss position (grpo.force_on_policy_ratio=true)"


@dataclass(frozen=True)
class ImportWarning:
    """An import warning (W701-W703) or a note on dropped rows, printed per step and kept in the sidecar."""

    code: str  # W701..W703, or "note" for dropped rows and derived ids (shown per step, never a warning)
    message: str


def count_note(step: int, count: int, text: str) -> list[ImportWarning]:
    """The note ``step <S>: <count> <text>`` on rows a preset dropped or skipped, or none when `count` is 0."""
    return [ImportWarning("note", f"step {step}: {count} {text}")] if count else []


@dataclass
class ImportedStep:
    """One optimizer step's rows in canonical columns, token-aligned, masked, ready for the writer.

    `rows`: see the module docstring for what must already hold. `src_files`: the files this step was read
    from (recorded in the footer). `default_group_by`: the preset's group rule when ``--group-by auto``
    (``"field"`` when `rows` has ``group_id``, ``"prompt"``, or ``"contiguous:N"``). `stream_fields` maps each
    stream column to the framework's field name (``{"old_logprobs": "prev_logprobs"}``). `sampling` holds
    what the source recorded (``temperature``, ``top_p``, ``top_k``, ``min_p``, ``logprobs_mode``,
    ``tempered``, ``engine``); command-line values fill what it lacks. `degenerate`: rules the writer tests over
    the whole import. `warnings`: W703 and notes on dropped rows ("3 padding rows dropped (pad_size)").
    `footer`: footer entries that replace the derived ones (``tokenizer``, ``model``; the canonical preset passes
    a pgdiag file's own ``source`` and ``streams`` through). `unsafe_load`: the step was read through
    ``--allow-unsafe-pickle`` (`safe_load.Loaded.unsafe_load`).
    """

    step: int
    rows: pl.DataFrame
    src_files: tuple[str, ...]
    framework: str
    default_group_by: str = "prompt"
    stream_fields: Mapping[str, str] = field(default_factory=dict)
    sampling: Mapping[str, Any] = field(default_factory=dict)
    framework_version: str | None = None
    unsafe_load: bool = False
    retokenized: bool = False
    degenerate: tuple[DegenerateStream, ...] = ()
    warnings: list[ImportWarning] = field(default_factory=list)
    footer: Mapping[str, Any] = field(default_factory=dict)  # extra footer keys: tokenizer, model (win)
    shifts_applied: bool = False  # True when the preset applied --shift itself (canonical)
    requires_stream: bool = (
        True  # False only for text-only sources (verl-jsonl): streams come from a recompute
    )


ReadSteps = Callable[[Path, ImportOptions], Iterator[ImportedStep]]


@dataclass(frozen=True)
class Preset:
    """A named reader of one dump format: `read(src, options)` yields the dump's steps in step order."""

    name: str
    description: str
    read: ReadSteps


def preset_names() -> tuple[str, ...]:
    """Every preset name, in the order of the help text."""
    return tuple(PRESET_MODULES)


def load_preset(name: str) -> Preset:
    """The `Preset` registered as `name` (its module imported now); UsageError E503 for an unknown name."""
    entry = PRESET_MODULES.get(name)
    if entry is None:
        raise UsageError(
            Code.BAD_OPTION_VALUE, f"unknown preset {name!r}", f"presets: {', '.join(preset_names())}"
        )
    module = importlib.import_module(entry[0])
    return module.PRESET


def unsafe_global(file: Path | str, name: str, allowed: str = "") -> UsageError:
    """E701: the pickle in `file` needs global `name`, which is outside the preset's allow-list (exit 2)."""
    return UsageError(
        Code.UNSAFE_PICKLE_GLOBAL,
        f"{file}: refusing to load global {name}: not in the allow-list{f' ({allowed})' if allowed else ''}",
        "loading it would run code from the file; if you trust it, pass --allow-unsafe-pickle "
        "(the framework must be importable)",
    )


def text_only(file: Path | str, field_name: str) -> UsageError:
    """E702: `file` holds text (`field_name`) but no token ids (exit 2)."""
    return UsageError(
        Code.TEXT_ONLY_SOURCE,
        f"{file}: {field_name} is text only; token ids are needed",
        "pass --retokenize --tokenizer PATH (ids are then re-tokenized, special tokens lost: W405 later)",
    )


def bad_layout(
    file: Path | str, field_name: str, expected: str, *, row: int | None = None
) -> InvalidInputError:
    """E703: `file`'s `field_name` does not hold what the preset expects (exit 3)."""
    where = f"{file}" if row is None else f"{file}, row {row}"
    return InvalidInputError(Code.BAD_DUMP_LAYOUT, f"{where}: {field_name}: expected {expected}")


def parse_shift(text: str) -> tuple[str | None, int]:
    """``"K"`` -> (None, K); ``"COL=K"`` -> (COL, K); UsageError E112 otherwise."""
    column, sep, amount = text.rpartition("=")
    try:
        k = int(amount)
    except ValueError:
        raise UsageError(
            Code.UNPARSABLE_OPTION, f"--shift {text!r}: expected K or COL=K with an integer K"
        ) from None
    if sep and not column:
        raise UsageError(Code.UNPARSABLE_OPTION, f"--shift {text!r}: expected K or COL=K")
    return (column or None, k)


def parse_map(text: str) -> tuple[str, str]:
    """``"SRC=DST"`` -> (SRC, DST); UsageError E112 otherwise."""
    source, sep, target = text.partition("=")
    if not sep or not source or not target:
        raise UsageError(
            Code.UNPARSABLE_OPTION, f"--map {text!r}: expected SRC=DST, e.g. --map tokens=input_ids"
        )
    return (source, target)
