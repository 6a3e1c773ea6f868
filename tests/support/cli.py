"""The ``fqr`` command in the test's own process: what a user sees (exit code, both streams)
without paying a Python start and a torch import per row. A file keeps one subprocess row for
the real entry point; the rest of its usage rows run here."""

from __future__ import annotations

import sys


def fqr_in_process(args: list[str], capsys, monkeypatch) -> tuple[int, str, str]:
    """``fqr ARGS`` through ``fqr_cli.app.main`` (what the ``fqr`` script runs): (exit code,
    stdout, stderr). A worker spawn fails the test: a usage row is refused before one."""
    from fqr_cli.app import main

    from fqr.runtime.executor import MultiprocExecutor

    def no_spawn(self):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(MultiprocExecutor, "start", no_spawn)
    monkeypatch.setattr(sys, "argv", ["fqr", *args])
    capsys.readouterr()  # what the test printed before is not the command's
    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out, err = capsys.readouterr()
    return code, out, err
