"""The host path at the launch floor: one generated Python function per checked call.

A call whose arguments passed the checks once (``fqr.prologue.CheckedCall``) has fixed
argument metadata: dtypes, devices, every size but T, every stride, the table rows. What is left
per call is T, the pointers, the grad mode and the current device and stream. :func:`host_function`
writes a function for exactly that: its source is built from the kernel variants' facts (the
argument order of :meth:`.kernel.Kernel.launch_arguments`, the strides and rows as literals, the
token buckets and each variant's grid as integer expressions), compiled once with ``compile`` /
``exec`` into a fresh namespace (never written to disk), and it

* picks the variant for T by integer comparisons (the buckets of ``Target.token_buckets``),
* checks what the metadata key cannot hold: T > 0, no input that requires grad under grad mode,
  every pointer 16-byte aligned (an input that was not, as mRoPE's position planes at odd T,
  at its residue then or aligned: each launches the kernel bound for that alignment), the
  current device the tensors' device, no launch hook installed,
* allocates each output with its own ``torch.empty`` (outputs never share memory: see the
  comment where they are allocated), or writes into the caller's ``out``,
* calls the C function under the variant's bound Triton launcher
  (:func:`.launcher.inner_c_launch`: what ``CudaLauncher.__call__`` would call, without its
  Python), else the bound launcher (``CompiledKernel.run``, as
  :class:`.launcher.DirectLauncher` does), with the precomputed argument order, or, where
  Triton has no bound launcher (the interpreter), ``fn[grid]`` with the same arguments.

It returns None whenever one of those checks fails or a variant has not been bound yet: the
caller then takes the general path (:meth:`.kernel.Kernel.launch`), which binds the variant, and
regenerates the function once something new was bound (:func:`bound_keys`). T never reaches
Triton's specialisation, so no T compiles anything.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .kernel import Kernel
from .launcher import inner_c_launch

BUILDS = 0  # host functions generated in this process (tests count them)


@dataclass(frozen=True)
class HostFunction:
    """A generated host function: ``fn(args)`` (``fn(args, out)`` when built for ``out``)
    returns the outputs as a tuple, or None where the general path must run the call.
    ``source``: its text; ``covered``: the bucket indices it launches itself; ``bound``: the
    :func:`bound_keys` count it was built at."""

    fn: Callable[..., tuple | None]
    source: str
    covered: tuple[int, ...]
    bound: int


def bound_keys(variants) -> int:
    """How many (variant, specialisation) pairs are ready to launch without Triton's
    ``JITFunction.run``: grows when the general path binds one, the cue to regenerate."""
    total = 0
    kernels = variants.kernels + [k._strided for k in variants.kernels if k._strided]
    kernels += [k._index_strided for k in kernels if k._index_strided]
    for kernel in kernels:
        direct = kernel._direct
        if direct is None:
            total += 1  # launched through fn[grid]: ready once lowered
        elif direct is not False:
            total += len(direct._bound)
    return total


class _Arg:
    """Stands for argument ``name`` while the argument order is recorded: reads the real
    tensor's strides and sizes, and is found again by identity."""

    def __init__(self, name: str, tensor: torch.Tensor):
        self.name, self._t = name, tensor
        self.shape = tensor.shape
        self.ndim = tensor.dim()

    def stride(self, dim: int) -> int:
        return self._t.stride(dim)

    def data_ptr(self) -> int:
        return self._t.data_ptr()

    def runtime_length(self) -> _Length:
        return _Length(self.name)


class _Tokens:
    """Stands for T in the recorded argument order."""


class _Length:
    """Stands for an argument's length ``[N]``, read at run time (a slot mapping shorter than T)."""

    def __init__(self, name: str):
        self.name = name


class _Unsupported(Exception):
    pass


def _literal(value: Any) -> str:
    if isinstance(value, _Arg):
        return value.name
    if isinstance(value, _Tokens):
        return "T"
    if isinstance(value, _Length):
        return f"{value.name}.shape[0]"
    if type(value) is int or type(value) is bool:
        return repr(value)
    raise _Unsupported(f"argument kind {type(value).__name__}")


