"""`pgdiag import --preset X SRC OUT`: a framework's rollout dump to a canonical pgdiag run.

Thin shell over `pgdiag.importers.api.import_run` (docs/import.md): parse the options into `ImportOptions`, run
the import with a per-step progress callback, render the per-step counts and warnings. Exit 0 on success, 2
for refusals (E701 unsafe global, E702 text only, existing output), 3 for invalid data (E703, E1xx-E2xx).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.text import Text

from pgdiag.cli.common import Screen, execute, result_object
from pgdiag.cli.options import (
    ALIGNMENT,
    INPUTS,
    SAFETY,
    STREAMS,
    Fields,
    IgnoreOpt,
    StrictOpt,
    listed,
    option,
    same_named,
)
from pgdiag.cli.outputs import OutputSettings
from pgdiag.importers.base import PRESET_MODULES, ImportOptions


def import_help() -> str:
    """The `import` command's help: one paragraph per preset, then how OUT is written."""
    lines = [f"[bold]{name}[/]: {description}" for name, (_, description) in PRESET_MODULES.items()]
    return (
        "Import a framework's rollout dump SRC into the run directory OUT.\n\n"
        + "\n\n".join(lines)
        + _DETAILS
    )


_DETAILS = (
    "\n\nOUT is written all or nothing (a temp folder beside it, renamed at the end). Per step it prints samples, "
    "tokens, groups, streams found and warnings (W701-W703 degenerate streams). Loading runs no code from the "
    "dump: a pickle global outside the preset's allow-list is E701. See docs/import.md for each framework's "
    "flag or hook, and docs/schema.md for the columns."
)


@dataclass(frozen=True)
class ImportFlags:
    """The options of `ImportOptions`, as typed on the command line."""

    step: Annotated[
        int | None,
        option("--step", "Step of a source that records none.", INPUTS, min=0),
    ] = None
    label: Annotated[str | None, option("--label", "Run label (default: OUT's name).", INPUTS)] = None
    group_by: Annotated[
        str,
        option(
            "--group-by",
            (
                "Prompt groups: auto (the preset's rule), field (the source's ids), prompt (same prompt "
                "tokens), contiguous:N (N rows in order)."
            ),
            INPUTS,
        ),
    ] = ImportOptions.group_by
    shift: Annotated[
        list[str] | None,
        option(
            "--shift",
            (
                "[COL=]K: move element i of per-token lists (or of COL) to i + K; 1 for next-token lists. "
                "Repeatable."
            ),
            ALIGNMENT,
        ),
    ] = None
    map_: Annotated[
        list[str] | None,
        option(
            "--map",
            "SRC=DST: rename a source column to a canonical one (canonical preset). Repeatable.",
            INPUTS,
        ),
    ] = None
    temperature: Annotated[
        float | None,
        option("--temperature", "Sampling temperature, when the source records none.", STREAMS),
    ] = None
    top_p: Annotated[float | None, option("--top-p", "Sampling top-p.", STREAMS)] = None
    top_k: Annotated[int | None, option("--top-k", "Sampling top-k.", STREAMS)] = None
    min_p: Annotated[float | None, option("--min-p", "Sampling min-p.", STREAMS)] = None
    logprobs_mode: Annotated[
        str | None,
        option("--logprobs-mode", "raw, processed or unknown (vLLM --logprobs-mode).", STREAMS),
    ] = None
    tempered: Annotated[
        str | None,
        option("--tempered", "yes, no or unknown: were log-probs computed at the temperature?", STREAMS),
    ] = None
    allow_unsafe_pickle: Annotated[
        bool,
        option(
            "--allow-unsafe-pickle",
            (
                "Load pickles whose globals are outside the preset's allow-list: runs code from the file. "
                "Only for dumps you trust; the framework must be importable."
            ),
            SAFETY,
        ),
    ] = False
    retokenize: Annotated[
        bool,
        option("--retokenize", "Tokenize text-only dumps (verl-jsonl) with --tokenizer.", SAFETY),
    ] = False
    tokenizer: Annotated[
        Path | None,
        option("--tokenizer", "A tokenizer.json (or its folder) for --retokenize.", SAFETY),
    ] = None

    def options(self) -> ImportOptions:
        """The `ImportOptions` (E112 for a malformed --shift or --map)."""
        from pgdiag.importers.base import parse_map, parse_shift

        return same_named(
            ImportOptions,
            self,
            shifts=tuple(parse_shift(s) for s in listed(self.shift)),
            maps=tuple(parse_map(m) for m in listed(self.map_)),
        )


