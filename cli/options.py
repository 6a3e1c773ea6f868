"""Option parsing shared by the commands."""

from __future__ import annotations

import torch

from .common import UsageError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, got {name!r}") from None
