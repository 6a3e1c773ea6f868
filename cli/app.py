"""Entry point: ``fqr`` / ``python -m fqr``. Each command lives in its own module."""

from __future__ import annotations

import sys

# Command modules register themselves on `app` when imported.
from . import bench, doctor, fuse, golden, lower, run, verify  # noqa: E402,F401
from .common import EXIT_USAGE, app, err


def main() -> None:
    from rich.markup import escape

    from fqr.backends import BackendUnavailable

    try:
        app()
    except (ValueError, TypeError, BackendUnavailable, FileNotFoundError) as e:
        err.print(f"[red]error:[/red] {escape(str(e))}", highlight=False, markup=True)
        sys.exit(EXIT_USAGE)


if __name__ == "__main__":
    main()
