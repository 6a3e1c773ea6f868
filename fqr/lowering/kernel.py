"""The lowered kernel: generated source plus its host launcher."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..core import TOKENS, Program, Role
from .bundle import compile_ahead, launch_through_triton
from .emit import block_count, grid_programs
from .launcher import direct_launcher
from .plan import KernelPlan
from .targets import Target
from .tiling import Tiling


@dataclass
class Kernel:
    """One fused kernel for one program on one target. Call it with the program's inputs."""

    program: Program
    plan: KernelPlan
    target: Target
    tiling: Tiling
    source: str
    path: Path
    cache_hit: bool
    fn: Any = field(repr=False)
    options: dict[str, Any] = field(default_factory=dict)
    # its code rounds between steps (EmittedKernel): compiled without multiply-add contraction
    rounding_points: bool = False
    # lower(program, target, **options): how :meth:`strided_variant` lowers its sibling
    relower: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._roles = [self.plan.input_role(v) for v in self.program.inputs]
        self._out_widths = [int(v.aval.shape[1]) for v in self.program.outputs]
        # Each output's head width (None: an updated input, stored through that input).
        self._out_head_dims = [
            self.plan.chain_of[id(v)].head_dim if id(v) in self.plan.chain_of else None
            for v in self.program.outputs
        ]
        # Whether each output takes its head stride (``[T, H, D]`` views, :meth:`launch`).
        self.strided_outputs = bool(self.options.get("strided_outputs"))
        self._strided: Kernel | None = None
        self._index_strided: Kernel | None = None
        # Whether each per-token input (INDEX, TOKEN_VALUE) takes its element stride (strided
        # positions, :meth:`launch`), and the INDEX inputs of their own length ``[N]`` (a
        # runtime argument, as T is).
        self.strided_indices = bool(self.options.get("strided_indices"))
        self._index_at = [
            i for i, r in enumerate(self._roles) if r is Role.INDEX or r is Role.TOKEN_VALUE
        ]
        self._own_length = frozenset(
            i
            for i in self._index_at
            if self._roles[i] is Role.INDEX and self.program.inputs[i].aval.shape[0] != TOKENS
        )
        # Output -> the input it is an updated copy of (a paged cache): written in place.
        self.aliases = self.program.aliases()
        self._block_t = self.target.block_t(self.plan, self.tiling, **self.options)
        self._launch = self.target.launch_options(
            self.plan, rounding_points=self.rounding_points, **self.options
        )
        # Programs along grid axis 1: one per chunk block in ``grid`` chunk mode.
        # (per head group with the decode schedule, ``Tiling.heads_per_program``)
        self.grid_blocks = grid_programs(self.plan, self.tiling)
        # What the target sizes grid axis 0 from: the options, and where the persistent loop
        # walks the blocks too (``Tiling.persistent_blocks``) its work items per token tile.
        self.grid_options = dict(self.options)
        if self.tiling.persistent_blocks:
            self.grid_options["work_per_tile"] = block_count(self.plan, self.tiling)
        # Split-K (``Tiling.split_k``): the K ranges along grid axis 2, an fp32 workspace per
        # launch and, per device, the counts of ranges done (reset by the last range: zero
        # between launches; two launches at once on two streams would share them).
        self._counts: dict[torch.device, torch.Tensor] = {}
        self._direct: Any = False  # not yet made (None: the installed triton has none)

    def __call__(
        self,
        *args: torch.Tensor,
        out: list[torch.Tensor] | None = None,
        donate: bool = False,
    ) -> list[torch.Tensor]:
        """Check ``args`` (and ``out``: ``[T, width]`` tensors whose rows may be strided, e.g.
        views into a wider buffer, or ``[T, H, D]`` views whose heads are strided too) against
        the program, then :meth:`launch`. ``donate``: an output that updates an input
        (:attr:`aliases`) is written into that input's buffer (else into a copy of it)."""
        prog = self.program
        if out is not None and self.aliases:
            raise TypeError("out= cannot be given to a program that updates an input in place")
        if len(args) != len(prog.inputs):
            raise TypeError(f"kernel takes {len(prog.inputs)} tensors, got {len(args)}")
        tokens = None
        for i, (var, a) in enumerate(zip(prog.inputs, args)):
            if not isinstance(a, torch.Tensor):
                raise TypeError(f"argument {i} must be a tensor, got {type(a).__name__}")
            if a.dtype != var.aval.dtype:
                raise TypeError(f"argument {i} must be {var.aval.dtype}, got {a.dtype}")
            shape = var.aval.shape
            if a.dim() != len(shape) or any(
                s != d for s, d in zip(shape, a.shape) if isinstance(s, int)
            ):
                raise ValueError(f"argument {i} must have shape {var.aval}, got {list(a.shape)}")
            if shape and shape[0] == TOKENS:
                if tokens is None:
                    tokens = a.shape[0]
                elif a.shape[0] != tokens:
                    raise ValueError(f"argument {i} has {a.shape[0]} tokens, expected {tokens}")
            # a per-token input (positions, slots) may be read through its stride
            if a.dim() and a.stride(-1) != 1 and i not in self._index_at:
                raise ValueError(f"argument {i} must be contiguous in its last dim")
        for i in self._own_length:
            if tokens is not None and args[i].shape[0] > tokens:
                raise ValueError(
                    f"argument {i} has {args[i].shape[0]} entries, more than the {tokens} tokens"
                )
        if out is not None:
            if len(out) != len(prog.outputs):
                raise TypeError(f"out must hold {len(prog.outputs)} tensors, got {len(out)}")
            for i, (o, v) in enumerate(zip(out, prog.outputs)):
                width, head_dim = int(v.aval.shape[1]), self._out_head_dims[i]
                heads = (tokens, width // head_dim, head_dim) if head_dim else None
                if (
                    not isinstance(o, torch.Tensor)
                    or (o.shape != (tokens, width) and o.shape != heads)
                    or o.dtype != v.aval.dtype
                    or (o.numel() and o.stride(-1) != 1)
                ):
                    raise ValueError(
                        f"out[{i}] must be a {v.aval} tensor with T={tokens} (or a [T, heads, "
                        f"head_dim] = {list(heads or ())} view), contiguous in its last dim"
                    )
        return self.launch(args, out, donate=donate)

    def launch(
        self,
        args: list[torch.Tensor] | tuple[torch.Tensor, ...],
        out: list[torch.Tensor] | None = None,
        donate: bool = False,
        *,
        direct: bool = True,
    ) -> list[torch.Tensor]:
        """Allocate the outputs (unless given) and launch; no argument checks (the hot path).
        An output that updates an input is that input's buffer when ``donate`` (the kernel
        stores into it in place), else a copy of it. ``direct=False`` launches through
        Triton's ``fn[grid]`` even where the compiled kernel is bound (:mod:`.launcher`): what
        the bench compares the bound launch with.

        ``out`` entries are ``[T, width]`` (rows at any stride) or ``[T, H, D]`` views with
        strides ``(row, head_stride, 1)``: head ``h`` goes to ``h * head_stride`` of its row
        (e.g. ``q.view(T, H, 192)[:, :, 128:]``, the rope part of each head). Such a call runs
        :meth:`strided_variant`, the kernel whose outputs take their head strides."""
        if (
            out is not None
            and not self.strided_outputs
            and any(isinstance(o, torch.Tensor) and o.dim() == 3 for o in out)
        ):
            return self.strided_variant().launch(args, out, donate, direct=direct)
        if not self.strided_indices and self.strided_index(args):
            return self.index_strided_variant().launch(args, out, donate, direct=direct)
        tokens = args[0].shape[0]
        device = args[0].device
        if self.aliases:
            args = list(args)
            for j in self.aliases.values():
                if not donate:
                    args[j] = args[j].clone()
        outs = (
            out
            if out is not None
            else [
                args[self.aliases[i]]
                if i in self.aliases
                else torch.empty((tokens, width), dtype=v.aval.dtype, device=device)
                for i, (v, width) in enumerate(zip(self.program.outputs, self._out_widths))
            ]
        )
        if tokens == 0:
            return outs
        flat, constexprs, key = self.launch_arguments(args, outs, tokens, out is None)
        grid: tuple = (
            self.target.grid(tokens, self._block_t, device, **self.grid_options),
            self.grid_blocks,
        )
        if self.tiling.split_k > 1:
            grid = (*grid, self.tiling.split_k)
        if device.type == "meta" and hasattr(self.fn, "run"):
            # a Triton function and no values: compiled into the bundle being built, not run
            # (a stand-in fn without run, e.g. ascend_compile's recorder, takes the call)
            compile_ahead(self.fn, grid, flat, {**constexprs, **self._launch})
            return outs
        bound = self._direct
        if bound is False:
            bound = self._direct = direct_launcher(self.fn, self._launch)
        if bound is not None and direct:
            bound.launch(grid, flat, constexprs, key)
        else:
            launch_through_triton(self.fn, grid, flat, {**constexprs, **self._launch})
        return outs

    def split_buffers(self, device: torch.device, tokens: int) -> list[torch.Tensor]:
        """Split-K's launch arguments: a new fp32 workspace ``[split_k, tokens padded to
        whole tiles, N]`` and the device's counts of ranges done, one per (token tile, program
        block), zero between launches (grown, zeroed, when a call has more tiles)."""
        tiles = -(-tokens // self._block_t)
        product = self.plan.chains[0].product
        assert product is not None, "a split-K kernel computes a product"
        width = int(product.weight.aval.shape[0])
        workspace = torch.empty(
            self.tiling.split_k * tiles * self._block_t * width, dtype=torch.float32, device=device
        )
        counts = self._counts.get(device)
        if counts is None or counts.numel() < tiles * self.grid_blocks:
            counts = torch.zeros(tiles * self.grid_blocks, dtype=torch.int32, device=device)
            self._counts[device] = counts
        return [workspace, counts]

    def strided_variant(self) -> Kernel:
        """This program's kernel on this target whose outputs take their head strides
        (``lower(..., strided_outputs=True)``; lowered on first use): what :meth:`launch` runs
        for ``[T, H, D]`` output views. Itself when it is that kernel."""
        if self.strided_outputs:
            return self
        if self._strided is None:
            self._strided = self._relowered("strided_outputs", "[T, H, D] output views")
        return self._strided

    def strided_index(self, args) -> bool:
        """Whether a per-token argument (positions, slots, per-token numbers) is not at unit
        stride: read through its stride by :meth:`index_strided_variant` (``positions[:, 0]``
        of a ``[T, 2]`` buffer)."""
        return any(args[i].shape[0] > 1 and args[i].stride(0) != 1 for i in self._index_at)

    def index_strided_variant(self) -> Kernel:
        """This program's kernel on this target whose per-token inputs take their element strides
        (``lower(..., strided_indices=True)``, keeping the other options; lowered on first
        use). Itself when it is that kernel."""
        if self.strided_indices:
            return self
        if self._index_strided is None:
            self._index_strided = self._relowered("strided_indices", "strided positions or slots")
        return self._index_strided

    def _relowered(self, option: str, needed_for: str) -> Kernel:
        """This program's kernel on this target lowered again with the flag ``option`` on,
        keeping the other options; a kernel not made by :func:`fqr.lowering.lower` cannot be:
        TypeError, naming the calls it was ``needed_for``."""
        if self.relower is None:
            raise TypeError(
                "this kernel was not made by fqr.lowering.lower: it has no variant for "
                + needed_for
            )
        return self.relower(**{**self.options, option: True})

    def launch_arguments(
        self, args, outs, tokens: Any, allocated: bool
    ) -> tuple[list[Any], dict[str, Any], tuple]:
        """The kernel's parameters for one launch, in signature order: each input, followed by
        its row stride (values and tables), its rows (tables), its element stride (indices, in
        :meth:`index_strided_variant`) and its length (an index of its own length ``[N]``, at
        run time); each output and its row
        stride (and, in :meth:`strided_variant`, its head stride: the ``[T, H, D]`` view's
        ``stride(1)``, else the head width); then ``tokens``. Also the constexprs
        (``BLOCK_T``, ``DENSE``: every row stride equals its row width, every head stride its
        head width) and the specialisation key of :class:`.launcher.DirectLauncher`
        (DENSE, the specialised ints, each pointer's address modulo 16 -- outputs fqr
        ``allocated`` are aligned -- and ``allocated``). The one home of the argument order:
        :meth:`launch` and the generated host function (:mod:`.host`) both read it."""
        flat: list[Any] = []
        ints: list[int] = []  # the specialised ints (row strides, table rows)
        aligned: list[int] = []  # each input's address modulo 16
        dense = True
        for i, (role, a) in enumerate(zip(self._roles, args)):
            flat.append(a)
            aligned.append(a.data_ptr() & 15)
            if role is Role.VALUE or role is Role.TABLE or role is Role.HIDDEN:
                stride = a.stride(0)
                flat.append(stride)
                ints.append(stride)
                dense = dense and stride == a.shape[1]
            if role is Role.TABLE:
                flat.append(a.shape[0])
                ints.append(a.shape[0])
            if (role is Role.INDEX or role is Role.TOKEN_VALUE) and self.strided_indices:
                flat.append(a.stride(0))
                ints.append(a.stride(0))
            if role is Role.INDEX and i in self._own_length:  # runtime, as T is
                flat.append(runtime_length(a))
            if role is Role.CACHE:  # its strides and rows are specialised ints too
                strides = [a.stride(d) for d in range(len(a.shape) - 1)]
                cache_ints = [*strides, a.shape[0] * a.shape[1]]
                flat += cache_ints
                ints += cache_ints
        for i, (o, width) in enumerate(zip(outs, self._out_widths)):
            if i in self.aliases:  # stored through the input it updates
                continue
            stride = o.stride(0)
            flat += [o, stride]
            ints.append(stride)
            if not allocated:
                aligned.append(o.data_ptr() & 15)
            dense = dense and stride == width
            if self.strided_outputs:
                head_dim = self._out_head_dims[i]
                assert head_dim is not None, "an output stored by the kernel has heads"
                head_stride = o.stride(1) if o.ndim == 3 else head_dim
                flat.append(head_stride)
                ints.append(head_stride)
                dense = dense and head_stride == head_dim
        if self.tiling.uses_workspace:
            flat += self.split_buffers(args[0].device, tokens)
        flat.append(tokens)
        constexprs = {"BLOCK_T": self._block_t, "DENSE": dense}
        return flat, constexprs, (dense, tuple(ints), tuple(aligned), allocated)


def runtime_length(a) -> Any:
    """The length of a ``[N]`` argument passed at run time (a tensor's ``shape[0]``; the host
    function's stand-in names the expression that reads it, :mod:`.host`)."""
    length = getattr(a, "runtime_length", None)
    return length() if length is not None else a.shape[0]
