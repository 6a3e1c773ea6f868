"""Backend registry and detection.

A backend runs a traced :class:`fqr.core.Program` on concrete tensors:

=================  ===========================================================================
``reference``      the primitives' torch ``impl`` rules in fp32 (:func:`fqr.core.eval_program`);
                   any device
``interpret``      the generated Triton kernel (target ``cuda`` source) under ``TRITON_INTERPRET=1``
                   on CPU tensors: slow, for CI and debugging
``triton``         the generated kernel compiled by upstream Triton on a CUDA GPU
``ascend``         the generated kernel (target ``ascend``) compiled by Triton-Ascend on an NPU
``ascend-interpret`` the ``ascend``-target kernel under Triton-Ascend's interpreter on CPU
=================  ===========================================================================

``auto`` picks ``triton`` for CUDA tensors, ``ascend`` for NPU tensors, ``reference`` otherwise
(never the interpreter: it is slow).

Every backend follows one autograd policy: under grad mode, when an input requires grad, the
outputs carry a ``grad_fn`` whose backward is the op's math differentiated through the reference
rules (:class:`DifferentiableRun`); otherwise nothing is recorded.
"""

from __future__ import annotations

import functools
import importlib.metadata as md
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from .core import TOKENS, Program, eval_program


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run here; the message says why."""


@dataclass(frozen=True)
class Backend:
    name: str
    description: str
    device_types: tuple[str, ...]
    _availability: Callable[[], str | None]  # None when available, else the reason
    _runner: Callable[[Program, list], list]

    def unavailable_reason(self) -> str | None:
        return self._availability()

    @property
    def available(self) -> bool:
        return self.unavailable_reason() is None

    def run(self, program: Program, args: list) -> list[torch.Tensor]:
        reason = self.unavailable_reason()
        if reason:
            raise BackendUnavailable(f"backend {self.name!r} is unavailable: {reason}")
        devices = {a.device.type for a in args if isinstance(a, torch.Tensor)}
        wrong = devices - set(self.device_types)
        if wrong:
            raise ValueError(
                f"backend {self.name!r} runs on {'/'.join(self.device_types)} tensors, "
                f"got {'/'.join(sorted(wrong))} tensors"
            )
        return self._runner(program, args)

    def launch(self, program: Program, args: list) -> list[torch.Tensor]:
        """:meth:`run` without the checks, for callers that resolved the backend already
        (:func:`resolve_backend`) and validated their arguments (the per-call hot path).

        Under grad mode, with an input that requires grad, the outputs carry a ``grad_fn``
        (:class:`DifferentiableRun`): the same policy on every backend."""
        if torch.is_grad_enabled() and any(a.requires_grad for a in args):
            return list(DifferentiableRun.apply(self._runner, program, *args))
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


REFERENCE_CHUNK_ELEMENTS = 1 << 18  # token-indexed input elements evaluated at once


def _token_indexed(program: Program) -> list[bool]:
    return [bool(v.aval.shape) and v.aval.shape[0] == TOKENS for v in program.inputs]


def token_slices(
    program: Program, args: list, max_elements: int | None = None
) -> list[slice] | None:
    """Slices of the token dim holding at most ``max_elements`` (default
    :data:`REFERENCE_CHUNK_ELEMENTS`) token-indexed input elements each; None when one piece
    does (or when an output is not token-indexed: its rows would not be independent)."""
    max_elements = max_elements or REFERENCE_CHUNK_ELEMENTS
    indexed = _token_indexed(program)
    if not any(indexed) or not all(
        bool(v.aval.shape) and v.aval.shape[0] == TOKENS for v in program.outputs
    ):
        return None
    tokens = next(a.shape[0] for a, i in zip(args, indexed) if i)
    row = sum(a[0].numel() for a, i in zip(args, indexed) if i and a.shape[0])
    step = max(1, max_elements // max(row, 1))
    if tokens <= step:
        return None
    return [slice(s, min(s + step, tokens)) for s in range(0, tokens, step)]


def chunk_args(program: Program, args: list, rows: slice) -> list:
    """``args`` with every token-indexed input cut to ``rows``."""
    return [a[rows] if i else a for a, i in zip(args, _token_indexed(program))]


def _run_reference(program: Program, args: list) -> list:
    """The primitives' impl rules in fp32, chunk by chunk over the tokens: only one chunk's
    fp32 intermediates live at a time, so the peak is the outputs plus a bounded working set
    (one whole-batch evaluation peaks near 8.5x the qkv bytes)."""
    slices = token_slices(program, args)
    if slices is None:
        return eval_program(program, args, torch.float32)
    tokens, outs = slices[-1].stop, None
    for rows in slices:
        part = eval_program(program, chunk_args(program, args, rows), torch.float32)
        if outs is None:
            outs = [
                torch.empty((tokens, *p.shape[1:]), dtype=p.dtype, device=p.device) for p in part
            ]
        for o, p in zip(outs, part):
            o[rows] = p
    return outs


def reference_vjp(program: Program, args: list, cotangents, needed) -> list:
    """The vector-Jacobian product of ``program`` at ``args``: autograd through the primitives'
    reference rules in fp32 (what the reference backend computes), chunk by chunk over the
    tokens like :func:`_run_reference`. ``needed[i]``: whether input ``i`` wants a gradient;
    returns one gradient (or None) per input, in the input's dtype."""
    slices = token_slices(program, args) or [slice(0, None)]
    indexed = _token_indexed(program)
    grads: list = [None] * len(args)
    for rows in slices:
        part = [
            (a[rows] if i else a).detach().requires_grad_(bool(need))
            for a, i, need in zip(args, indexed, needed)
        ]
        with torch.enable_grad():
            outs = eval_program(program, part, torch.float32)
        pairs = [(o, c[rows]) for o, c in zip(outs, cotangents) if o.requires_grad]
        wrt = [p for p, need in zip(part, needed) if need]
        if not pairs or not wrt:
            continue
        got = iter(
            torch.autograd.grad(
                [o for o, _ in pairs], wrt, [c for _, c in pairs], allow_unused=True
            )
        )
        for k, (a, i, need) in enumerate(zip(args, indexed, needed)):
            if not need:
                continue
            g = next(got)
            if g is None:
                continue
            if i:
                if grads[k] is None:
                    grads[k] = torch.zeros_like(a, memory_format=torch.contiguous_format)
                grads[k][rows] = g
            else:
                grads[k] = g if grads[k] is None else grads[k] + g
    return grads


