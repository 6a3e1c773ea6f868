"""Issue 31.3: host µs per repeat call of every public op and ``torch.ops.fqr`` op on the CPU,
the kernel stubbed, beside ``F.rms_norm``'s (a measurement to read, not a test).

The calls are the audit's (``tests/backends/test_fast_path_aten.py``): each declaration's
docstring example, repeated with the same tensors after a first call kept it, on the
``interpret`` backend along the path the ``triton`` backend takes on CUDA (the generated host
function calling the C launch under Triton's ``CudaLauncher``, over a C function that does
nothing). Each row is the best of 7 rounds of 400 calls, ``F.rms_norm`` (``[1, 8, 128]``
bf16) timed in the same rounds, interleaved: the machine's load shifts both alike.
``--device-like``: the parameter kinds' checks of values do nothing (on a GPU they read nothing:
the positions and slots are on the device), as the device's repeat call runs::

    PYTHONPATH=. python scripts/host_path_cpu.py [--device-like] [op ...]
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from unittest import mock

os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tests", "backends"), os.path.join(ROOT, "tests"), ROOT]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from test_fast_path_aten import _interpret, call_of, cases, stubbed_kernels  # noqa: E402

from fqr.prologue import DECLARATIONS  # noqa: E402
from fqr.prologue.declare import TensorKind  # noqa: E402

ROUNDS, CALLS = 7, 400


def us_per_call(fn, calls: int = CALLS) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main(argv: list[str]) -> None:
    device_like = "--device-like" in argv
    only = [a for a in argv if not a.startswith("--")]
    x = torch.randn(1, 8, 128, dtype=torch.bfloat16)
    w = torch.ones(128, dtype=torch.bfloat16)

    def rms_norm():
        return F.rms_norm(x, (128,), w, 1e-6)

    with contextlib.ExitStack() as stack:
        if device_like:
            kinds = {
                type(p.kind)
                for decl in DECLARATIONS.values()
                for p in decl.tensor_params
                if type(p.kind).per_call is not TensorKind.per_call
            }
            for kind in kinds:
                stack.enter_context(mock.patch.object(kind, "per_call", lambda self, *a: None))
        stack.enter_context(torch.inference_mode())
        stack.enter_context(stubbed_kernels("cuda"))
        for name, index, form in cases():
            if index or (only and name not in only):
                continue
            call = call_of(DECLARATIONS[name], form, _interpret(name, index))
            call(), call()  # checked and kept; the host function made
            op = norm = float("inf")
            for _ in range(ROUNDS):
                op = min(op, us_per_call(call))
                norm = min(norm, us_per_call(rms_norm))
            print(
                f"{name:36s} {form:22s} {op:7.2f} us   F.rms_norm {norm:6.2f} us   "
                f"{op / norm:5.2f}x",
                flush=True,
            )


if __name__ == "__main__":
    main(sys.argv[1:])
