"""Text read from files (golden manifests, bench documents) as it may be shown to a user: a
control character (a terminal escape sequence, a carriage return, a bidirectional override)
is written as its Python escape (``\\x1b``), never sent to the terminal. Imports nothing of fqr.
"""

from __future__ import annotations


def printable(text) -> str:
    """``str(text)`` with every character that :meth:`str.isprintable` refuses (other than a
    plain space) written as its escape: ``"a\\x1b[31mb"`` -> ``"a\\\\x1b[31mb"``."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
