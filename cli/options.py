"""Option parsing shared by the commands: dtypes named in fqr's one vocabulary
(:data:`fqr.core.DTYPES`; torch's own names are accepted too)."""

from __future__ import annotations

import torch

from fqr.core import ACTIVATION_DTYPE_NAMES, dtype_of

from .common import UsageError, parse_csv

ACTIVATION_DTYPES_HELP = ", ".join(ACTIVATION_DTYPE_NAMES)


def _activation_name(text: str) -> str | None:
    """fqr's name of the activation dtype called ``text`` (``bf16`` or ``bfloat16``), or None."""
    text = text.strip().lower()
    for name in ACTIVATION_DTYPE_NAMES:
        if text in (name, str(dtype_of(name)).removeprefix("torch.")):
            return name
    return None


def parse_dtype(text: str, option: str = "--dtype") -> torch.dtype:
    """One activation dtype (``bf16``, ``fp16``, ``fp32``)."""
    name = _activation_name(text)
    if name is None:
        raise UsageError(f"{option} must be one of {ACTIVATION_DTYPES_HELP}, got {text!r}")
    return dtype_of(name)


def parse_dtypes(text: str, option: str = "--dtype") -> list[torch.dtype]:
    """A comma list of activation dtypes, each once, in the order given."""
    names = parse_csv(text, option.removeprefix("--"))
    return list(dict.fromkeys(parse_dtype(n, option) for n in names))
