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
from typing import Any

import torch

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

    def launch(self, grid: tuple[int, int], args: list, constexprs: dict[str, Any], key) -> None:
        device = self._device()
        bound = self._bound.get((device, key))
        if bound is None or self.hooks_installed():
            kernel = self.fn[grid](*args, **constexprs, **self.options)
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
            1,
            self._stream(device),
            function,
            packed,
            None,
            None,
            None,
            *args,
            *constexprs.values(),
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
