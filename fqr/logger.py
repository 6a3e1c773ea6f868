"""fqr's log output: one ``fqr`` logger (modules log to ``fqr.<module>``), its level from
``FQR_LOG_LEVEL`` or the CLI's ``-v/--verbose``.

Like vLLM's ``VLLM_LOGGING_LEVEL``: with ``FQR_LOG_LEVEL`` set (``DEBUG``, ``INFO``,
``WARNING``, ``ERROR``, ``CRITICAL`` or a number), ``import fqr`` gives the ``fqr`` logger one
stderr handler at that level. Unset, fqr configures nothing: its warnings reach stderr through
Python's last-resort handler and an application's own ``logging`` setup sees every record.
``INFO`` says which kernel was lowered, compiled or taken from the kernel cache, and where its
source is; ``DEBUG`` adds each cache lookup.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

LOGGER_NAME = "fqr"
LEVEL_ENV = "FQR_LOG_LEVEL"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_FORMAT = "%(levelname)s %(name)s: %(message)s"


def parse_level(text: str | int, source: str = LEVEL_ENV) -> int:
    """The :mod:`logging` level called ``text`` (a name of :data:`LEVELS`, any case, or a
    number); a ValueError naming ``source`` otherwise."""
    if isinstance(text, int):
        return text
    name = text.strip().upper()
    if name in LEVELS:
        return logging.getLevelName(name)
    if name.isdigit():
        return int(name)
    raise ValueError(f"{source} must be one of {', '.join(LEVELS)} or a number, got {text!r}")


class _StderrHandler(logging.StreamHandler):
    """A handler writing to whatever ``sys.stderr`` is at the time of each record (a test's
    capture, a redirection made after ``import fqr``)."""

    @property  # type: ignore[override]
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def configure(level: str | int) -> logging.Logger:
    """Send the ``fqr`` logger's records at ``level`` and above to stderr (one handler,
    however often it is called) and return the logger."""
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(parse_level(level, "log level"))
    if not any(getattr(h, "_fqr", False) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter(_FORMAT))
        handler._fqr = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.propagate = False
    return logger


def configure_from_env() -> None:
    """Apply ``FQR_LOG_LEVEL`` when set; a bad value is a warning here (``import fqr`` never
    fails on it) and an error on the CLI."""
    text = os.environ.get(LEVEL_ENV)
    if not text:
        return
    try:
        configure(text)
    except ValueError as e:
        warnings.warn(f"ignored: {e}", stacklevel=2)
