"""The launch floor: a compiled Triton kernel called through its C launcher directly.

``JITFunction.run`` (``fn[grid](*args)``) does, on every call, what only changes when a kernel
is compiled: it parses the keyword options, binds the arguments and computes their
specialisation, builds the cache key as a string, looks the ``CompiledKernel`` up, checks the
kernel's globals, reads the current device and stream and builds launch metadata for the hooks;
only then does it call ``kernel.run``, the C launcher. :class:`DirectLauncher` does the first
launch of each specialisation through that path, keeps the ``CompiledKernel`` it returns, and
afterwards calls the C launcher with the same arguments ``JITFunction.run`` passes it.

The caller's key must be at least as fine as Triton's specialisation
(``native_specialize_impl``: a pointer on 16-byte alignment, an int on ``== 1``, on
divisibility by 16 and on whether it fits int32); :class:`fqr.lowering.kernel.Kernel` keys on
each input pointer's address modulo 16 and on the exact values of the specialised ints (row
strides, table rows), which is finer, and leaves out the token count (``do_not_specialize``).

The calling convention of ``CompiledKernel.run`` was read in Triton 3.6 and 3.9
(``triton/runtime/jit.py``, ``JITFunction.run``; ``triton/compiler/compiler.py``,
``CompiledKernel.__getitem__``): ``run(grid_x, grid_y, grid_z, stream, function,
packed_metadata, launch_metadata, enter_hook, exit_hook, *bound_args)`` with every parameter's
value (constexprs included) in signature order. On any other Triton version, under the
interpreter, or while a launch hook is installed (a profiler), :func:`direct_launcher` returns
None and the kernel launches through ``fn[grid]`` as before.
"""

from __future__ import annotations

import logging
import types
from typing import Any

import torch

from .bundle import launch_through_triton

log = logging.getLogger(__name__)

# Triton releases whose launcher convention this module was written against.
SUPPORTED_TRITON = ("3.6", "3.9")


def triton_supports_direct_launch(version: str) -> bool:
    """Whether ``version`` (``triton.__version__``) is one this launcher was checked against."""
    return any(version == v or version.startswith(v + ".") for v in SUPPORTED_TRITON)


class DirectLauncher:
    """Launch one ``@triton.jit`` function through its compiled kernels' C launchers.

    ``options``: launch options (``num_warps``). :meth:`launch` takes the runtime arguments,
    the constexpr values (in signature order, after the runtime arguments) and a
    specialisation ``key`` that the caller computed from the arguments: at least as fine as
    Triton's own specialisation (see the module docstring). A key seen for the first time
    launches through ``fn[grid]``, which compiles or finds the kernel; its ``CompiledKernel``
    is kept for the key. ``stream`` and ``device`` read the current CUDA stream and device
    (Triton's driver and torch by default).
    """

    def __init__(self, fn: Any, options: dict[str, Any], *, runtime=None, stream=None, device=None):
        if runtime is None:
            from triton import knobs
            from triton.runtime import driver

            runtime, stream = knobs.runtime, driver.active.get_current_stream
            # torch.cuda.current_device without its lazy-init check (CUDA is up by now)
            device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)
        self.fn = fn
        self.options = options
        self._bound: dict[tuple, tuple] = {}
        self._runtime = runtime
        self._stream = stream
        self._device = device
        self.compiles = 0  # keys bound (each a first launch through fn[grid])

    def hooks_installed(self) -> bool:
        """A launch hook (a profiler such as proton) wants Triton's own launch path."""
        rt = self._runtime
        return bool(rt.launch_enter_hook.calls or rt.launch_exit_hook.calls)

    def bound(self, device: int, key) -> tuple | None:
        """``(c_launcher, function, packed_metadata)`` of the kernel bound for ``key`` on
        ``device`` (None before its first launch): what a generated host function calls."""
        return self._bound.get((device, key))

    def launch(self, grid: tuple[int, ...], args: list, constexprs: dict[str, Any], key) -> None:
        device = self._device()
        bound = self._bound.get((device, key))
        if bound is None or self.hooks_installed():
            kernel = launch_through_triton(self.fn, grid, args, {**constexprs, **self.options})
            if kernel is None or self.hooks_installed():
                return
            run = kernel.run  # loads the module: binds function and launcher
            self._bound[(device, key)] = (run, kernel.function, kernel.packed_metadata)
            self.compiles += 1
            log.info(
                "compiled %s for device %s, launch key %s",
                getattr(self.fn, "__name__", self.fn),
                device,
                key,
            )
            return
        run, function, packed = bound
        run(
            grid[0],
            grid[1],
            grid[2] if len(grid) > 2 else 1,  # split-K's K ranges
            self._stream(device),
            function,
            packed,
            None,
            None,
            None,
            *args,
            *constexprs.values(),
        )


