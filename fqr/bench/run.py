"""The run loop: every (preset, dtype, tokens) cell, each implementation checked, then timed.

:func:`run_bench` reads as its steps: the copy ceiling, then per preset and dtype the
implementations (:func:`implementations`), then per token count one cell
(:func:`measure_cell`: inputs, the float64 expectation, :func:`measure_impl` for each
implementation, the speed-ups).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict

import torch

from .. import reference
from ..backends import resolve_backend
from ..core import dtype_name
from ..inputs import PrologueInputs, random_inputs
from ..peers import build_peer, peer_unavailable_reason
from ..presets import Preset
from ..text import exception_line
from .cell import Cell, Implementation
from .checks import cell_generator, check_outputs, check_row_index, poison_free_memory
from .config import BenchConfig
from .document import FQR, add_row, new_document
from .environment import environment, require_gpu
from .floors import empty_kernel_us, measure_floors
from .measurements import DISPATCH_TOKENS, MEASUREMENTS
from .timers import CudaTimers
from .traffic import rotation_sets, traffic_bytes
from .variant_cells import (
    is_variant_preset,
    make_variant_cell,
    variant_implementations,
    variant_table,
)


def fqr_callable(preset: Preset, cache: torch.Tensor, backend: str, numerics: str):
    """fqr's public op on ``backend``."""
    from ..prologue import split_qkv_rmsnorm_rope

    def run(x: PrologueInputs):
        return split_qkv_rmsnorm_rope(*x.args(), **x.kwargs(numerics=numerics, backend=backend))

    return run


def launcher_callable(preset: Preset, dtype: torch.dtype, numerics: str, **options):
    """The bare generated-kernel launcher (the kernel variant for the call's token count,
    ``fqr.lowering.lower_by_tokens`` with the cuda target's ``options``, e.g. ``pdl=True``),
    without the public op's argument checks: its dispatch cost, beside the public op's, splits
    host time between them."""
    from ..lowering import lower_by_tokens
    from ..prologue import program_of

    program = program_of(preset, dtype, numerics=numerics)
    variants = lower_by_tokens(program, target="cuda", **options)
    return lambda x: variants.launch(x.operands())


def implementations(
    cfg: BenchConfig, preset: Preset, dtype: torch.dtype, cache: torch.Tensor, skipped: dict
) -> list[Implementation]:
    """fqr under the requested contract, then each peer that can run the preset here (under
    ``unfused``); what cannot run is recorded in ``skipped``."""
    ours = Implementation(FQR, fqr_callable(preset, cache, cfg.backend, cfg.numerics), cfg.numerics)
    needs_launcher = any(
        m.subject == "launcher" and any(m.applies(t) for t in cfg.tokens) for m in MEASUREMENTS
    )
    if cfg.backend == "triton" and needs_launcher:
        try:
            ours.launcher = launcher_callable(preset, dtype, cfg.numerics)
        except Exception as e:  # the public op's own check reports a broken lowering
            skipped[f"launcher/{preset.name}/{dtype_name(dtype)}"] = exception_line(e)
    if cfg.pdl:
        try:
            ours.pdl_launcher = launcher_callable(preset, dtype, cfg.numerics, pdl=True)
        except Exception as e:  # the floors then have no PDL figure; the run goes on
            skipped[f"pdl/{preset.name}/{dtype_name(dtype)}"] = exception_line(e)
    impls = [ours]
    for peer in cfg.compare:
        reason = peer_unavailable_reason(peer, preset.spec)
        if reason:
            skipped[f"{peer}/{preset.name}"] = reason
            continue
        fn = build_peer(peer, preset.spec, cache, dtype)
        impls.append(
            Implementation(
                peer, lambda x, fn=fn: fn(x.qkv, x.positions, x.q_weight, x.k_weight), "unfused"
            )
        )
    return impls


def _cycle(fn: Callable, input_sets: list) -> Callable[[], object]:
    state = {"i": 0}

    def call():
        i = state["i"]
        state["i"] = (i + 1) % len(input_sets)
        return fn(input_sets[i])

    return call


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_cell(
    cfg: BenchConfig, preset: Preset, dtype: torch.dtype, tokens: int, cache: torch.Tensor,
    env: dict, ceiling_gbps: float, device: torch.device,
) -> Cell:  # fmt: skip
    """Fresh input sets (seeded per cell: any cell can be rerun alone), enough of them to
    overflow L2, and the float64 expectation of the first set on the checked rows."""
    label = f"{preset.name} {dtype_name(dtype)} T={tokens}"
    seed, generator = cell_generator(cfg.seed, label, device)
    traffic = traffic_bytes(preset.spec, dtype, tokens)
    n_sets = rotation_sets(traffic.total, env["l2_bytes"])
    sets = [random_inputs(preset.spec, tokens, dtype, generator, cache) for _ in range(n_sets)]
    rows = check_row_index(tokens, cfg.check_rows, torch.Generator().manual_seed(seed), "cpu")
    rows = rows.to(device)
    x = sets[0]
    exact = reference.prologue(
        x.qkv.index_select(0, rows), x.positions.index_select(0, rows), *x.args()[2:], **x.kwargs()
    )
    return Cell(preset, dtype, tokens, sets, rows, exact, traffic, ceiling_gbps, device)


