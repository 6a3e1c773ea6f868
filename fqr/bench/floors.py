"""The physical floors of a cell, measured in the same run and the same way as fqr's device
time (:meth:`~fqr.bench.timers.CudaTimers.graph_us`: CUDA-graph replays over rotating buffers,
nothing served from L2), so that each ratio is of two numbers taken side by side.

=====================  ======================================================================
``copy_us``            a device-to-device copy of exactly the bytes one call moves (half of
                       :attr:`Traffic.total` read, half written), rotating over as many buffer
                       pairs as the cell has input sets: the floor of any kernel that moves
                       those bytes
``gemm_us``            the projection GEMM whose output the op reads (``[T, K] @ [K, W]``, ``K``
                       = :meth:`fqr.prologue.Variant.projection_in_features`, ``W`` the op's
                       first input's width), alone
``gemm_op_us``         that GEMM followed by fqr's op on its output, in one graph
``gemm_op_pdl_us``     with ``--pdl`` (:attr:`BenchConfig.pdl`): that GEMM followed by fqr's
                       kernel lowered with ``pdl=True`` (programmatic dependent launch:
                       Triton's ``launch_pdl``, the kernel waiting on the GEMM with
                       ``gdc_wait`` before its first load), in one graph
=====================  ======================================================================

fqr's result gains ``pct_copy`` (``100 * copy_us / graph_us``), ``after_gemm_us``
(``gemm_op_us - gemm_us``: what the prologue costs where serving runs it, right after the
QKV projection) and ``after_gemm_x`` (that over fqr's own device time: 1.0 when the kernel
boundary costs nothing), and with ``--pdl`` ``after_gemm_pdl_us`` (``gemm_op_pdl_us -
gemm_us``). The run records ``empty_kernel_us``, an empty Triton kernel's replay: the floor of
any launch. What could not be measured is named in ``floors["errors"]``. That the PDL kernel
reads what the GEMM wrote is ``tests/gpu/test_pdl_gpu.py``'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ..prologue import variant_of
from .cell import Cell, Implementation


def rotating(calls: list[Callable[[], object]]) -> Callable[[], object]:
    """One call per invocation, in turn."""
    state = {"i": 0}

    def call():
        i = state["i"]
        state["i"] = (i + 1) % len(calls)
        return calls[i]()

    return call


def copy_call(moved_bytes: int, sets: int, device: torch.device) -> Callable[[], object]:
    """A copy that reads ``moved_bytes / 2`` and writes as many, over ``sets`` buffer pairs."""
    words = max(1, moved_bytes // 8)  # int32 words read (and written) per copy
    sources = [torch.empty(words, dtype=torch.int32, device=device) for _ in range(sets)]
    return rotating([lambda s=s, d=torch.empty_like(s): d.copy_(s) for s in sources])


def _with_rows(inputs, name: str, rows: torch.Tensor):
    """The call's inputs with its first input (``name``) replaced by ``rows``."""
    if isinstance(inputs, dict):
        return {**inputs, name: rows}
    return dataclasses.replace(inputs, **{name: rows})


def _rows_of(inputs, name: str) -> torch.Tensor:
    return inputs[name] if isinstance(inputs, dict) else getattr(inputs, name)


def gemm_calls(
    cell: Cell, impl: Implementation, in_features: int, seed: int
) -> tuple[Callable[[], object], Callable[[], object]]:
    """``(gemm, gemm_then_op)``: per input set, ``hidden @ weight`` into a buffer of the op's
    first input's shape (``hidden`` ``[T, in_features]`` and one ``weight`` ``[in_features,
    W]``, random normal, the output of unit scale), and the same followed by ``impl`` on the
    set with that buffer as its first input."""
    name = variant_of(cell.preset).declaration.tensor_params[0].name
    generator = torch.Generator(device=cell.device).manual_seed(seed)
    tokens, width = _rows_of(cell.sets[0], name).shape
    weight = torch.randn(
        in_features, width, generator=generator, device=cell.device, dtype=cell.dtype
    ) * (in_features**-0.5)
    gemms, both = [], []
    for x in cell.sets:
        hidden = torch.randn(
            tokens, in_features, generator=generator, device=cell.device, dtype=cell.dtype
        )
        out = torch.empty(tokens, width, device=cell.device, dtype=cell.dtype)
        fed = _with_rows(x, name, out)

        def gemm(h=hidden, o=out):
            return torch.mm(h, weight, out=o)

        def gemm_then_op(g=gemm, f=fed):
            g()
            return impl.call(f)

        gemms.append(gemm)
        both.append(gemm_then_op)
    return rotating(gemms), rotating(both)


def measure_floors(
    cell: Cell, fqr: Implementation, result: dict, graph_rep_ms: float, timers, seed: int
) -> dict:
    """The cell's floors (module docstring), each a graph replay like fqr's device time; adds
    ``pct_copy``, ``after_gemm_us`` and ``after_gemm_x`` to fqr's ``result`` where its device
    time was measured."""
    floors: dict = {"copy_us": None, "gemm_us": None, "gemm_op_us": None}
    errors: dict = {}
    try:
        floors["copy_us"] = timers.graph_us(
            copy_call(cell.traffic.total, len(cell.sets), cell.device), graph_rep_ms
        )
    except Exception as e:  # the kernel's own figures stand; the floor is noted missing
        errors["copy_us"] = f"{type(e).__name__}: {e}"[:300]
    device_us = result.get("graph_us")
    in_features = variant_of(cell.preset).projection_in_features(cell.preset)
    if not in_features:
        errors["gemm_us"] = f"preset {cell.preset.name} records no hidden_size"
    elif device_us is not None:
        try:
            gemm, gemm_then_op = gemm_calls(cell, fqr, in_features, seed)
            floors["gemm_us"] = timers.graph_us(gemm, graph_rep_ms)
            floors["gemm_op_us"] = timers.graph_us(gemm_then_op, graph_rep_ms)
        except Exception as e:
            errors["gemm_us"] = f"{type(e).__name__}: {e}"[:300]
        if fqr.pdl_launcher is not None and floors["gemm_us"] is not None:
            try:
                pdl = dataclasses.replace(fqr, call=fqr.pdl_launcher)
                _, gemm_then_pdl = gemm_calls(cell, pdl, in_features, seed)
                floors["gemm_op_pdl_us"] = timers.graph_us(gemm_then_pdl, graph_rep_ms)
            except Exception as e:
                errors["gemm_op_pdl_us"] = f"{type(e).__name__}: {e}"[:300]
    if device_us:
        if floors["copy_us"] is not None:
            result["pct_copy"] = 100 * floors["copy_us"] / device_us
        if floors["gemm_op_us"] is not None and floors["gemm_us"] is not None:
            result["after_gemm_us"] = floors["gemm_op_us"] - floors["gemm_us"]
            result["after_gemm_x"] = result["after_gemm_us"] / device_us
        if floors.get("gemm_op_pdl_us") is not None:
            result["after_gemm_pdl_us"] = floors["gemm_op_pdl_us"] - floors["gemm_us"]
    if errors:
        floors["errors"] = errors
    return floors


def empty_kernel_us(timers, graph_rep_ms: float) -> float:
    """Device µs of an empty Triton kernel (one program), graph-replayed."""
    from .empty_kernel import empty_kernel

    return timers.graph_us(lambda: empty_kernel[(1,)](), graph_rep_ms)
