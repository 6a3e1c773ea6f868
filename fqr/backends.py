"""Backend registry and detection.

A backend runs a traced :class:`fqr.core.Program` on concrete tensors:

==================== ========================================================================
``reference``        the primitives' torch ``impl`` rules in fp32 (:func:`fqr.core.eval_program`),
                     chunk by chunk over the tokens; any device
``interpret``        the kernel generated for lowering target ``interpret`` (the ``cuda``
                     profile's code) run by upstream Triton's interpreter on CPU tensors: slow,
                     for CI and debugging
``triton``           the kernel generated for target ``cuda``, compiled by upstream Triton on a
                     CUDA GPU
``ascend``           the kernel generated for target ``ascend``, compiled by Triton-Ascend on
                     an NPU
``ascend-interpret`` the ``ascend``-target kernel under Triton-Ascend's interpreter on CPU
``ascend-on-cuda``   the ``ascend``-target kernel compiled by upstream Triton on CUDA with an
                     Ascend-sized persistent grid (a test backend)
==================== ========================================================================

``auto`` (:data:`AUTO_BACKENDS`) picks ``triton`` for CUDA tensors, ``ascend`` for NPU tensors,
``reference`` otherwise (never an interpreter: it is slow).

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
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.autograd.function import once_differentiable

from .core import TOKENS, Program, eval_program, lookup
from .lowering.bundle import active_writer, building_for
from .lowering.targets import ACCELERATOR_TARGETS


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
    _runner: Callable[..., list] = field(init=False, repr=False)

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
        if device_type == "meta" and self.target is not None and building_for(self.home_device):
            return  # a bundle build for this backend's device: meta launches compiled, not run
        if device_type not in self.device_types:
            where = where or f"{device_type} tensors"
            raise ValueError(
                f"{named} runs on {'/'.join(self.device_types)} tensors, not on {where}"
            )
        reason = self.unavailable_reason()
        if reason:
            raise BackendUnavailable(f"{named} is unavailable: {reason}")

    def bind(self, program: Program) -> Callable[..., list[torch.Tensor]]:
        """:meth:`launch` for one program, with the program's kernels looked up once: the
        per-call path of the public ops (the kernels are lowered on the first call)."""
        runner = self._runner
        kernels_of = getattr(runner, "kernels_of", None)

        def launch(args: list, out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
            if torch.is_grad_enabled() and any(a.requires_grad for a in args):
                if out is not None:
                    raise ValueError("out= cannot record gradients: pass inputs without grad")
                return list(DifferentiableRun.apply(runner, program, *args))
            if kernels_of is None:
                return runner(program, args) if out is None else runner(program, args, out)
            return kernels_of(program).launch(args, out, donate=True)

        return launch

    @property
    def has_kernels(self) -> bool:
        """Whether it runs generated kernels (which have a generated host function)."""
        return hasattr(self._runner, "kernels_of")

    def host_function(self, program: Program, args: list, out: list[torch.Tensor] | None = None):
        """The generated host function (:func:`fqr.lowering.host.host_function`) of
        ``program``'s kernels for calls with ``args``' metadata, or None (no kernel, or a call
        it does not cover)."""
        kernels_of = getattr(self._runner, "kernels_of", None)
        if kernels_of is None:
            return None
        from .lowering.host import host_function

        return host_function(kernels_of(program), args, out)

    def bound_kernels(self, program: Program) -> int:
        """:func:`fqr.lowering.host.bound_keys` of ``program``'s kernels (0 without any)."""
        kernels_of = getattr(self._runner, "kernels_of", None)
        if kernels_of is None:
            return 0
        from .lowering.host import bound_keys

        return bound_keys(kernels_of(program))

    def launch(
        self, program: Program, args: list, out: list[torch.Tensor] | None = None
    ) -> list[torch.Tensor]:
        """Run ``program`` on ``args``, unchecked: for callers that resolved the backend
        (:func:`resolve_backend`) and validated their arguments (the per-call hot path).
        ``out``: ``[T, width]`` tensors (rows may be strided, e.g. views into the packed input
        for an in-place call), or ``[T, H, D]`` views whose heads sit at a stride (e.g.
        ``q.view(T, H, 192)[:, :, 128:]``: the rope part of each head, rotated in place), the
        outputs are written into and returned as. An input the
        program updates (:meth:`fqr.core.Program.aliases`: a paged cache) is donated: it is
        updated in place, and the output is that tensor.

        Under grad mode, with an input that requires grad, the outputs carry a ``grad_fn``
        (:class:`DifferentiableRun`): the same policy on every backend (not with ``out``)."""
        if torch.is_grad_enabled() and any(a.requires_grad for a in args):
            if out is not None:
                raise ValueError("out= cannot record gradients: pass inputs without grad")
            return list(DifferentiableRun.apply(self._runner, program, *args))
        if out is None:
            return self._runner(program, args)
        return self._runner(program, args, out)


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


