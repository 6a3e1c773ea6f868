"""The device the GPU test files (``tests/gpu``) put their tensors on, and what a check does
with tensors that hold no values.

``cuda`` on a GPU machine. ``FQR_GPU_TEST_DEVICE=meta`` runs the same files on ``meta``
tensors on a machine without a GPU: no values, every launch the GPU run makes is taken by the
kernel-bundle builder (``fqr build``) and compiled ahead of time for the GPU instead, so the
GPU visit compiles nothing. Every test file and support builder that makes tensors for the GPU
takes its device from here, never from a literal ``"cuda"``.

On ``meta`` every value check (the peers' tolerances, fqr's contract, ``torch.equal``) is
skipped through :func:`has_values`, and everything else runs as on the GPU: each launch the
GPU run could make, the ones a check makes only when it fails included. On the GPU the inputs
are drawn there (the ``gen`` fixture's generator is on :func:`draw_device`) and the float64
references and comparisons run there too: no test copies a large tensor to the host except to
report a failure.
:class:`CudaDeviceRules` makes ``meta`` refuse the one device mix that CUDA refuses and
``meta`` lets through, so a CPU run on ``meta`` (``tests/core/test_meta_device.py``) finds the
device mix-ups a GPU run would.
"""

from __future__ import annotations

import os
from functools import lru_cache

import pytest
import torch
from torch.overrides import TorchFunctionMode

from fqr.backends import BACKENDS
from fqr.rope_cache import rope_cos_sin_cache

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


class MetaDraws(torch.Generator):
    """The build run's generator: a CPU generator whose ``device`` says ``meta``, so that a
    draw ``torch.randn(..., generator=gen, device=gen.device)`` makes a ``meta`` tensor (torch
    draws on ``meta`` from a CPU generator; ``meta`` has none of its own) where the GPU run
    draws on the GPU: a table or buffer built on the CPU and mixed with the drawn inputs fails
    here as on the GPU."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("meta")


def test_generator(for_gpu_file: bool, seed: int) -> torch.Generator:
    """The ``gen`` fixture's generator: on the GPU for a file of ``tests/gpu`` (its inputs are
    drawn where they are used; its float64 references and comparisons run there), a
    :class:`MetaDraws` one in the build run, else on the CPU."""
    if not for_gpu_file:
        return torch.Generator().manual_seed(seed)
    if BUILDING:
        return MetaDraws().manual_seed(seed)
    return torch.Generator(device=GPU_DEVICE).manual_seed(seed)


def draw_device() -> torch.device:
    """Where a GPU file's inputs are drawn (the ``gen`` fixture's device): the GPU, or
    ``meta`` in the build run."""
    return torch.device(GPU_DEVICE)


def launch_copies(inputs: dict) -> dict:
    """The tensors of ``inputs`` copied for a launch on the GPU (``meta`` in the build run),
    even where they are there already: a call that writes in place (a cache) leaves the drawn
    tensors, which the float64 reference reads, as they were drawn."""
    return {k: x.to(GPU_DEVICE, copy=True) for k, x in inputs.items()}


def rope_table(preset, rows: int | None = None) -> torch.Tensor:
    """``preset.cos_sin_cache(rows)`` built on :func:`draw_device` (the same real table; the
    GPU computes it in float64 as the CPU does), kept for the next test of the same RoPE: the
    2^17-row tables take the CPU about half a second each."""
    rows = rows or preset.max_position
    return _table(preset.rotary_dim, rows, preset.rope_theta, preset.rope_scaling)


@lru_cache(maxsize=4)
def _table(rotary_dim: int, rows: int, theta: float, scaling: tuple) -> torch.Tensor:
    at = torch.arange(rows, device=draw_device())
    return rope_cos_sin_cache(rotary_dim, rows, theta, scaling=dict(scaling), rows=at)


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
