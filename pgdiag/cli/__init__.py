"""Command-line interface: a thin Typer shell over the library (see `pgdiag.cli.app`)."""

from __future__ import annotations

import sys

from pgdiag.errors import Code


def run(args: list[str] | None = None) -> int:
    """Run the `pgdiag` program on `args` (default ``sys.argv[1:]``) and return its exit code.

    A command line Typer cannot parse becomes one ``error[E503]`` (a bad option value) or ``error[E515]``
    (unknown option, missing argument) line with exit 2, not Typer's multi-line box.
    """
    import typer
    from typer._click import exceptions as click_errors  # typer vendors click: what its parser raises

    from pgdiag.cli.app import build_app
    from pgdiag.cli.common import make_console, one_line

    command = typer.main.get_command(build_app())
    try:
        code = command.main(args, prog_name="pgdiag", standalone_mode=False)
    except click_errors.NoArgsIsHelpError as error:
        error.show()
        return error.exit_code
    except click_errors.UsageError as error:
        bad_value = isinstance(error, click_errors.BadParameter) and not isinstance(
            error, click_errors.MissingParameter
        )
        code_name = Code.BAD_OPTION_VALUE if bad_value else Code.BAD_COMMAND_LINE
        console = make_console()
        console.print(f"error[{code_name}] {one_line(error.format_message())}", markup=False, soft_wrap=True)
        console.print("hint: pgdiag COMMAND --help lists the options", markup=False, soft_wrap=True)
        return 2
    return code if isinstance(code, int) else 0


def main() -> None:
    """Console-script entry point (`pgdiag`)."""
    sys.exit(run())