def _ascend_env_advice() -> str:
    """How to get triton-ascend here: ``make ascend-env`` in a source checkout (its Makefile
    and script sit beside the package), else the ``npu`` extra in an environment of its own."""
    checkout = Path(__file__).resolve().parent.parent
    if (checkout / "Makefile").is_file() and (checkout / "scripts" / "ascend-env.sh").is_file():
        return "use the Ascend environment: make ascend-env"
    return "install 'fqr[npu]' into an environment of its own, without upstream triton"


def _reason_ascend() -> str | None:
    if _triton_flavour() != "ascend":
        return f"triton-ascend is not installed ({_ascend_env_advice()})"
    if importlib.util.find_spec("torch_npu") is None:
        return "torch_npu is not installed"
    if not _npu_present():
        return "torch_npu found no NPU (is CANN installed and a device visible?)"
    return None


def _reason_ascend_interpret() -> str | None:
    if _triton_flavour() != "ascend":
        return f"triton-ascend is not installed ({_ascend_env_advice()})"
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


def _run_reference(program: Program, args: list, out: list | None = None) -> list:
    """The primitives' impl rules in fp32, chunk by chunk over the tokens: only one chunk's
    fp32 intermediates live at a time, so the peak is the outputs plus a bounded working set
    (one whole-batch evaluation peaks near 8.5x the qkv bytes). ``out``: write there (each
    chunk's rows are read before they are written, so ``out`` may alias the inputs' rows); an
    ``out`` entry may be ``[T, width]`` or a ``[T, H, D]`` view (heads at a stride: each row's
    ``H * D`` values go to its heads)."""
    slices = token_slices(program, args)
    if slices is None:
        part = _donate(program, args, eval_program(program, args, torch.float32))
        if out is None:
            return part
        for o, p in zip(out, part):
            o.copy_(p.reshape(o.shape))
        return out
    tokens, outs = slices[-1].stop, out
    for rows in slices:
        part = eval_program(program, chunk_args(program, args, rows), torch.float32)
        if outs is None:
            outs = [
                torch.empty((tokens, *p.shape[1:]), dtype=p.dtype, device=p.device) for p in part
            ]
        for o, p in zip(outs, part):
            o[rows] = p.reshape(p.shape[0], *o.shape[1:])
    return outs


def _donate(program: Program, args: list, outs: list) -> list:
    """Write each output that updates an input (a paged cache) into that input's buffer and
    return the buffer: every backend updates a donated input in place (the kernels store into
    it; here the functional result is copied back)."""
    for i, j in program.aliases().items():
        args[j].copy_(outs[i])
        outs[i] = args[j]
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


def _kernel_runner(target: str, register: Callable[[], object] | None = None):
    variants: dict[int, object] = {}  # id(program) -> KernelsByTokens; programs are cached

    def kernels_of(program: Program):
        found = variants.get(id(program))
        if found is None or found.program is not program:
            from .lowering import lower_by_tokens

            if register is not None:
                register()
            found = variants[id(program)] = lower_by_tokens(program, target=target)
        return found

    def run(program: Program, args: list, out: list | None = None) -> list:
        return kernels_of(program).launch(args, out, donate=True)

    run.kernels_of = kernels_of  # type: ignore[attr-defined]
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
            ("cpu", "cuda", "npu", "meta"),  # meta: shapes and devices only, no values
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

# ``backend="auto"``: the compiled kernel on each accelerator -- the backend whose target is the
# one the lowering compiles for that device (fqr.lowering.targets.ACCELERATOR_TARGETS); anything
# else runs the reference rules.
AUTO_BACKENDS = {
    device: next(b.name for b in BACKENDS.values() if b.target == target)
    for device, target in ACCELERATOR_TARGETS.items()
}


def get_backend(name: str) -> Backend:
    return lookup(BACKENDS, name, "backend", extra_choices=("auto",))


def auto_backend_name(device: torch.device | str) -> str:
    """The backend ``auto`` picks for tensors on ``device`` (a device or a device type); on
    ``meta`` while a kernel bundle is built, the one it picks on the bundle's device (the
    build makes the launches the GPU run makes)."""
    device_type = device if isinstance(device, str) else device.type
    writer = active_writer() if device_type == "meta" else None
    if writer is not None:
        device_type = writer.target.backend
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
    if device.type != "meta":  # on meta it depends on whether a bundle is being built
        _RESOLVED[key] = backend
    return backend


def available_backends() -> list[str]:
    return [name for name, b in BACKENDS.items() if b.available]