class DifferentiableRun(torch.autograd.Function):
    """A backend's run of ``program`` as one autograd node, for every backend alike.

    Forward: the backend's own run (reference, or a generated kernel). Backward:
    :func:`reference_vjp`, the gradient of the op's math through the reference rules in fp32,
    recomputed from the saved inputs (nothing else is kept). Kernels and the reference agree
    within the numerics contract, so this is the gradient of what the forward computed; the
    ``unfused`` roundings pass gradients straight through, as ``Tensor.to`` does. Policy (issue
    14): a real backward on every backend rather than an error, because training and
    fine-tuning through a model whose prologue fqr fuses need it and the forward alone gives
    it no cost under ``no_grad``/``inference_mode`` (vLLM's case). Second derivatives are
    refused (``once_differentiable``).
    """

    @staticmethod
    def forward(ctx, runner, program: Program, *args):
        ctx.program = program
        ctx.save_for_backward(*args)
        return tuple(runner(program, list(args)))

    @staticmethod
    @once_differentiable
    def backward(ctx, *cotangents):
        args = ctx.saved_tensors
        grads = reference_vjp(ctx.program, list(args), cotangents, ctx.needs_input_grad[2:])
        return (None, None, *grads)


def _kernel_runner(target: str):
    kernels: dict[int, object] = {}  # id(program) -> Kernel; programs are cached, ids stable

    def run(program: Program, args: list) -> list:
        kernel = kernels.get(id(program))
        if kernel is None or kernel.program is not program:
            from .lowering import lower

            kernel = kernels[id(program)] = lower(program, target=target)
        return kernel.launch(args)

    return run


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in [
        Backend(
            "reference",
            "torch impl rules, fp32 compute",
            ("cpu", "cuda", "npu"),
            lambda: None,
            _run_reference,
        ),
        Backend(
            "interpret",
            "generated kernel, Triton interpreter (CPU)",
            ("cpu",),
            _reason_interpret,
            _kernel_runner("interpret"),
        ),
        Backend(
            "triton",
            "generated kernel, Triton on CUDA",
            ("cuda",),
            _reason_triton,
            _kernel_runner("cuda"),
        ),
        Backend(
            "ascend",
            "generated kernel, Triton-Ascend on NPU",
            ("npu",),
            _reason_ascend,
            _kernel_runner("ascend"),
        ),
        Backend(
            "ascend-interpret",
            "ascend-target kernel, Triton-Ascend interpreter (CPU)",
            ("cpu",),
            _reason_ascend_interpret,
            _kernel_runner("ascend-interpret"),
        ),
    ]
}


def get_backend(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"backend must be one of auto, {', '.join(BACKENDS)}; got {name!r}"
        ) from None


def auto_backend_name(device: torch.device) -> str:
    return {"cuda": "triton", "npu": "ascend"}.get(device.type, "reference")


_RESOLVED: dict[tuple[str, str], Backend] = {}


def resolve_backend(name: str, device: torch.device) -> Backend:
    """The backend to run on ``device`` (checked once per name and device type, then cached:
    this sits on the per-call dispatch path)."""
    key = (name, device.type)
    if key in _RESOLVED:
        return _RESOLVED[key]
    backend = get_backend(auto_backend_name(device) if name == "auto" else name)
    if device.type not in backend.device_types:
        raise ValueError(
            f"backend {backend.name!r} runs on {'/'.join(backend.device_types)} "
            f"tensors, but qkv is on {device.type}"
        )
    reason = backend.unavailable_reason()
    if reason:
        raise BackendUnavailable(f"backend {backend.name!r} is unavailable: {reason}")
    _RESOLVED[key] = backend
    return backend


def available_backends() -> list[str]:
    return [name for name, b in BACKENDS.items() if b.available]
