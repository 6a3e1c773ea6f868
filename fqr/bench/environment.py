"""What ran the bench: the GPU and the software versions; the no-GPU refusal."""

from __future__ import annotations

import importlib.metadata as md
import platform

import torch

DEFAULT_L2_BYTES = 50 << 20  # H200, if the device does not say


class NoGPU(RuntimeError):
    """The bench needs a CUDA GPU and none is visible."""


def require_gpu() -> None:
    """Raise :class:`NoGPU` (one line) when torch sees no CUDA device."""
    if not torch.cuda.is_available():
        raise NoGPU(
            "fqr bench needs a CUDA GPU and torch sees none on this machine "
            "(run it on the GPU machine; `fqr bench --from-json FILE` renders saved results)"
        )


def environment(device: torch.device) -> dict:
    """The GPU (name, SMs, memory, L2) and the versions of torch, CUDA, Triton and Python."""
    try:
        triton_version = md.version("triton")
    except md.PackageNotFoundError:
        triton_version = None
    env = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "python": platform.python_version(),
        "device": device.type,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            gpu=props.name,
            sm_count=props.multi_processor_count,
            memory_gib=round(props.total_memory / 2**30, 1),
            l2_bytes=getattr(props, "L2_cache_size", None) or DEFAULT_L2_BYTES,
        )
    else:
        env.update(gpu=platform.processor() or device.type, l2_bytes=DEFAULT_L2_BYTES)
    return env
