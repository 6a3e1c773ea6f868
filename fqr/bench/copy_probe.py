"""Why the same-size ``copy_`` swings between about 2.7 and 4.2 TB/s (issue 31): ``fqr bench
--copy-probe``.

On an H200 the bench's copy floor (``torch.Tensor.copy_`` of int32 buffers, graph-replayed)
ran at about 2.7 TB/s for most presets at 65,536 tokens and at 4.2 TB/s for llama4-scout and
llama3-8b-qk-rope; an eager ``copy_`` of a bf16 qkv ran at 4.2 TB/s. The hypothesis to test: a
``copy_`` is a ``cudaMemcpyAsync``, which runs as a kernel on the SMs when issued eagerly, but
captured in a CUDA graph it is a memcpy node that the driver may give to the copy engines
(slower), unless something (the size, its alignment, a driver heuristic) makes it a kernel.

For each size (:func:`probe_sizes`: per preset and token count the bench cell's copy, the bf16
qkv alone and that cell's copy rounded down to 2 MiB), :func:`probe_copies` times over one
buffer pair:

==========================  =============================================================
``copy_ int32 eager``       ``copy_`` issued eagerly (``do_bench``: CUDA events)
``copy_ bf16 eager``        the same bytes viewed as bf16
``copy_ int32 graph``       ``copy_`` graph-replayed (a memcpy node), as the bench's floor
``copy_ bf16 graph``        the same bytes viewed as bf16
``sm_copy[...] graph``      the SM copy kernel (:mod:`fqr.bench.copy_kernel`) under each of
                            its settings, graph-replayed
==========================  =============================================================

and, where the profiler runs, the device activities (name: µs) of one eager ``copy_`` and of
one replay of a graph holding one ``copy_``: a copy-engine memcpy shows as ``Memcpy DtoD``, a
kernel under its own name. Sizes that are equal are probed once, under every label.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..presets import Preset
from ..text import exception_line
from .floors import COPY_, copy_calls
from .traffic import traffic_bytes

PROBE_PRESETS = ("qwen3-8b", "llama4-scout", "llama3-8b-qk-rope")
PROBE_TOKENS = (65536,)
ALIGN = 2 << 20  # the rounded size: a multiple of 2 MiB


def cell_bytes(preset: Preset, dtype: torch.dtype, tokens: int, device: torch.device) -> int:
    """The bytes one call of the bench's cell moves (its copy floor copies half each way):
    the traffic model of a split-qkv preset, a variant's from inputs drawn on ``device``."""
    from .variant_cells import is_variant_preset, variant_table, variant_traffic

    if not is_variant_preset(preset):
        return traffic_bytes(preset.spec, dtype, tokens).total
    from ..prologue import variant_of

    variant = variant_of(preset)
    cache = variant_table(preset).to(device)
    generator = torch.Generator(device=device).manual_seed(0)
    inputs = variant.draw(preset, tokens, dtype, generator, max_position=cache.shape[0])
    return variant_traffic(variant, preset, inputs, cache, dtype).total


def probe_sizes(
    presets: list[Preset], tokens: list[int], device: torch.device, dtype=torch.bfloat16
) -> dict[int, list[str]]:
    """Bytes copied each way -> the labels of that size, in order: per preset and token
    count the bench cell's copy (``4 * (total // 8)``, as :func:`fqr.bench.floors.copy_pairs`
    allocates), the qkv alone (``T * width * 2`` in bf16) and the cell's copy rounded down to
    a multiple of 2 MiB."""
    sizes: dict[int, list[str]] = {}
    elt = torch.finfo(dtype).bits // 8
    for preset in presets:
        for t in tokens:
            cell = 4 * (cell_bytes(preset, dtype, t, device) // 8)
            for label, n in (
                ("cell", cell),
                ("qkv", t * preset.spec.qkv_width * elt),
                ("cell, 2 MiB", cell // ALIGN * ALIGN),
            ):
                if n > 0:
                    sizes.setdefault(n, []).append(f"{preset.name} T={t} {label}")
    return sizes


def device_activities(run: Callable[[], object]) -> dict[str, float]:
    """Device activities (name -> total µs) the profiler sees during ``run()``."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    seen: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            seen[e.name] = seen.get(e.name, 0.0) + e.time_range.elapsed_us()
    return seen


def _graphed(call: Callable[[], object]) -> Callable[[], object]:
    """``call`` captured once in a CUDA graph; the graph's replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # warm (and compile) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph.replay


def probe_one(nbytes: int, timers, device: torch.device, rep_ms: float, warmup_ms: float) -> dict:
    """One size's row: ``{"bytes", "us": {method: µs}, "errors": {method: text}, "activities":
    {"eager" | "graph": {name: µs}}}`` (module docstring)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    views = {
        "int32": (src.view(torch.int32), dst.view(torch.int32)),
        "bf16": (src.view(torch.bfloat16), dst.view(torch.bfloat16)),
    }
    methods: list[tuple[str, Callable[[], float]]] = []
    for dtype, (s, d) in views.items():
        call = lambda s=s, d=d: d.copy_(s)  # noqa: E731
        methods.append(
            (f"copy_ {dtype} eager", lambda c=call: timers.kernel_us(c, warmup_ms, rep_ms))
        )
        methods.append((f"copy_ {dtype} graph", lambda c=call: timers.graph_us(c, rep_ms)))
    for name, call in copy_calls([views["int32"]], device).items():
        if name != COPY_:
            methods.append((f"{name} graph", lambda c=call: timers.graph_us(c, rep_ms)))
    row: dict = {"bytes": nbytes, "us": {}, "errors": {}, "activities": {}}
    for name, take in methods:
        try:
            row["us"][name] = take()
        except Exception as e:  # the other methods still tell something
            row["errors"][name] = exception_line(e)
    if device.type == "cuda":
        s, d = views["int32"]
        for how, run in (("eager", lambda: d.copy_(s)), ("graph", None)):
            try:
                run = run or _graphed(lambda: d.copy_(s))
                row["activities"][how] = device_activities(run)
            except Exception as e:
                row["errors"][f"activities {how}"] = exception_line(e)
    del src, dst, views, methods
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def probe_copies(
    sizes: dict[int, list[str]],
    timers,
    device: torch.device,
    rep_ms: float = 20.0,
    warmup_ms: float = 5.0,
    progress: Callable[[str], None] = lambda text: None,
) -> list[dict]:
    """:func:`probe_one` per size of :func:`probe_sizes`, each row with its ``labels``."""
    rows = []
    for nbytes, labels in sizes.items():
        progress(f"copy probe: {nbytes / 1e6:.1f} MB ({labels[0]})")
        rows.append({"labels": labels, **probe_one(nbytes, timers, device, rep_ms, warmup_ms)})
    return rows
