"""What the ascend-interpret tests share: their skip conditions and the small persistent grid."""

from __future__ import annotations

import os

import pytest

from fqr.backends import BACKENDS
from fqr.lowering.loader import triton_mode

CORES = 3  # "vector cores": every program runs several token tiles

_reason = BACKENDS["ascend-interpret"].unavailable_reason()
ASCEND_INTERPRET_MARKS = [
    pytest.mark.skipif(_reason is not None, reason=f"ascend-interpret: {_reason}"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") == "0" or triton_mode() == "compiled",
        reason="the interpreter needs a process with TRITON_INTERPRET=1",
    ),
    # triton-ascend 3.2's interpreter turns 1-element arrays into ints (numpy warns; pinned <2.4)
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning"),
]
