"""Command-line interface: a thin Typer shell over the library (see `pgdiag.cli.app`)."""

from __future__ import annotations


def main() -> None:
    """Console-script entry point (`pgdiag`)."""
    from pgdiag.cli.app import build_app

    build_app()()
