"""The `pgdiag` Typer application: one module per command, all registered here (`register_commands`).

Commands: ``check`` (validation and alignment), ``metrics`` (policy-gradient metric set and every loss
aggregation), ``compare`` (parity of two runs), ``plot`` (redraw a report's plots), ``logprobs``/``recompute``
(new log-probs and entropy from a checkpoint), ``import`` (a framework's rollout dump to a canonical run), ``whatif`` (off-policy correction rules replayed
on a saved batch), ``drift`` (per-step metrics over a whole run, with change points), ``report`` (re-render a saved report), ``explain`` (why two streams disagree, attributed to causes). ``python -m pgdiag`` is the same program.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Annotated

import typer

from pgdiag.cli import (
    check_cmd,
    compare_cmd,
    drift_cmd,
    explain_cmd,
    import_cmd,
    logprobs_cmd,
    metrics_cmd,
    plot_cmd,
    report_cmd,
    whatif_cmd,
)
from pgdiag.cli.common import Command, Group, help_text
from pgdiag.cli.options import flat_command


def _version(value: bool) -> None:
    if value:
        from pgdiag import __version__

        typer.echo(f"pgdiag {__version__}")
        raise typer.Exit()


def build_app() -> typer.Typer:
    """A fresh Typer app with every command registered."""
    app = typer.Typer(
        cls=Group,
        name="pgdiag",
        help="Offline log-prob diagnostics for RL training of LLMs: validate rollouts, recompute log-probs, "
        "compute policy-gradient metrics, compare runs for parity.",
        rich_markup_mode="rich",
        context_settings={"help_option_names": ["-h", "--help"]},
        pretty_exceptions_show_locals=False,
        no_args_is_help=True,
        add_completion=False,
    )

    @app.callback()
    def _root(
        version: Annotated[
            bool,
            typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit."),
        ] = False,
    ) -> None:
        """pgdiag: offline log-prob diagnostics for RL training of LLMs."""

    register_commands(app)
    for info in app.registered_commands:  # plain flags, and help paragraphs without hard line breaks
        info.cls = Command
        info.help = help_text(info.help or (info.callback.__doc__ if info.callback else None))
    return app


def register_commands(app: typer.Typer, names: Collection[str] | None = None) -> None:
    """Add the commands called `names` (all of them when None) to `app`, each with its options spread out
    (`options.flat_command`); `recompute` is the alias of `logprobs`."""
    commands: tuple[tuple[str, Callable[..., None], str | None], ...] = (
        ("check", check_cmd.check, check_cmd.HELP),
        ("metrics", metrics_cmd.metrics, metrics_cmd.HELP),
        ("compare", compare_cmd.compare, compare_cmd.HELP),
        ("plot", plot_cmd.plot, plot_cmd.HELP),
        ("logprobs", logprobs_cmd.logprobs, None),  # its help is its docstring
        ("recompute", logprobs_cmd.logprobs, "Alias of `logprobs`: the same command and options."),
        ("import", import_cmd.import_command, import_cmd.import_help()),
        ("whatif", whatif_cmd.whatif, whatif_cmd.HELP),
        ("drift", drift_cmd.drift, drift_cmd.HELP),
        ("report", report_cmd.report, report_cmd.HELP),
        ("explain", explain_cmd.explain, explain_cmd.HELP),
    )
    for name, command, text in commands:
        if names is None or name in names:
            app.command(name, help=text)(flat_command(command))
