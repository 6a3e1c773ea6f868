"""Entry point: ``fqr`` / ``python -m fqr``. Each command lives in its own module."""

from __future__ import annotations

import json
import sys

# Command modules register themselves on `app` when imported.
from . import bench, doctor, fuse, golden, lower, run, verify  # noqa: E402,F401
from .common import EXIT_USAGE, app, err, out


def error_line(e: BaseException) -> str:
    """One line for a usage or input error: the message, or for an OS error the file and
    what the OS said (``lower -o /dev/full: No space left on device``)."""
    if isinstance(e, OSError) and e.strerror:
        where = f"{e.filename}: " if e.filename is not None else ""
        text = f"{where}{e.strerror}"
    else:
        text = str(e) or type(e).__name__
    return " ".join(text.split())


def main() -> None:
    """Run the app; bad usage or bad input (files included) ends with one line on stderr and
    exit 2, never a traceback; with ``--json`` stdout still gets one JSON document."""
    from rich.markup import escape

    from fqr.backends import BackendUnavailable

    try:
        app()
    except (ValueError, TypeError, BackendUnavailable, OSError) as e:
        line = error_line(e)
        err.print(f"[red]error:[/red] {escape(line)}", highlight=False, markup=True)
        if "--json" in sys.argv[1:]:
            out.print_json(json.dumps({"ok": False, "error": line, "exit_code": EXIT_USAGE}))
        sys.exit(EXIT_USAGE)


if __name__ == "__main__":
    main()