def host_function(variants, args: list, out: list | None = None) -> HostFunction | None:
    """Generate the host function of ``variants`` (a :class:`fqr.lowering.KernelsByTokens`) for
    calls with ``args``' metadata (and ``out``'s strides when given); None where a call of this
    kind is not covered (an argument that is not a tensor, an argument kind the generator does
    not know, outputs of several dtypes into ``out=None`` with misaligned offsets is still
    covered). Only the variants lowered and bound so far are launched by it."""
    global BUILDS
    if not args or not all(isinstance(a, torch.Tensor) for a in args):
        return None
    if args[0].device.type == "meta":  # a bundle build: every call takes Kernel.launch
        return None
    if any(k is not None and k.tiling.uses_workspace for k in variants._kernels):
        return None  # split-K allocates its workspace per call: Kernel.launch runs it
    if out is not None and not all(isinstance(o, torch.Tensor) for o in out):
        return None
    kernels: list[Kernel | None] = list(variants._kernels)
    if out is not None and any(o.dim() == 3 for o in out):
        # [T, H, D] views run the kernels whose outputs take their head strides (each lowered
        # by the general path's first such call)
        kernels = [None if k is None else k._strided for k in kernels]
    first_lowered = next((k for k in kernels if k is not None), None)
    if first_lowered is not None and first_lowered.strided_index(args):
        # strided positions or slots run the kernels that take their strides (each lowered by
        # the general path's first such call)
        kernels = [None if k is None else k._index_strided for k in kernels]
    lowered = [k for k in kernels if k is not None]
    if not lowered:
        return None
    first = lowered[0]
    program = first.program
    device = args[0].device
    names = [f"a{i}" for i in range(len(args))]
    proxies = [_Arg(n, a) for n, a in zip(names, args)]
    widths = [int(v.aval.shape[1]) for v in program.outputs]
    dtypes = [v.aval.dtype for v in program.outputs]
    onames = [f"o{j}" for j in range(len(widths))]
    ns: dict[str, Any] = {
        "EMPTY": torch.empty,
        "GRAD": torch.is_grad_enabled,
        "DEVICE": device,
    }
    lines = [f"def run(args{', out' if out is not None else ''}):"]
    lines.append(f"    {', '.join(names)}, = args")
    lines.append("    T = a0.shape[0]")
    lines.append("    if T == 0:")
    lines.append("        return None")
    requires = " or ".join(f"{n}.requires_grad" for n in names)
    lines.append(f"    if GRAD() and ({requires}):")
    lines.append("        return None")
    direct_any = any(k._direct not in (None, False) for k in lowered)
    residues: dict[int, int] = {}  # inputs not 16-byte aligned: their address modulo 16
    if direct_any:
        # every pointer read once: checked here, passed as an int to the C launch
        pointers = [f"P_{n}" for n in names]
        for n in names:
            lines.append(f"    P_{n} = {n}.data_ptr()")
        if out is not None:
            for j in range(len(widths)):
                lines.append(f"    P_{onames[j]} = out[{j}].data_ptr()")
                pointers.append(f"P_{onames[j]}")
        # An input whose address is not 16-byte aligned in this call (mRoPE's position planes
        # at ``8 * T`` bytes when T is odd: every decode call) keeps its residue in the calls
        # of this metadata: each variant launches the kernel bound for that alignment, or for
        # all-aligned pointers when it is aligned after all. The others must be aligned.
        residues.update((k, a.data_ptr() & 15) for k, a in enumerate(args) if a.data_ptr() & 15)
        fixed = [p for k, p in enumerate(pointers) if k not in residues]
        if fixed:
            lines.append(f"    if ({' | '.join(fixed)}) & 15:")
            lines.append("        return None")
        launcher = next(k._direct for k in lowered if k._direct not in (None, False))
        ns["ENTER"] = launcher._runtime.launch_enter_hook
        ns["EXIT"] = launcher._runtime.launch_exit_hook
        ns["CURRENT"] = launcher._device
        ns["STREAM"] = launcher._stream
        lines.append("    if ENTER.calls or EXIT.calls:")
        lines.append("        return None")
    elif device.type not in ("cpu", "meta"):
        ns["CURRENT"] = torch.get_device_module(device).current_device
    if "CURRENT" in ns:  # another current device: the general path launches under a guard
        lines.append(f"    if CURRENT() != {device.index!r}:")
        lines.append("        return None")
    # the outputs
    if out is not None:
        lines.append(f"    {', '.join(onames)}, = out")
        for j, o in enumerate(out):
            # all strides at once: a [T, H, D] view (heads at a stride) is another call kind
            lines.append(f"    if {onames[j]}.stride() != {tuple(o.stride())!r}:")
            lines.append("        return None")
        out_proxies: list[Any] = [_Arg(n, o) for n, o in zip(onames, out)]
    else:
        # An output that updates an input (a paged cache) is that input, donated as the
        # general path's backends donate it; the others are allocated, once.
        aliases = getattr(first, "aliases", None) or {}
        for i, j in aliases.items():
            lines.append(f"    {onames[i]} = {names[j]}")
            if direct_any:
                lines.append(f"    P_{onames[i]} = P_{names[j]}")
        fresh = [i for i in range(len(widths)) if i not in aliases]
        # one allocation per output: outputs that shared one buffer would keep each other's
        # memory alive and alias each other, which torch's custom-op contract forbids
        for i in fresh:
            ns[f"DT{i}"] = dtypes[i]
            lines.append(f"    {onames[i]} = EMPTY((T, {widths[i]}), dtype=DT{i}, device=DEVICE)")
            if direct_any:
                lines.append(f"    P_{onames[i]} = {onames[i]}.data_ptr()")
        out_proxies = [_Placeholder(n, w) for n, w in zip(onames, widths)]
    result = f"({', '.join(onames)},)"
    # the tensors passed to a C launch by address: the inputs and the outputs fqr allocates
    addressed = frozenset(names + (onames if out is None else []))
    covered = []
    tokens = _Tokens()
    for i, kernel in enumerate(kernels):
        limit = variants._limits[i]
        indent = "    "
        if limit is not None:
            lines.append(f"    if T <= {limit}:")
            indent = "        "
        # (name suffix, residues, the test that picks it: None where nothing varies)
        launches: list[tuple[str, dict[int, int], str | None]] = [(f"{i}", {}, None)]
        if residues:
            aligned = f"({' | '.join(f'P_{names[k]}' for k in residues)}) & 15 == 0"
            at_residue = " and ".join(f"P_{names[k]} & 15 == {r}" for k, r in residues.items())
            launches = [(f"{i}", {}, aligned), (f"{i}m", residues, at_residue)]
        launched = False
        for tag, pattern, test in launches:
            body = _variant_body(
                tag, kernel, proxies, out_proxies, tokens, out is None, device, ns, addressed,
                pattern,
            )  # fmt: skip
            if body is None:
                continue
            launched = True
            inner = indent
            if test is not None:
                lines.append(f"{indent}if {test}:")
                inner = indent + "    "
            lines += [inner + b for b in body]
            lines.append(f"{inner}return {result}")
        lines.append(f"{indent}return None")
        if launched:
            covered.append(i)
        if limit is None:
            break
    if not covered:
        return None
    source = "\n".join(lines) + "\n"
    exec(compile(source, "<fqr host function>", "exec"), ns)
    BUILDS += 1
    return HostFunction(ns["run"], source, tuple(covered), bound_keys(variants))