def measure_impl(impl: Implementation, cell: Cell, cfg: BenchConfig, timers) -> dict:
    """Check one implementation on the first input set, then (only if right) take every
    measurement that applies to the cell."""
    result: dict = {"check": None, "error": None, "gbps": None, "pct_ceiling": None}
    result.update((m.key, None) for m in MEASUREMENTS)
    try:
        poison_free_memory(2 * cell.traffic.total, cell.device)
        if cell.restore is not None:
            cell.restore()
        outputs = impl.call(cell.sets[0])
        _synchronize(cell.device)
        if cell.check is not None:
            result["check"] = cell.check(outputs, cell.exact, cell.rows, impl.numerics)
        else:
            result["check"] = check_outputs(
                outputs,
                cell.exact,
                cell.rows,
                cell.preset.spec,
                impl.numerics,
                cell.tokens,
                cell.dtype,
            )
        del outputs
    except Exception as e:  # a failing implementation is reported, the run goes on
        result["error"] = exception_line(e)
        return result
    if not result["check"]["passed"]:
        return result
    subjects = {"op": impl.call, "launcher": impl.launcher}
    for m in MEASUREMENTS:
        fn = subjects[m.subject]
        if fn is None or not m.applies(cell.tokens, impl.name):
            continue
        try:
            result[m.key] = m.take(timers, _cycle(fn, cell.sets), cfg)
        except Exception as e:
            if m.primary:
                result["error"] = exception_line(e)
                return result
            # The kernel itself was right: the failure is noted beside the numbers.
            result.setdefault("timing_errors", {})[m.key] = exception_line(e)
            continue
        if m.primary:
            gbps = cell.traffic.total / result[m.key] / 1e3
            result.update(gbps=gbps, pct_ceiling=100 * gbps / cell.ceiling_gbps)
        elif m.pct_key:
            gbps = cell.traffic.total / result[m.key] / 1e3
            result[m.pct_key] = 100 * gbps / cell.ceiling_gbps
    return result


def measure_cell(
    cell: Cell,
    impls: list[Implementation],
    cfg: BenchConfig,
    timers,
    progress: Callable[[str], None],
) -> dict:
    """The document row of one cell: each implementation's result and the speed-ups."""
    row = {
        "preset": cell.preset.name,
        "dtype": dtype_name(cell.dtype),
        "tokens": cell.tokens,
        "bytes": cell.traffic.total,
        "traffic": asdict(cell.traffic),
        "input_sets": len(cell.sets),
        "impls": {},
        "speedup": {},
    }
    for impl in impls:
        progress(f"{cell.label}: {impl.name}")
        row["impls"][impl.name] = measure_impl(impl, cell, cfg, timers)
    primary = next(m.key for m in MEASUREMENTS if m.primary)
    ours = row["impls"][FQR][primary]
    if cfg.floors and ours is not None:
        progress(f"{cell.label}: floors")
        fqr = next(i for i in impls if i.name == FQR)
        row["floors"] = measure_floors(
            cell, fqr, row["impls"][FQR], cfg.graph_rep_ms, timers, cfg.seed + cell.tokens
        )
    for name, r in row["impls"].items():
        if name != FQR and ours and r[primary]:
            row["speedup"][name] = r[primary] / ours
    return row


