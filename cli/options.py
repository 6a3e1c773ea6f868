"""Option parsing shared by the commands.

Choices are :class:`enum.StrEnum` types built from where each choice is defined (fqr's dtype
names :data:`fqr.core.ACTIVATION_DTYPE_NAMES`, :data:`fqr.validate.NUMERICS`, the backend
registry :data:`fqr.backends.BACKENDS`, :data:`fqr.presets.PRESETS` ...): Typer lists their
values in ``--help`` and completes them in the shell. Options that take a comma list of choices
(``--backend a,b``) are declared by :func:`comma_list`, which completes each item.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from enum import StrEnum
from typing import Annotated

import torch
import typer

from fqr.backends import BACKENDS
from fqr.core import ACTIVATION_DTYPE_NAMES, dtype_of
from fqr.presets import PRESETS
from fqr.runtime.device import DEVICE_TYPES
from fqr.validate import NUMERICS

from .common import UsageError, parse_csv

ACTIVATION_DTYPES_HELP = ", ".join(ACTIVATION_DTYPE_NAMES)


def choice_enum(name: str, values: Iterable[str]) -> type[StrEnum]:
    """A :class:`StrEnum` whose members are ``values`` (member name = value), for Typer."""
    return StrEnum(name, {v: v for v in values})  # type: ignore[return-value]


Dtype = choice_enum("Dtype", ACTIVATION_DTYPE_NAMES)
Numerics = choice_enum("Numerics", NUMERICS)
BackendName = choice_enum("BackendName", ("auto", *BACKENDS))
PresetName = choice_enum("PresetName", PRESETS)
DeviceType = choice_enum("DeviceType", DEVICE_TYPES)
# The lowering targets a backend runs (fqr.backends), in the registry's order.
TargetName = choice_enum(
    "TargetName", dict.fromkeys(b.target for b in BACKENDS.values() if b.target is not None)
)


def complete_csv(choices: Callable[[], Iterable[str]]) -> Callable[[str], list[str]]:
    """Shell completion of a comma list: the items typed so far, then each choice not yet
    given that starts with the last, partial item."""

    def complete(incomplete: str) -> list[str]:
        *done, last = incomplete.split(",")
        head = "".join(d + "," for d in done)
        return [head + c for c in choices() if c not in done and c.startswith(last)]

    return complete


def _activation_name(text: str) -> str | None:
    """fqr's name of the activation dtype called ``text`` (``bf16`` or ``bfloat16``), or None."""
    text = text.strip().lower()
    for name in ACTIVATION_DTYPE_NAMES:
        if text in (name, str(dtype_of(name)).removeprefix("torch.")):
            return name
    return None


def parse_dtype(text: str, option: str = "--dtype") -> torch.dtype:
    """One activation dtype (``bf16``, ``fp16``, ``fp32``)."""
    name = _activation_name(str(text))
    if name is None:
        raise UsageError(f"{option} must be one of {ACTIVATION_DTYPES_HELP}, got {text!r}")
    return dtype_of(name)


def parse_dtypes(text: str, option: str = "--dtype") -> list[torch.dtype]:
    """A comma list of activation dtypes, each once, in the order given."""
    names = parse_csv(text, option.removeprefix("--"))
    return list(dict.fromkeys(parse_dtype(n, option) for n in names))


# Options that mean the same in every command that takes them (``dtype: DtypeOption = Dtype.bf16``).
DtypeOption = Annotated[Dtype, typer.Option("--dtype", help="activation dtype")]
NumericsOption = Annotated[
    Numerics, typer.Option("--numerics", help="numerics contract of fqr's kernel (fqr.numerics)")
]
# The convention of every command with a JSON form (cli/common.py): one document on stdout,
# ``schema`` and ``ok`` first.
JsonOption = Annotated[
    bool, typer.Option("--json", help="print one JSON document instead of the table")
]
# A glob over the golden cases' names (fqr.golden.list_cases).
CaseOption = Annotated[
    str | None, typer.Option("--case", help="only cases whose name matches this glob")
]


def comma_list(*flags: str, help: str, choices: Callable[[], Iterable[str]] | None = None):
    """The ``typer.Option`` of a comma list (``--backend a,b``, split by
    :func:`cli.common.parse_csv`), each item completed from ``choices`` (:func:`complete_csv`)."""
    completion = None if choices is None else complete_csv(choices)
    return typer.Option(*flags, help=help, autocompletion=completion)
