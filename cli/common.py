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
    rich_markup_mode=None,  # help text is shown as written: never read as Rich markup
    help="Fused QKV-split + RMSNorm + RoPE: verify, lower, benchmark and run across ranks.",
)
out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class UsageError(ValueError):
    """Bad usage or bad input detected by a command (exit 2, one line)."""


def example(*commands: str) -> str:
    """The ``--help`` epilog of a command: its example command lines."""
    return (
        "Example"
        + ("s" if len(commands) > 1 else "")
        + ":\n\n"
        + "\n\n".join(f"  $ {c}" for c in commands)
    )


def schema(command: str) -> str:
    """The ``schema`` field of a command's ``--json`` document: ``fqr.<command>/1``."""
    return f"fqr.{command}/1"


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


def configure_logging(verbose: int) -> None:
    """``-v`` INFO, ``-vv`` DEBUG; else ``FQR_LOG_LEVEL`` (a bad value is bad usage)."""
    import os

    from fqr.logger import LEVEL_ENV, configure, parse_level

    if verbose:
        configure("INFO" if verbose == 1 else "DEBUG")
    elif os.environ.get(LEVEL_ENV):
        configure(parse_level(os.environ[LEVEL_ENV]))


@app.callback(epilog=example("fqr -v verify --backend reference --case 'qwen3-8b*'"))
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="print fqr's version"
        ),
    ] = False,
    verbose: Annotated[
        int,
        typer.Option(
            "-v",
            "--verbose",
            count=True,
            help="log what fqr does to stderr: -v which kernels are lowered, compiled or taken "
            "from the kernel cache (INFO), -vv more (DEBUG); default: $FQR_LOG_LEVEL, else "
            "warnings only",
        ),
    ] = 0,
) -> None:
    """Fused QKV-split + RMSNorm + RoPE: verify, lower, benchmark and run across ranks."""
    configure_logging(verbose)
