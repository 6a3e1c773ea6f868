"""Shared pieces of the CLI: the Typer app, the two consoles, and the usage-error convention.

Data goes to stdout (``out``), progress and messages to stderr (``err``). Exit codes:
0 ok, 1 a check failed, 2 bad usage or bad input (one line on stderr, no traceback).
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

app = typer.Typer(
    name="fqr",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    help="Fused QKV-split + RMSNorm + RoPE: verify, lower, benchmark and run across ranks.",
)
out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class UsageError(ValueError):
    """Bad usage or bad input detected by a command (exit 2, one line)."""


def parse_csv(value: str, name: str, cast=str) -> list:
    try:
        items = [cast(v.strip()) for v in value.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"--{name}: cannot parse {value!r}") from None
    if not items:
        raise UsageError(f"--{name}: empty list")
    return items


def _print_version(value: bool) -> None:
    if value:
        from fqr._version import __version__

        out.print(f"fqr {__version__}", highlight=False, markup=False)
        raise typer.Exit(EXIT_OK)


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="print fqr's version"
        ),
    ] = False,
) -> None:
    """Fused QKV-split + RMSNorm + RoPE: verify, lower, benchmark and run across ranks."""
