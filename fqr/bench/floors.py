"""The physical floors of a cell, measured in the same run and the same way as fqr's device
time (:meth:`~fqr.bench.timers.CudaTimers.graph_us`: CUDA-graph replays over rotating buffers,
nothing served from L2), so that each ratio is of two numbers taken side by side.

=====================  ======================================================================
``copy_us``            the fastest copy of exactly the bytes one call moves (half of
                       :attr:`Traffic.total` read, half written), rotating over as many buffer
                       pairs as the cell has input sets: the floor of any kernel that moves
                       those bytes. Each candidate (:func:`copy_calls`) is timed over the same
                       pairs: ``copy_`` (``torch.Tensor.copy_``, a memcpy node in the graph,
                       which the driver may give to the copy engines) and on CUDA the SM copy
                       kernel (:mod:`fqr.bench.copy_kernel`: 16-byte vectors) under each of
                       its settings; ``copy_candidates`` holds every candidate's µs,
                       ``copy_by`` the fastest one's name
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
gemm_us``). A copy slower than fqr's own device time is no floor (:func:`not_a_floor`):
``copy_us`` is then null, ``pct_copy`` left out, and ``floors["errors"]["copy_us"]`` says why
(the candidates' µs stay). The run records ``empty_kernel_us``, an empty Triton kernel's
replay: the floor of any launch. What could not be measured is named in ``floors["errors"]``
(a candidate copy that failed, under its name). That the PDL kernel reads what the GEMM wrote
is ``tests/gpu/test_pdl_gpu.py``'s.

Why ``copy_`` is not enough: on an H200 a graph's memcpy node ran at 2.7 TB/s for 2 of 8
probed sizes and 4.2 TB/s for the others, with no pattern in size or alignment, while the eager
``copy_`` was 4.2 TB/s every time (:mod:`fqr.bench.copy_probe`, ``fqr bench --copy-probe``;
docs/PERFORMANCE.md, "The floor, round 2").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from ..prologue import variant_of
from ..text import exception_line
from .cell import Cell, Implementation


def rotating(calls: list[Callable[[], object]]) -> Callable[[], object]:
    """One call per invocation, in turn."""
    state = {"i": 0}

    def call():
        i = state["i"]
        state["i"] = (i + 1) % len(calls)
        return calls[i]()

    return call


COPY_ = "copy_"  # torch.Tensor.copy_: a cudaMemcpyAsync (in a graph, a memcpy node)


def copy_pairs(moved_bytes: int, sets: int, device: torch.device) -> list[tuple]:
    """``sets`` (source, destination) int32 buffer pairs of ``moved_bytes / 2`` bytes each (in
    whole 4-byte words): a copy through one reads and writes the call's bytes."""
    words = max(1, moved_bytes // 8)  # int32 words read (and written) per copy
    return [
        (s, torch.empty_like(s))
        for s in (torch.empty(words, dtype=torch.int32, device=device) for _ in range(sets))
    ]


def copy_calls(pairs: list[tuple], device: torch.device) -> dict[str, Callable[[], object]]:
    """The candidate copies over ``pairs``, each a ``call()`` rotating over them: ``copy_``,
    and on a CUDA device :func:`fqr.bench.copy_kernel.sm_copy_kernel` under each of its
    :data:`~fqr.bench.copy_kernel.SETTINGS` (the kernel is compiled for the GPU; the
    interpreter's tests run it apart)."""
    calls: dict[str, Callable[[], object]] = {
        COPY_: rotating([lambda s=s, d=d: d.copy_(s) for s, d in pairs])
    }
    if device.type == "cuda":
        from ..lowering.targets import multiprocessors
        from .copy_kernel import SETTINGS, sm_copy_call

        sms = multiprocessors(device)
        for setting in SETTINGS:
            calls[setting.name] = rotating([sm_copy_call(d, s, setting, sms) for s, d in pairs])
    return calls


def fastest(times: dict[str, float]) -> tuple[str, float] | None:
    """``(name, us)`` of the fastest candidate (the first named on a tie); None without any."""
    if not times:
        return None
    name = min(times, key=lambda k: times[k])
    return name, times[name]


def not_a_floor(floor_us: float, by: str, device_us: float) -> str | None:
    """Why a copy of ``floor_us`` (the fastest, ``by``) is no floor of a kernel that took
    ``device_us`` for the same bytes, or None when it is one (not slower)."""
    if floor_us <= device_us:
        return None
    return f"floor {floor_us:.1f} us ({by}) slower than fqr's {device_us:.1f} us: not a floor"


def measure_copy_floor(
    moved_bytes: int, sets: int, device: torch.device, graph_rep_ms: float, timers
) -> tuple[dict, dict]:
    """``(floors, errors)``: every candidate copy of :func:`copy_calls` graph-replayed over the
    same buffer pairs (``floors["copy_candidates"]``: name -> µs), the fastest as
    ``copy_us`` and its name as ``copy_by``; a candidate that could not be timed is named in
    ``errors``."""
    floors: dict = {"copy_us": None}
    errors: dict = {}
    times: dict[str, float] = {}
    try:
        calls = copy_calls(copy_pairs(moved_bytes, sets, device), device)
    except Exception as e:
        return floors, {"copy_us": exception_line(e)}
    for name, call in calls.items():
        try:
            times[name] = timers.graph_us(call, graph_rep_ms)
        except Exception as e:  # the other candidates still make a floor
            errors[name] = exception_line(e)
    del calls
    floors["copy_candidates"] = times
    best = fastest(times)
    if best is None:
        errors["copy_us"] = "no copy could be timed"
    else:
        floors["copy_by"], floors["copy_us"] = best
    return floors, errors


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
    W]``, W the first input's elements per token -- a ``[T, H, D]`` key is ``H * D`` wide --,
    random normal, the output of unit scale), and the same followed by ``impl`` on the set
    with that buffer as its first input."""
    name = variant_of(cell.preset).declaration.tensor_params[0].name
    generator = torch.Generator(device=cell.device).manual_seed(seed)
    shape = _rows_of(cell.sets[0], name).shape
    tokens, width = shape[0], math.prod(shape[1:])
    weight = torch.randn(
        in_features, width, generator=generator, device=cell.device, dtype=cell.dtype
    ) * (in_features**-0.5)
    gemms, both = [], []
    for x in cell.sets:
        hidden = torch.randn(
            tokens, in_features, generator=generator, device=cell.device, dtype=cell.dtype
        )
        out = torch.empty(shape, device=cell.device, dtype=cell.dtype)
        fed = _with_rows(x, name, out)

        def gemm(h=hidden, o=out.view(tokens, width)):
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
    # the kernel's own figures stand where a floor is missing: it is named in the errors
    floors, errors = measure_copy_floor(
        cell.traffic.total, len(cell.sets), cell.device, graph_rep_ms, timers
    )
    floors.update(gemm_us=None, gemm_op_us=None)
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
            errors["gemm_us"] = exception_line(e)
        if fqr.pdl_launcher is not None and floors["gemm_us"] is not None:
            try:
                pdl = dataclasses.replace(fqr, call=fqr.pdl_launcher)
                _, gemm_then_pdl = gemm_calls(cell, pdl, in_features, seed)
                floors["gemm_op_pdl_us"] = timers.graph_us(gemm_then_pdl, graph_rep_ms)
            except Exception as e:
                errors["gemm_op_pdl_us"] = exception_line(e)
    if device_us:
        if floors["copy_us"] is not None:
            refused = not_a_floor(floors["copy_us"], floors["copy_by"], device_us)
            if refused:  # the candidates stay as data; no floor, no ratio
                errors["copy_us"] = refused
                floors["copy_us"] = None
                del floors["copy_by"]
            else:
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
