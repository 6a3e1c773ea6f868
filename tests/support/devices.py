"""The device the GPU test files (``tests/gpu``) put their tensors on, and what a check does
with tensors that hold no values.

``cuda`` on a GPU machine. ``FQR_GPU_TEST_DEVICE=meta`` runs the same files on ``meta``
tensors on a machine without a GPU: no values, every launch the GPU run makes is taken by the
kernel-bundle builder (``fqr build``) and compiled ahead of time for the GPU instead, so the
GPU visit compiles nothing. Every test file and support builder that makes tensors for the GPU
takes its device from here, never from a literal ``"cuda"``.

On ``meta`` every value check (the peers' tolerances, fqr's contract, ``torch.equal``) is
skipped through :func:`has_values`, and everything else runs as on the GPU: each launch the
GPU run could make, the ones a check makes only when it fails included. :func:`on_host` is
``.cpu()`` for the float64 references, a meta tensor staying where it is.
:class:`CudaDeviceRules` makes ``meta`` refuse the one device mix that CUDA refuses and
``meta`` lets through, so a CPU run on ``meta`` (``tests/core/test_meta_device.py``) finds the
device mix-ups a GPU run would.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.overrides import TorchFunctionMode

from fqr.backends import BACKENDS

GPU_DEVICE: str = os.environ.get("FQR_GPU_TEST_DEVICE", "cuda")

# The build run: tensors on ``meta``, launches compiled ahead rather than run, no values to check.
BUILDING: bool = GPU_DEVICE == "meta"

# Why a test that needs the CUDA runtime itself (streams, graphs, synchronize, memory) skips in
# the build run: there is no launch of fqr's it could add to the bundle.
CUDA_RUNTIME_ONLY = "uses the CUDA runtime itself (no fqr launch to build ahead on meta)"


def gpu_marks(backend: str = "triton") -> list:
    """A GPU file's ``pytestmark``: marked ``gpu``, skipped where ``backend`` (a compiled one)
    is unavailable, except in the build run, where every test runs on ``meta``."""
    reason = BACKENDS[backend].unavailable_reason() or ""
    return [
        pytest.mark.gpu,
        pytest.mark.skipif(not BUILDING and not BACKENDS[backend].available, reason=reason),
    ]


def synchronize() -> None:
    """Wait for the GPU's queued work (where a device-side error surfaces); on ``meta`` there
    is none."""
    if torch.device(GPU_DEVICE).type == "cuda":
        torch.cuda.synchronize()


def has_values(*tensors) -> bool:
    """Whether ``tensors`` (None and non-tensors ignored) hold values a check can read: False
    when any is a ``meta`` tensor. Every value check of ``tests/support`` and ``tests/gpu``
    runs under it; the launches that make the tensors run either way."""
    return not any(isinstance(t, torch.Tensor) and t.is_meta for t in tensors)


def on_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU, for a float64 reference or a value check; a ``meta`` tensor (nothing
    to copy) stays on ``meta``, where the reference then runs on shapes alone."""
    return t if t.is_meta else t.cpu()


# The functions that index a tensor (the first argument) by other tensors.
_INDEXING = frozenset(
    {
        torch.Tensor.__getitem__,
        torch.Tensor.__setitem__,
        torch.Tensor.index_select,
        torch.index_select,
        torch.Tensor.index_put,
        torch.Tensor.index_put_,
        torch.index_put,
        torch.Tensor.index_copy,
        torch.Tensor.index_copy_,
        torch.Tensor.index_add,
        torch.Tensor.index_add_,
        torch.Tensor.gather,
        torch.gather,
        torch.Tensor.scatter,
        torch.Tensor.scatter_,
        torch.Tensor.take,
        torch.take,
    }
)


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


class CudaDeviceRules(TorchFunctionMode):
    """``with CudaDeviceRules():`` a CPU tensor indexed by ``meta`` tensors (or given ``meta``
    values to store) raises as a CPU tensor indexed by CUDA tensors does ("indices should be
    either on cpu or on the same device as the indexed tensor"). Every other mix of ``meta``
    and CPU tensors already raises on its own ("... is not on the expected device meta!"),
    but torch lets ``cpu_table[meta_positions]``, ``index_select``, ``gather`` and their
    stores through, where CUDA refuses them: the mistake of ``peer_table`` (issue 30) was one."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _INDEXING and args and isinstance(args[0], torch.Tensor):
            indexed = args[0]
            if indexed.device.type == "cpu":
                others = _tensors((args[1:], kwargs))
                if any(t.is_meta for t in others):
                    raise RuntimeError(
                        f"{func.__name__}: indices should be either on cpu or on the same device "
                        "as the indexed tensor (cpu); a CPU tensor indexed by meta tensors "
                        "(CUDA raises here for CUDA ones)"
                    )
        return func(*args, **kwargs)