PresetOpt = Annotated[str, option("--preset", f"Dump format: {', '.join(PRESET_MODULES)}.", INPUTS)]


def import_command(
    src: Annotated[Path, typer.Argument(help="The dump: a file or the folder the preset reads.")],
    out: Annotated[Path, typer.Argument(help="The run directory to write.")],
    *,
    preset: PresetOpt,
    flags: ImportFlags,
    ignore: IgnoreOpt = None,
    strict: StrictOpt = False,
    output: Annotated[OutputSettings, Fields("overwrite", "json_out", "quiet", "verbose")],
) -> None:
    """The `import` command (help: `_preset_help()`)."""

    def body(screen: Screen) -> dict[str, Any]:
        from pgdiag.cli.render import render_checks
        from pgdiag.importers.api import import_run

        options = flags.options()
        if options.allow_unsafe_pickle:
            screen.notes.print(
                "[yellow]warning:[/] --allow-unsafe-pickle: code inside the dump may run while loading"
            )
        with screen.notes.status(Text(f"importing {src} ({preset})"), spinner="dots") as status:
            result = import_run(
                preset, src, out, options=options, overwrite=output.overwrite, ignore=listed(ignore),
                progress=_StepLines(screen.notes, status, f"importing {src} ({preset})"),
            )  # fmt: skip
        render_checks(screen.notes, result.issues.issues, result.issues.hints)
        if result.dropped_streams:
            screen.notes.print(
                f"dropped degenerate streams: {', '.join(result.dropped_streams)}", markup=False
            )
        screen.results.print(
            Text.assemble(
                ("imported", "green"),
                f" {result.n_samples} samples, {result.n_tokens} tokens, {len(result.steps)} steps, "
                f"streams {', '.join(result.streams)} -> {result.path}",
            ),
            soft_wrap=True,
        )
        exit_code = 1 if strict and result.issues.n_warnings else 0
        return result_object(
            "import",
            status="ok" if exit_code == 0 else "fail",
            exit_code=exit_code,
            inputs={
                "runs": [str(result.path)],
                "streams": list(result.streams),
                "steps": [s.step for s in result.steps],
                "n_samples": result.n_samples,
                "n_tokens": result.n_tokens,
            },
            checks=result.issues.issues.to_dicts(),
            files={"run": str(result.path)},
        )

    execute("import", body, json_out=output.json_out, quiet=output.quiet)


class _StepLines:
    """The import's progress: one line per step read (samples, tokens, groups, streams, notes) and the spinner."""

    def __init__(self, console: Any, status: Any, what: str) -> None:
        self.console, self.status, self.what = console, status, what

    def __call__(self, summary: Any) -> None:
        notes = "; ".join(
            f"{w.code} {w.message}" if w.severity == "warning" else w.message
            for w in summary.warnings
            if w.code.startswith("W70") or w.severity == "note"
        )
        self.console.print(
            f"step {summary.step}: {summary.n_samples} samples, {summary.n_tokens} tokens "
            f"({summary.n_loss_tokens} loss), {summary.n_groups} groups, streams "
            f"{', '.join(summary.streams)}" + (f"; {notes}" if notes else ""),
            markup=False,
            soft_wrap=True,
        )
        self.status.update(Text(f"{self.what}: step {summary.step} done"))
