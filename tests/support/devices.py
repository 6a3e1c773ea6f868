"""The device the GPU test files (``tests/gpu``) put their tensors on.

``cuda`` on a GPU machine. ``FQR_GPU_TEST_DEVICE=meta`` runs the same files on ``meta``
tensors on a machine without a GPU: no values, every launch the GPU run makes is taken by the
kernel-bundle builder (``fqr build``) and compiled ahead of time for the GPU instead, so the
GPU visit compiles nothing. Every test file and support builder that makes tensors for the GPU
takes its device from here, never from a literal ``"cuda"``.
"""

from __future__ import annotations

import os

GPU_DEVICE: str = os.environ.get("FQR_GPU_TEST_DEVICE", "cuda")

# The build run: tensors on ``meta``, launches compiled ahead rather than run, no values to check.
BUILDING: bool = GPU_DEVICE == "meta"
