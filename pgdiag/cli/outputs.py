"""`OutputSettings` and `write_outputs`: every file a reporting command writes, in one place.

`--out` (the report and its JSON), `--html` (the one-file page), `--plot` (the command's figure),
`--to-tensorboard` and `--to-wandb` (the per-step scalars) are written by `write_outputs`, the report last so its
JSON lists every other file; `--json` (the result object on stdout) is printed by `common.execute` once the
command is done. `refuse_existing` runs before any work, so an existing output (E502) costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pgdiag.cli.options import (
    HtmlOpt,
    JsonOpt,
    OutOpt,
    OverwriteOpt,
    PlotOpt,
    QuietOpt,
    ToTensorboardOpt,
    ToWandbOpt,
    VerboseOpt,
    WandbDirOpt,
)


@dataclass(frozen=True)
class OutputSettings:
    """Where a command's results go; a command offers the fields it supports (`options.Fields`)."""

    json_out: JsonOpt = False
    out: OutOpt = None
    html: HtmlOpt = None
    plot: PlotOpt = None
    to_tensorboard: ToTensorboardOpt = None
    to_wandb: ToWandbOpt = None
    wandb_dir: WandbDirOpt = None
    overwrite: OverwriteOpt = False
    quiet: QuietOpt = False
    verbose: VerboseOpt = False

    def wandb_directory(self) -> Path:
        """The folder that gets `wandb/`: --wandb-dir, else the folder of the --out report, else the current one."""
        if self.wandb_dir is not None:
            return self.wandb_dir
        if self.out is not None:
            return self.out.parent if self.out.suffix == ".parquet" else self.out
        return Path.cwd()

    def refuse_existing(
        self, kind: str, planned: Callable[[Path], tuple[Path, list[Path]]] | None = None
    ) -> None:
        """E502 for an existing `kind` report (`--out`), figure (`--plot`) or page (`--html`) unless --overwrite,
        or a file standing where a directory must be, before any work. `planned(out)`: the report's directory
        and files when the command writes more than the report and its JSON."""
        from pgdiag.data.writing import check_destination
        from pgdiag.report.report import report_files

        if self.out is not None:
            if planned is None:
                files = report_files(self.out, kind, worst=False)
                directory, paths = files.report.parent, [files.report, files.json]
            else:
                directory, paths = planned(self.out)
            check_destination(directory, paths, overwrite=self.overwrite)
        if self.plot is not None:
            check_destination(
                self.plot.parent, [self.plot], overwrite=self.overwrite, hint="--plot takes a file name"
            )
        if self.html is not None:
            from pgdiag.report.html import check_html_path

            check_html_path(self.html, overwrite=self.overwrite)


def write_outputs(
    report: Any,
    output: OutputSettings,
    result: dict[str, Any],
    *,
    verdict: Any = None,
    draw: Callable[[Any], Any] | None = None,
    figures: Callable[[Any], Any] | None = None,
    write_report: Callable[[Path, dict[str, Any]], dict[str, str]] | None = None,
) -> dict[str, Any]:
    """Write every output `output` asks for and return `result` with them listed in ``result["files"]``.

    `draw(report)`: the `--plot` figure; `figures(marks)`: the plots of the `--html` page (default
    `build_figures(report, marks=marks)`, the verdict's findings ringed); `write_report(out, result)`: how `--out`
    writes (default `report.write`), returning the files by role.
    """
    files: dict[str, Any] = dict(result.get("files") or {})
    if output.plot is not None and draw is not None:
        from pgdiag.report.plots import save_figure

        files["plots"] = [str(save_figure(draw(report), output.plot))]
    if output.html is not None:
        from pgdiag.report.html import verdict_arguments, write_html
        from pgdiag.report.plots import build_figures

        page_verdict = verdict_arguments(verdict or {})  # its findings also mark the plots and tables
        marks = page_verdict["marks"]
        plot_set = figures(marks) if figures is not None else build_figures(report, marks=marks)
        page = write_html(
            report,
            output.html,
            overwrite=output.overwrite,
            plot_set=plot_set,
            argv=result.get("argv"),
            **page_verdict,
        )
        files["html"] = str(page)
    if output.to_tensorboard is not None:
        from pgdiag.report.export import export_tensorboard

        files["tensorboard"] = str(export_tensorboard(report, output.to_tensorboard))
    if output.to_wandb is not None:
        from pgdiag.report.export import export_wandb

        files["wandb"] = str(export_wandb(report, output.to_wandb, output.wandb_directory()))
    result["files"] = files
    if output.out is not None:  # written last: its JSON lists every file
        if write_report is None:
            written = report.write(output.out, overwrite=output.overwrite, result=result).as_dict()
        else:
            written = write_report(output.out, result)
        result["files"] = {**written, **files}
    return result


def finish(
    screen: Any, report: Any, output: OutputSettings, result: dict[str, Any], verdict: Any, **how: Any
) -> dict[str, Any]:
    """The end of every reporting command: `write_outputs(report, output, result, verdict=verdict, **how)`, then
    the files written (stderr) and the verdict, the last line (stdout, or stderr under `--json`)."""
    from pgdiag.cli.render import render_verdict, render_written

    result = write_outputs(report, output, result, verdict=verdict, **how)
    render_written(screen.notes, result["files"])
    render_verdict(screen.results, verdict)
    return result
