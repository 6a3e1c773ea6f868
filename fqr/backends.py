"""Backend registry and detection.

A backend runs a traced :class:`fqr.core.Program` on concrete tensors:

==================== =================================================================
``auto`` (:data:`AUTO_BACKENDS`) picks ``triton`` for CUDA tensors, ``ascend`` for NPU tensors,
``reference`` otherwise (never an interpreter: it is slow).
"""

from __future__ import annotations

import functools
import importlib.metadata as md
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .core import Program, eval_program


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run here; the message says why."""


@dataclass(frozen=True)
class Backend:
    """``device_types``: where its tensors may live, the first where they live by default;
    ``target``: the lowering target of its generated kernel (None: the reference rules)."""

    name: str
    description: str
    device_types: tuple[str, ...]
    target: str | None
    _availability: Callable[[], str | None]  # None when available, else the reason
    # Called once before the first lowering (a target registered outside fqr.lowering).
    prepare: Callable[[], object] | None = None
    _runner: Callable[[Program, list], list] = field(init=False, repr=False)

    def __post_init__(self):
        runner = (
            _run_reference if self.target is None else _kernel_runner(self.target, self.prepare)
        )
        object.__setattr__(self, "_runner", runner)

    @property
    def home_device(self) -> str:
        """The device type its inputs go to when the caller does not say."""
        return self.device_types[0]

    def unavailable_reason(self) -> str | None:
        return self._availability()

    @property
    def available(self) -> bool:
        return self.unavailable_reason() is None

    def require(self, device_type: str, *, named: str = "", where: str = "") -> None:
        """Raise unless this backend runs on ``device_type`` tensors and is available here:
        ``ValueError`` / :class:`BackendUnavailable` saying ``named`` (default ``backend
        'name'``) and ``where`` the tensors are (default ``<device_type> tensors``)."""
        named = named or f"backend {self.name!r}"
        if device_type not in self.device_types:
            where = where or f"{device_type} tensors"
            raise ValueError(
                f"{named} runs on {'/'.join(self.device_types)} tensors, not on {where}"
            )
        reason = self.unavailable_reason()
        if reason:
            raise BackendUnavailable(f"{named} is unavailable: {reason}")

    def launch(self, program: Program, args: list) -> list[torch.Tensor]:
        """Run ``program`` on ``args``, unchecked: for callers that resolved the backend
        (:func:`resolve_backend`) and validated their arguments (the per-call hot path)."""
        return self._runner(program, args)


@functools.cache
def _triton_flavour() -> str | None:
    """'upstream', 'ascend', or None when no triton is importable."""
    # Look at the installed distributions only: importing triton would fix this process's
    # interpreted/compiled mode (see fqr.lowering.loader.triton_mode).
    if importlib.util.find_spec("triton") is None:
        return None
    try:
        md.version("triton-ascend")
        return "ascend"
    except md.PackageNotFoundError:
        return "upstream"


def _npu_present() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401

    return bool(torch.npu.is_available())


def _mode_conflict(interpret: bool) -> str | None:
    from .lowering.loader import triton_mode

    mode = triton_mode()
    if interpret and mode == "compiled":
        return "triton is already loaded for compiled kernels in this process"
    if not interpret and (
        mode == "interpreted" or (mode == "unloaded" and os.environ.get("TRITON_INTERPRET") == "1")
    ):
        return "this process runs triton interpreted (TRITON_INTERPRET=1)"
    return None


def _reason_interpret() -> str | None:
    if _triton_flavour() != "upstream":
        return "upstream triton is not installed (pip install 'fqr[triton]')"
    return _mode_conflict(interpret=True)


def _reason_triton() -> str | None:
    if _triton_flavour() != "upstream":
        return "upstream triton is not installed (pip install 'fqr[triton]')"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible to torch"
    return _mode_conflict(interpret=False)


def _reason_ascend() -> str | None:
    if _triton_flavour() != "ascend":
        return "triton-ascend is not installed (use the Ascend environment: make ascend-env)"
    if importlib.util.find_spec("torch_npu") is None:
        return "torch_npu is not installed"
    if not _npu_present():
        return "torch_npu found no NPU (is CANN installed and a device visible?)"
    return None


def _reason_ascend_interpret() -> str | None:
    if _triton_flavour() != "ascend":
        return "triton-ascend is not installed (use the Ascend environment: make ascend-env)"
    return _mode_conflict(interpret=True)


def _run_reference(program: Program, args: list) -> list:
    return eval_program(program, args, torch.float32)


def _kernel_runner(target: str, register: Callable[[], object] | None = None):
    kernels: dict[int, object] = {}  # id(program) -> Kernel; programs are cached, ids stable

    def run(program: Program, args: list) -> list:
        kernel = kernels.get(id(program))
        if kernel is None or kernel.program is not program:
            from .lowering import lower

            if register is not None:
                register()
            kernel = kernels[id(program)] = lower(program, target=target)
        return kernel.launch(args)

    return run


def _register_ascend_on_cuda():
    from .ascend_on_cuda import register_target

    return register_target()


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in [
        Backend(
            "reference",
            "torch impl rules, fp32 compute",
            ("cpu", "cuda", "npu"),
            None,
            lambda: None,
        ),
        Backend(
            "interpret",
            "generated kernel, Triton interpreter (CPU)",
            ("cpu",),
            "interpret",
            _reason_interpret,
        ),
        Backend("triton", "generated kernel, Triton on CUDA", ("cuda",), "cuda", _reason_triton),
        Backend(
            "ascend",
            "generated kernel, Triton-Ascend on NPU",
            ("npu",),
            "ascend",
            _reason_ascend,
        ),
        Backend(
            "ascend-interpret",
            "ascend-target kernel, Triton-Ascend interpreter (CPU)",
            ("cpu",),
            "ascend-interpret",
            _reason_ascend_interpret,
        ),
        Backend(
            "ascend-on-cuda",
            "ascend-target kernel, Triton on CUDA, Ascend-sized persistent grid",
            ("cuda",),
            "ascend-on-cuda",
            _reason_triton,
            prepare=_register_ascend_on_cuda,
        ),
    ]
}

# ``backend="auto"``: the compiled kernel on each accelerator -- the backend whose target is
# fqr.lowering.default_target of that device (tests/backends pins the agreement); anything else
# runs the reference rules.
AUTO_BACKENDS = {"cuda": "triton", "npu": "ascend"}


def get_backend(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"backend must be one of auto, {', '.join(BACKENDS)}; got {name!r}"
        ) from None


def auto_backend_name(device: torch.device | str) -> str:
    """The backend ``auto`` picks for tensors on ``device`` (a device or a device type)."""
    device_type = device if isinstance(device, str) else device.type
    return AUTO_BACKENDS.get(device_type, "reference")


_RESOLVED: dict[tuple[str, str], Backend] = {}


def resolve_backend(name: str, device: torch.device) -> Backend:
    """The backend to run on ``device`` (checked once per name and device type, then cached:
    this sits on the per-call dispatch path)."""
    key = (name, device.type)
    if key in _RESOLVED:
        return _RESOLVED[key]
    backend = get_backend(auto_backend_name(device) if name == "auto" else name)
    backend.require(device.type)
    _RESOLVED[key] = backend
    return backend


def available_backends() -> list[str]:
    return [name for name, b in BACKENDS.items() if b.available]
