"""Text as it may be shown to a user. Text read from files (golden manifests, bench documents):
a control character (a terminal escape sequence, a carriage return, a bidirectional override)
is written as its Python escape (``\\x1b``), never sent to the terminal. An exception a report
records: one line. Imports nothing of fqr.
"""

from __future__ import annotations


def printable(text) -> str:
    """``str(text)`` with every character that :meth:`str.isprintable` refuses (other than a
    plain space) written as its escape: ``"a\\x1b[31mb"`` -> ``"a\\\\x1b[31mb"``."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def exception_line(e: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message``, at most ``limit`` characters: how a report records
    a measurement or a step that raised (the run goes on)."""
    message = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {message}"[:limit]