class _Placeholder(_Arg):
    """An output fqr allocates: contiguous rows of ``width``, 16-byte aligned."""

    def __init__(self, name: str, width: int):
        self.name, self._width = name, width
        self.ndim = 2

    def stride(self, dim: int) -> int:
        return self._width if dim == 0 else 1

    def data_ptr(self) -> int:
        return 0


def _variant_body(
    i: int | str,
    kernel: Kernel | None,
    proxies: list,
    out_proxies: list,
    tokens: Any,
    allocated: bool,
    device: torch.device,
    ns: dict[str, Any],
    addressed: frozenset[str] = frozenset(),
    residues: dict[int, int] | None = None,
) -> list[str] | None:
    """The lines that launch variant ``i``, or None where it cannot be launched from here yet;
    ``residues``: the inputs (by position) whose address modulo 16 is not 0 in the calls these
    lines launch, and that residue (the others are 16-byte aligned)."""
    if kernel is None or kernel._direct is False:
        return None
    try:
        flat, constexprs, key = kernel.launch_arguments(proxies, out_proxies, tokens, allocated)
        params = [_literal(v) for v in flat]
    except _Unsupported:
        return None
    grid = kernel.target.grid_expression(kernel._block_t, device, **kernel.grid_options)
    if grid is None:
        ns[f"GRID{i}"] = kernel.target.grid
        ns[f"OPTIONS{i}"] = dict(kernel.grid_options)
        grid = f"GRID{i}(T, {kernel._block_t}, DEVICE, **OPTIONS{i})"
    lines = [f"g = {grid}"]
    if kernel._direct is None:
        ns[f"FN{i}"], ns[f"KW{i}"] = kernel.fn, {**constexprs, **kernel._launch}
        lines.append(f"FN{i}[(g, {kernel.grid_blocks})]({', '.join(params)}, **KW{i})")
        return lines
    dense, ints, aligned, _ = key
    pattern = tuple((residues or {}).get(k, 0) for k in range(len(aligned)))
    bound = kernel._direct.bound(device.index, (dense, ints, pattern, allocated))
    if bound is None:
        return None
    run, function, packed = bound
    constants = ", ".join(repr(v) for v in constexprs.values())
    stream = f"STREAM({device.index!r})"
    inner = inner_c_launch(run)
    if inner is not None:
        # the C function under Triton's launcher, called as its ``__call__`` calls it
        # the inputs' and allocated outputs' pointers as the ints read above: the C function
        # takes an int as the address itself (of a tensor it asks ``data_ptr()`` and then
        # ``cuPointerGetAttribute``, which gives that same address for memory torch allocated
        # on this CUDA device, where the key and the device check put every input)
        # (the caller's ``out`` tensors stay tensors: the key does not hold their device, so
        # the C function's check of each stays in place)
        params = [
            f"P_{v.name}" if isinstance(v, _Arg) and v.name in addressed else _literal(v)
            for v in flat
        ]
        launch, cooperative, pdl, annotations, signature = inner
        ns[f"LAUNCH{i}"], ns[f"FUNCTION{i}"], ns[f"PACKED{i}"] = launch, function, packed
        ns[f"ANNOTATIONS{i}"], ns[f"SIGNATURE{i}"] = annotations, signature
        ns[f"COOPERATIVE{i}"], ns[f"PDL{i}"] = cooperative, pdl
        everything = ", ".join(p for p in (", ".join(params), constants) if p)
        lines.append(
            f"LAUNCH{i}(g, {kernel.grid_blocks}, 1, {stream}, FUNCTION{i}, COOPERATIVE{i}, "
            f"PDL{i}, PACKED{i}, None, None, None, None, None, ANNOTATIONS{i}, SIGNATURE{i}, "
            f"({everything},))"
        )
        return lines
    ns[f"RUN{i}"], ns[f"FUNCTION{i}"], ns[f"PACKED{i}"] = run, function, packed
    lines.append(
        f"RUN{i}(g, {kernel.grid_blocks}, 1, {stream}, FUNCTION{i}, PACKED{i}, "
        f"None, None, None, {', '.join(params)}, {constants})"
    )
    return lines