def dispatch_callables(preset: Preset, dtype: torch.dtype, numerics: str, inputs: dict, cache):
    """What the dispatch table times, each a ``call()`` on ``inputs`` (one call's arguments by
    name, drawn by the preset's variant): the public op, its torch custom op (``torch.ops.fqr``,
    what a compiled graph calls), one aten op (``F.rms_norm`` over every head of the packed
    row: the host cost of a plain torch op on the same tensor) and a bare Triton launch (fqr's
    generated kernel through ``JITFunction``'s own launch path, outputs allocated as the op
    does). Every argument list is built once, outside the timed calls, for any member of the
    family (:class:`fqr.prologue.Variant`)."""
    import torch.nn.functional as F

    from ..lowering import lower_by_tokens
    from ..prologue import variant_of

    variant = variant_of(preset)
    decl = variant.declaration
    kernels = lower_by_tokens(variant.program(preset, dtype, numerics=numerics), target="cuda")
    public = variant.arguments(preset, inputs, cache, numerics=numerics)
    op, op_args = variant.torch_op(preset, inputs, cache, numerics)
    operands = variant.program_args(preset, inputs, cache)
    rows = inputs[decl.tensor_params[0].name]  # [T, W], or [T, H, D] (a cache insert's key)
    tokens, width = rows.shape[0], rows[0].numel()
    d = preset.head_dim if width % preset.head_dim == 0 else width
    heads = rows.reshape(tokens, width // d, d)
    weight = torch.ones(d, dtype=rows.dtype, device=rows.device)
    kernel = kernels.kernel_for(tokens)
    return {
        "public op": lambda: decl.function(**public),
        "torch.ops.fqr": lambda: op(*op_args),
        "F.rms_norm": lambda: F.rms_norm(heads, (d,), weight, preset.eps),
        "triton launch": lambda: kernel.launch(operands, direct=False),
    }


def dispatch_rows(preset: Preset, dtype: torch.dtype, cfg: BenchConfig, timers, cache, device):
    """Host µs per call of each :func:`dispatch_callables` entry at :data:`DISPATCH_TOKENS`
    tokens, under ``torch.inference_mode`` as a serving engine calls them; per row also each
    entry's ratio to ``F.rms_norm``."""
    from ..prologue import variant_of

    variant = variant_of(preset)
    rows = []
    for tokens in DISPATCH_TOKENS:
        generator = torch.Generator(device=device).manual_seed(cfg.seed + tokens)
        inputs = variant.draw(preset, tokens, dtype, generator, max_position=cache.shape[0])
        callables = dispatch_callables(preset, dtype, cfg.numerics, inputs, cache)
        with torch.inference_mode():
            host = {name: timers.dispatch_us(f) for name, f in callables.items()}
        base = host["F.rms_norm"]
        rows.append(
            {
                "preset": preset.name,
                "dtype": dtype_name(dtype),
                "tokens": tokens,
                "host_us": host,
                "x_rms_norm": {name: us / base for name, us in host.items()},
            }
        )
    return rows


def run_bench(
    cfg: BenchConfig,
    progress: Callable[[str], None] = lambda text: None,
    advance: Callable[[], None] = lambda: None,
    device: str = "cuda",
    timers=None,
    on_row: Callable[[dict], None] = lambda doc: None,
) -> dict:
    """Run every cell of ``cfg``; return the result document (:mod:`fqr.bench.document`).

    ``progress(text)`` is told what is running; ``advance()`` is called after the copy ceiling
    and after each cell, ``on_row(doc)`` after each cell with the document so far
    (``doc["complete"]`` turns true at the end), so a run cut short still leaves its rows.
    The bench proper runs on ``device="cuda"`` with :class:`~fqr.bench.timers.CudaTimers`;
    another device needs its own ``timers`` (the tests drive the bookkeeping on CPU that way).
    """
    device = torch.device(device)
    if device.type == "cuda":
        require_gpu()
        timers = timers or CudaTimers()
    elif timers is None:
        raise ValueError(f"device {device.type!r}: pass timers (CudaTimers needs a CUDA device)")
    resolve_backend(cfg.backend, device)  # unavailable -> one clear error before any work
    env = environment(device)
    progress("copy ceiling")
    ceiling = timers.copy_ceiling()
    advance()
    doc = new_document(cfg.settings(), env, ceiling)
    if cfg.floors and device.type == "cuda":
        progress("empty kernel")
        try:
            doc["floors"] = {"empty_kernel_us": empty_kernel_us(timers, cfg.graph_rep_ms)}
        except Exception as e:  # no Triton here: the cells' floors stand without it
            doc["skipped"]["floors/empty kernel"] = exception_line(e)
    for preset in cfg.presets:
        variant = is_variant_preset(preset)  # another member of the family: its own cells
        cache = (variant_table(preset) if variant else preset.cos_sin_cache()).to(device)
        build_impls = variant_implementations if variant else implementations
        build_cell = make_variant_cell if variant else make_cell
        for dtype in cfg.dtypes:
            torch._dynamo.reset()  # each (preset, dtype) compiles its own compile peer afresh
            impls = build_impls(cfg, preset, dtype, cache, doc["skipped"])
            if cfg.backend == "triton" and cfg.dispatch:
                progress(f"{preset.name} {dtype_name(dtype)}: dispatch")
                try:
                    doc.setdefault("dispatch", []).extend(
                        dispatch_rows(preset, dtype, cfg, timers, cache, device)
                    )
                except Exception as e:  # the cells' own checks report a broken kernel
                    doc["skipped"][f"dispatch/{preset.name}/{dtype_name(dtype)}"] = exception_line(
                        e
                    )
            for tokens in cfg.tokens:
                cell = build_cell(cfg, preset, dtype, tokens, cache, env, ceiling["gbps"], device)
                add_row(doc, measure_cell(cell, impls, cfg, timers, progress))
                del cell
                on_row(doc)
                advance()
            del impls
            if device.type == "cuda":
                torch.cuda.empty_cache()
    doc["complete"] = True
    return doc
