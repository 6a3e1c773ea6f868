"""Entry point: ``fqr`` / ``python -m fqr``. Each command lives in its own module."""

from __future__ import annotations

import json
import sys
from typing import NoReturn

import typer

# Command modules register themselves on `app` when imported.
from . import bench, build, doctor, fuse, golden, hf_config, lower, run, verify  # noqa: E402,F401
from .common import EXIT_FAILED, EXIT_OK, EXIT_USAGE, app, err, out, schema

# click's exceptions, from the click that Typer runs on (recent Typer vendors it as typer._click)
CLICK_EXCEPTIONS = sys.modules[typer.BadParameter.__module__]
# raised for a group called without a command (no_args_is_help; click >= 8.2)
NO_ARGS_IS_HELP = getattr(CLICK_EXCEPTIONS, "NoArgsIsHelpError", ())


def error_line(e: BaseException) -> str:
    """One line for a usage or input error: the message, or for an OS error the file and
    what the OS said (``lower -o /dev/full: No space left on device``)."""
    if isinstance(e, OSError) and e.strerror:
        where = f"{e.filename}: " if e.filename is not None else ""
        text = f"{where}{e.strerror}"
    else:
        text = str(e) or type(e).__name__
    return " ".join(text.split())


def usage_exit(line: str) -> NoReturn:
    """End with ``error: LINE`` on stderr (with ``--json``, an error document on stdout), exit 2."""
    from rich.markup import escape

    from fqr.text import printable

    err.print(f"[red]error:[/red] {escape(printable(line))}", highlight=False, markup=True)
    if "--json" in sys.argv[1:]:
        doc = {"schema": schema("error"), "ok": False, "error": line, "exit_code": EXIT_USAGE}
        out.print_json(json.dumps(doc))
    sys.exit(EXIT_USAGE)


def main() -> None:
    """Run the app; bad usage (an unknown option, a value not among an option's choices) or bad
    input (files included) ends with one line on stderr and exit 2, never a traceback; with
    ``--json`` stdout still gets one JSON document."""
    from fqr.backends import BackendUnavailable

    try:
        code = app(standalone_mode=False)
    except NO_ARGS_IS_HELP as e:  # bare `fqr` / `fqr golden`: the help, as click shows it
        e.show()
        sys.exit(EXIT_USAGE)
    except CLICK_EXCEPTIONS.ClickException as e:
        # Typer's Enum choices word the message "Value error, 'x' is not one of ..."
        usage_exit(" ".join(e.format_message().replace("Value error, ", "").split()))
    except typer.Abort:
        err.print("aborted", highlight=False, markup=False)
        sys.exit(EXIT_FAILED)
    except (ValueError, TypeError, BackendUnavailable, OSError) as e:
        usage_exit(error_line(e))
    sys.exit(code if isinstance(code, int) else EXIT_OK)


if __name__ == "__main__":
    main()