# What a Triton launcher's inner ``launch`` must be to be called without its ``__call__``: the
# C function of the launcher module (a wrapper, e.g. for tensor descriptors, is Python).
C_FUNCTION_TYPES: tuple[type, ...] = (types.BuiltinFunctionType,)


def inner_c_launch(run: Any, version: str | None = None) -> tuple | None:
    """The C function under a bound Triton launcher and the constants its ``__call__`` adds,
    ``(launch, cooperative_grid, pdl, arg_annotations, kernel_signature)``, where calling it
    directly is what ``__call__`` does; else None (call ``run`` itself).

    Read in Triton 3.9's installed ``triton/backends/nvidia/driver.py`` (``CudaLauncher``;
    the 3.6 layout from published excerpts of the same class, without GSan):
    ``__call__(gx, gy, gz, stream, function, packed_metadata, launch_metadata, enter_hook,
    exit_hook, *args)`` allocates the global and profile scratch buffers (None where their
    sizes are 0), adds GSan's arguments when GSan is on, and calls ``self.launch(gx, gy, gz,
    stream, function, self.launch_cooperative_grid, self.launch_pdl, packed_metadata,
    launch_metadata, enter_hook, exit_hook, global_scratch, profile_scratch,
    self.arg_annotations, self.kernel_signature, args)``. So where both scratch sizes are 0,
    GSan is off and ``self.launch`` is the C function itself (no tensor-descriptor wrapper),
    that one call is all it does: the generated host function makes it with the constants
    returned here and Nones for the scratch buffers, the hooks and the launch metadata (the
    host function runs only without hooks, as :class:`DirectLauncher`). The class's
    ``__call__`` must also read those attributes (its code object's names), so a release that
    renamed them or calls something else is not taken for this one. Any other launcher class,
    Triton version or attribute layout: None."""
    if version is None:
        try:
            import triton
        except ImportError:  # pragma: no cover
            return None
        version = triton.__version__
    if not triton_supports_direct_launch(version) or type(run).__name__ != "CudaLauncher":
        return None
    try:
        launch = run.launch
        plain = (
            run.global_scratch_size == 0
            and run.profile_scratch_size == 0
            and not getattr(run, "gsan_enabled", False)
        )
        constants = (
            run.launch_cooperative_grid,
            run.launch_pdl,
            run.arg_annotations,
            run.kernel_signature,
        )
    except AttributeError:
        return None
    if not plain or not isinstance(launch, C_FUNCTION_TYPES):
        return None
    # and ``__call__`` itself reads what the call above passes (its code object's names)
    call = getattr(type(run).__call__, "__code__", None)
    if call is None or not _CALL_READS <= set(call.co_names):
        return None
    return (launch, *constants)


_CALL_READS = frozenset(
    ("launch", "launch_cooperative_grid", "launch_pdl", "arg_annotations", "kernel_signature")
)


def direct_launcher(fn: Any, options: dict[str, Any]) -> DirectLauncher | None:
    """A :class:`DirectLauncher` for ``fn`` where the installed Triton supports one, else None
    (launch with ``fn[grid]``)."""
    try:
        import triton
        from triton.runtime.jit import JITFunction
    except ImportError:  # pragma: no cover - no triton, no compiled kernel either
        return None
    if not isinstance(fn, JITFunction) or not triton_supports_direct_launch(triton.__version__):
        return None
    if not torch.cuda.is_available():
        return None
    return DirectLauncher(fn, options)
