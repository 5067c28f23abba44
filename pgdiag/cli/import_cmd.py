"""`pgdiag import --preset X SRC OUT`: a framework's rollout dump to a canonical pgdiag run.

Thin shell over `pgdiag.importers.api.import_run` (docs/import.md): parse the options into `ImportOptions`, run
the import with a per-step progress callback, render the per-step counts and warnings. Exit 0 on success, 2
for refusals (E701 unsafe global, E702 text only, existing output), 3 for invalid data (E703, E1xx-E2xx).
"""

from __future__ import annotations

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
    IgnoreOpt,
    JsonOpt,
    OverwriteOpt,
    QuietOpt,
    StrictOpt,
    VerboseOpt,
    listed,
)
from pgdiag.importers.base import PRESET_MODULES, ImportOptions


def _preset_help() -> str:
    lines = [f"[bold]{name}[/]: {description}" for name, (_, description) in PRESET_MODULES.items()]
    return "Import a framework's rollout dump SRC into the run directory OUT.\n\n" + "\n\n".join(lines)


def register(app: typer.Typer) -> None:
    """Add the `import` command to `app`."""
    app.command("import", help=_preset_help() + _DETAILS)(import_command)


_DETAILS = (
    "\n\nOUT is written all or nothing (a temp folder beside it, renamed at the end). Per step it prints samples, "
    "tokens, groups, streams found and warnings (W701-W703 degenerate streams). Loading runs no code from the "
    "dump: a pickle global outside the preset's allow-list is E701. See docs/import.md for each framework's "
    "flag or hook, and docs/schema.md for the columns."
)


def import_command(
    src: Annotated[Path, typer.Argument(help="The dump: a file or the folder the preset reads.")],
    out: Annotated[Path, typer.Argument(help="The run directory to write.")],
    *,
    preset: Annotated[
        str,
        typer.Option("--preset", help=f"Dump format: {', '.join(PRESET_MODULES)}.", rich_help_panel=INPUTS),
    ],
    step: Annotated[
        int | None,
        typer.Option("--step", min=0, help="Step of a source that records none.", rich_help_panel=INPUTS),
    ] = None,
    label: Annotated[
        str | None, typer.Option("--label", help="Run label (default: OUT's name).", rich_help_panel=INPUTS)
    ] = None,
    group_by: Annotated[
        str,
        typer.Option(
            "--group-by",
            help="Prompt groups: auto (the preset's rule), field (the source's ids), prompt (same prompt "
            "tokens), contiguous:N (N rows in order).",
            rich_help_panel=INPUTS,
        ),
    ] = ImportOptions.group_by,
    shift: Annotated[
        list[str] | None,
        typer.Option(
            "--shift",
            help="[COL=]K: move element i of per-token lists (or of COL) to i + K; 1 for next-token lists. "
            "Repeatable.",
            rich_help_panel=ALIGNMENT,
        ),
    ] = None,
    map_: Annotated[
        list[str] | None,
        typer.Option(
            "--map",
            help="SRC=DST: rename a source column to a canonical one (canonical preset). Repeatable.",
            rich_help_panel=INPUTS,
        ),
    ] = None,
    temperature: Annotated[
        float | None,
        typer.Option(
            "--temperature",
            help="Sampling temperature, when the source records none.",
            rich_help_panel=STREAMS,
        ),
    ] = None,
    top_p: Annotated[
        float | None, typer.Option("--top-p", help="Sampling top-p.", rich_help_panel=STREAMS)
    ] = None,
    top_k: Annotated[
        int | None, typer.Option("--top-k", help="Sampling top-k.", rich_help_panel=STREAMS)
    ] = None,
    min_p: Annotated[
        float | None, typer.Option("--min-p", help="Sampling min-p.", rich_help_panel=STREAMS)
    ] = None,
    logprobs_mode: Annotated[
        str | None,
        typer.Option(
            "--logprobs-mode",
            help="raw, processed or unknown (vLLM --logprobs-mode).",
            rich_help_panel=STREAMS,
        ),
    ] = None,
    tempered: Annotated[
        str | None,
        typer.Option(
            "--tempered",
            help="yes, no or unknown: were log-probs computed at the temperature?",
            rich_help_panel=STREAMS,
        ),
    ] = None,
    allow_unsafe_pickle: Annotated[
        bool,
        typer.Option(
            "--allow-unsafe-pickle",
            help="Load pickles whose globals are outside the preset's allow-list: runs code from the file. "
            "Only for dumps you trust; the framework must be importable.",
            rich_help_panel=SAFETY,
        ),
    ] = False,
    retokenize: Annotated[
        bool,
        typer.Option(
            "--retokenize",
            help="Tokenize text-only dumps (verl-jsonl) with --tokenizer.",
            rich_help_panel=SAFETY,
        ),
    ] = False,
    tokenizer: Annotated[
        Path | None,
        typer.Option(
            "--tokenizer", help="A tokenizer.json (or its folder) for --retokenize.", rich_help_panel=SAFETY
        ),
    ] = None,
    overwrite: OverwriteOpt = False,
    ignore: IgnoreOpt = None,
    strict: StrictOpt = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    def body(screen: Screen) -> dict[str, Any]:
        from pgdiag.cli.render import render_checks
        from pgdiag.importers.api import import_run
        from pgdiag.importers.base import parse_map, parse_shift

        options = ImportOptions(
            step=step,
            label=label,
            group_by=group_by,
            shifts=tuple(parse_shift(s) for s in listed(shift)),
            maps=tuple(parse_map(m) for m in listed(map_)),
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            logprobs_mode=logprobs_mode,
            tempered=tempered,
            allow_unsafe_pickle=allow_unsafe_pickle,
            retokenize=retokenize,
            tokenizer=tokenizer,
        )
        console = screen.notes
        if allow_unsafe_pickle:
            console.print(
                "[yellow]warning:[/] --allow-unsafe-pickle: code inside the dump may run while loading"
            )
        with console.status(Text(f"importing {src} ({preset})"), spinner="dots") as status:

            def progress(summary: Any) -> None:
                notes = "; ".join(
                    f"{w.code} {w.message}" if w.severity == "warning" else w.message
                    for w in summary.warnings
                    if w.code.startswith("W70") or w.severity == "note"
                )
                console.print(
                    f"step {summary.step}: {summary.n_samples} samples, {summary.n_tokens} tokens "
                    f"({summary.n_loss_tokens} loss), {summary.n_groups} groups, streams "
                    f"{', '.join(summary.streams)}" + (f"; {notes}" if notes else ""),
                    markup=False,
                    soft_wrap=True,
                )
                status.update(Text(f"importing {src} ({preset}): step {summary.step} done"))

            result = import_run(
                preset,
                src,
                out,
                options=options,
                overwrite=overwrite,
                ignore=tuple(listed(ignore)),
                progress=progress,
            )
        render_checks(console, result.issues.issues, result.issues.hints)
        if result.dropped_streams:
            console.print(f"dropped degenerate streams: {', '.join(result.dropped_streams)}", markup=False)
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

    execute("import", body, json_out=json_out, quiet=quiet)
