"""The launch floor: a compiled Triton kernel called through its C launcher directly.

``JITFunction.run`` (``fn[grid](*args)``) does, on every call, what only changes when a kernel
is compiled: it parses the keyword options, binds the arguments and computes their
specialisation, builds the cache key as a string, looks the ``CompiledKernel`` up, checks the
kernel's globals, reads the current device and stream and builds launch metadata for the hooks;
only then does it call ``kernel.run``, the C launcher. :class:`DirectLauncher` does the first
launch of each specialisation through that path, keeps the ``CompiledKernel`` it returns, and
afterwards calls the C launcher with the same arguments ``JITFunction.run`` passes it.

The specialisation key mirrors Triton's own (``native_specialize_impl``): a pointer is
specialised on 16-byte alignment, an int on ``== 1``, on divisibility by 16 and on whether it
fits int32; arguments Triton does not specialise (``do_not_specialize``, the token count) are
left out. Keys are tuples of bools, so the lookup costs a few integer operations.

The calling convention of ``CompiledKernel.run`` was read in Triton 3.6 and 3.9
(``triton/runtime/jit.py``, ``JITFunction.run``; ``triton/compiler/compiler.py``,
``CompiledKernel.__getitem__``): ``run(grid_x, grid_y, grid_z, stream, function,
packed_metadata, launch_metadata, enter_hook, exit_hook, *bound_args)`` with every parameter's
value (constexprs included) in signature order. On any other Triton version, under the
interpreter, or while a launch hook is installed (a profiler), :func:`direct_launcher` returns
None and the kernel launches through ``fn[grid]`` as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

# Triton releases whose launcher convention this module was written against.
SUPPORTED_TRITON = ("3.6", "3.9")

_INT32 = (-(2**31), 2**31)


def triton_supports_direct_launch(version: str) -> bool:
    """Whether ``version`` (``triton.__version__``) is one this launcher was checked against."""
    return any(version == v or version.startswith(v + ".") for v in SUPPORTED_TRITON)


def int_class(value: int) -> tuple[bool, bool, bool]:
    """What Triton specialises an int argument on: ``== 1``, ``% 16 == 0``, fits int32."""
    return (value == 1, value % 16 == 0, _INT32[0] <= value < _INT32[1])


class DirectLauncher:
    """Launch one ``@triton.jit`` function through its compiled kernels' C launchers.

    ``arg_kinds``: for each runtime argument of a launch, ``"ptr"`` (a tensor), ``"int"`` (a
    specialised int) or ``"free"`` (an int Triton does not specialise); ``constexprs``: the
    values of the constexpr parameters that follow them (in signature order); ``options``:
    launch options (``num_warps``). A call whose key has not been seen goes through
    ``fn.run``, which compiles or finds the kernel and launches it; its ``CompiledKernel`` is
    kept for the key.
    """

    def __init__(self, fn: Any, arg_kinds: Sequence[str], options: dict[str, Any]) -> None:
        from triton import knobs
        from triton.runtime import driver

        self.fn = fn
        self.options = options
        self._ptrs = [i for i, k in enumerate(arg_kinds) if k == "ptr"]
        self._ints = [i for i, k in enumerate(arg_kinds) if k == "int"]
        self._bound: dict[tuple, tuple] = {}
        self._runtime = knobs.runtime
        self._stream = driver.active.get_current_stream
        self._device = torch.cuda.current_device
        self.compiles = 0  # keys bound (each a first launch through fn.run)

    def key(self, args: Sequence[Any], constexprs: tuple) -> tuple:
        """The specialisation ``args`` (and the constexpr values) select."""
        return (
            constexprs,
            tuple(args[i].data_ptr() % 16 == 0 for i in self._ptrs),
            tuple(int_class(args[i]) for i in self._ints),
        )

    def hooks_installed(self) -> bool:
        rt = self._runtime
        return bool(rt.launch_enter_hook.calls or rt.launch_exit_hook.calls)

    def __call__(self, grid: tuple[int, int], args: list, constexprs: dict[str, Any]) -> None:
        values = tuple(constexprs.values())
        device = self._device()
        key = (device, self.key(args, values))
        bound = self._bound.get(key)
        if bound is None or self.hooks_installed():
            kernel = self.fn[grid](*args, **constexprs, **self.options)
            if kernel is None or self.hooks_installed():
                return
            kernel.run  # noqa: B018  (loads the module: binds function and launcher)
            self._bound[key] = (kernel.run, kernel.function, kernel.packed_metadata)
            self.compiles += 1
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
            *values,
        )


def direct_launcher(fn: Any, arg_kinds: Sequence[str], options: dict[str, Any]):
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
    return DirectLauncher(fn, arg_kinds, options)
