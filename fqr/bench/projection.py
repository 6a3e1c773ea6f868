"""``fqr bench --projection``: the QKV projection and its prologue, as engines run them and in
one generated kernel.

Per (preset, TP, T), in one process, bf16 or fp16, every time a median of CUDA-graph replays
(device µs, :meth:`fqr.bench.timers.CudaTimers.graph_us`) rotating over sets of hidden states
and packed weights ``[N, K]`` whose weights together are at least twice the L2 (so the weights
stream from HBM as in a real layer):

``gemm_us``     ``torch.mm(x, w_qkv.T)`` (cuBLAS), into the packed row ``[T, N]``;
``pair_us``     that GEMM, then fqr's prologue op on the row (the triton backend): today's pair;
``fused_us``    fqr's projected op (``<op>_proj``): the GEMM with the prologue as its epilogue,
                one kernel, under each schedule asked for (``schedules``: lowering options,
                ``min_tokens`` / ``max_tokens``: the T range the schedule is timed at, and
                ``k_range``: the K of each split-K range, for ``split_k = ceil(K / k_range)``);
``weights_us``  the fastest same-size copy of the weight's bytes
                (:func:`.floors.measure_copy_floor`), rotated over as many buffers as the
                weight sets (from HBM): what reading the weights once costs.

``dispatch_table(rows, device)`` turns the rows into a projection dispatch table
(:mod:`fqr.projection`: per bucket the fused kernel or the pair, whichever the row measured
faster; ``fqr bench --projection --write-dispatch PATH``). It reads the ``default`` schedule:
the public op's own, what the dispatch runs.

Before it is timed, each fused schedule's outputs (first input set) are checked against the
float64 composition (``fqr.reference.project``, then the prologue's reference), on the device,
under the fused contract widened by the fp32 accumulation's bound (:func:`fqr.numerics.compare`
with the projected form's tolerance): a cell that fails is reported and not timed.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..numerics import compare
from ..presets import get_preset
from ..prologue import DECLARATIONS, variant_of
from .floors import measure_copy_floor, rotating

MAX_POSITION = 4096
PRESETS = ("qwen3-8b", "qwen3-32b", "llama3-8b", "qwen3-vl-8b")  # issue 40's four families
# The schedules ``--projection`` compares by default (lowering options of the projected
# kernel, with the T range each is timed at): the public op's own (its token buckets),
# decode by split-K (the weight streamed by 4 to 16 programs per head, K steps of 64 or
# 128), prefill by 64- and 128-token tensor-core tiles.
SCHEDULES: dict[str, dict] = {
    "default": {},  # what a call gets: CudaTarget.product_buckets
    "sk4": {"split_k": 4, "num_warps": 4, "max_tokens": 16},
    "sk8": {"split_k": 8, "num_warps": 4, "max_tokens": 16},
    "sk8-k128": {"split_k": 8, "block_k": 128, "num_warps": 4, "max_tokens": 16},
    "sk16": {"split_k": 16, "num_warps": 4, "max_tokens": 16},
    "t64": {"block_t": 64, "num_warps": 4, "min_tokens": 1024},
    "t128-w4": {"block_t": 128, "num_warps": 4, "min_tokens": 1024},
    "t128-w8": {"block_t": 128, "num_warps": 8, "min_tokens": 1024},
}  # fmt: skip


BENCH_KEYS = ("min_tokens", "max_tokens", "k_range")  # a schedule's keys that are not options
BUILD_TOKENS = (1, 2, 16, 1024)  # build_ahead's launches: a token count in each public bucket


def lowering_options(schedule: dict, depth: int) -> dict:
    """A schedule's lowering options for a projection over ``depth`` (K) features: its token
    range left out, and ``k_range`` (the K each split-K range covers, so that one schedule
    fits every K) turned into ``split_k = ceil(K / k_range)``."""
    options = {k: v for k, v in schedule.items() if k not in BENCH_KEYS}
    if schedule.get("k_range"):
        options["split_k"] = -(-depth // int(schedule["k_range"]))
    return options


def projected_call(preset_name: str, tp: int, tokens: int, dtype, device, gen=None) -> tuple:
    """``(proj, rest, hidden, width, inputs, variant, preset, table)``: the projected op of a
    preset's variant and its arguments but x and w_qkv (``variant.draw`` on ``device``; on
    ``meta`` no values)."""
    preset = get_preset(preset_name, tp)
    variant = variant_of(preset)
    proj = DECLARATIONS[variant.declaration.name + "_proj"]
    table = preset.cos_sin_cache(MAX_POSITION).to(device)
    if gen is None:
        gen = torch.Generator().manual_seed(0)
    inputs = variant.draw(preset, tokens, dtype, gen, max_position=MAX_POSITION)
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    values = variant.arguments(preset, inputs, table)
    rest = {k: v for k, v in values.items() if k in proj.index and k != "qkv"}
    width, hidden = inputs["qkv"].shape[1], preset.hidden_size
    return proj, rest, hidden, width, inputs, values, variant, preset, table


def _as_tuple(outs) -> tuple:
    return outs if isinstance(outs, tuple) else (outs,)


def build_ahead(presets=PRESETS, tps=(1, 8), schedules=None, dtype=torch.bfloat16) -> int:
    """Launch every (preset, TP, schedule) projected kernel on ``meta`` tensors: under
    ``FQR_BUNDLE_BUILD_DIR`` each is compiled into the kernel bundle being built (what the
    device then loads instead of compiling). Returns the kernels launched."""
    from ..lowering import lower

    meta = torch.device("meta")

    def given(name: str, tp: int, tokens: int) -> tuple:
        proj, rest, hidden, width, *_ = projected_call(name, tp, tokens, dtype, meta)
        x = torch.empty(tokens, hidden, dtype=dtype, device=meta)
        w = torch.empty(width, hidden, dtype=dtype, device=meta)
        return proj, dict(rest, x=x, w_qkv=w, backend="triton")

    launched = 0
    for name in presets:
        for tp in tps:
            for tokens in BUILD_TOKENS:  # one in each of the public op's token buckets
                proj, args = given(name, tp, tokens)
                proj.function(**args)
                launched += 1
            for schedule in (schedules or SCHEDULES).values():
                if not schedule:
                    continue
                # at each of those in its range: a launch's specialisation (the workspace, the
                # token tiles) can differ between them
                low, high = schedule.get("min_tokens", 1), schedule.get("max_tokens", 1 << 30)
                for tokens in (t for t in BUILD_TOKENS if low <= t <= high):
                    proj, args = given(name, tp, tokens)
                    call = proj.bound(proj.bind((), args))
                    proj.validate(call)
                    options = lowering_options(schedule, args["x"].shape[1])
                    kernel = lower(proj.program(call), "cuda", **options)
                    kernel.launch(proj.operands(call))
                    launched += 1
    return launched


def _sets_for(weight_bytes: int, device: torch.device) -> int:
    """Weight sets that add up to at least twice ``device``'s L2 (at least 2 sets)."""
    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
    return max(2, math.ceil(2 * l2_bytes / weight_bytes))


def table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """The columns and cells of ``--projection``'s table (the CLI's and
    ``scripts/projection_table.py``'s): per row its µs, a fused schedule's "-" outside its T
    range and "fail" where its check failed, the best fused over the pair, the weights' copy,
    each schedule's largest ULP against float64."""
    names = list(rows[0]["fused_us"]) if rows else []
    columns = ["preset", "TP", "T", "GEMM", "GEMM+op", *(f"fused[{n}]" for n in names),
               "fused/pair", "weights copy", "max ULP"]  # fmt: skip

    def us(value) -> str:
        return "-" if value is None else f"{value:.2f}"

    cells = []
    for r in rows:
        checks = r["checks"]
        fused = [
            "fail" if name in checks and not checks[name]["passed"] else us(value)
            for name, value in r["fused_us"].items()
        ]
        ulps = ",".join(f"{n}:{c['max_ulp']}" for n, c in checks.items())
        cells.append([r["preset"], str(r["tp"]), str(r["tokens"]), us(r["gemm_us"]),
                      us(r["pair_us"]), *fused, us(r["fused_over_pair"]), us(r["weights_us"]),
                      ulps])  # fmt: skip
    return columns, cells


def preset_key(preset_name: str, tp: int, dtype: torch.dtype, device: str):
    """The dispatch table key (:class:`fqr.projection.Key`) of a preset's projected call at
    ``tp``, on the device named ``device``, without a projection bias (as the bench times it)."""
    from dataclasses import replace

    from ..projection import key_of

    meta = torch.device("meta")
    proj, rest, hidden, width, *_ = projected_call(preset_name, tp, 1, dtype, meta)
    x = torch.empty(1, hidden, dtype=dtype, device=meta)
    w = torch.empty(width, hidden, dtype=dtype, device=meta)
    call = proj.bound(proj.bind((), dict(rest, x=x, w_qkv=w)))
    return replace(key_of(proj, call), device=device)


def dispatch_table(rows: list[dict], device: str, *, source: str, kept: dict | None = None) -> dict:
    """A projection dispatch table (:mod:`fqr.projection`) from ``--projection`` rows measured
    on the device named ``device``: per (preset, TP, dtype) one entry, its ``measured`` the
    rows' ``[T, pair_us, fused_us["default"]]`` (null where that check failed), its choices
    derived from them. ``kept`` (``{key: entry}``, e.g. the shipped table's): entries for keys
    these rows do not measure, kept as they are, after the new ones. ``ValueError`` when a row
    lacks the ``default`` schedule (the public op, what the dispatch runs)."""
    from ..projection import entry_doc, table_doc

    def worse(a, b) -> bool:  # a (pair, fused) cell slower for the fused kernel than b
        return a[1] is None or (b[1] is not None and a[1] / a[0] > b[1] / b[0])

    models: dict = {}
    measured: dict = {}
    for r in rows:
        if "default" not in r["fused_us"]:
            raise ValueError(
                "a dispatch table needs the 'default' schedule (the public op, what the "
                f"dispatch runs); {r['preset']} TP{r['tp']} T={r['tokens']} has "
                f"{', '.join(r['fused_us']) or 'none'}"
            )
        key = preset_key(r["preset"], r["tp"], getattr(torch, r["dtype"]), device)
        names = models.setdefault(key, [])
        if f"{r['preset']} TP{r['tp']}" not in names:
            names.append(f"{r['preset']} TP{r['tp']}")
        cell = (r["pair_us"], r["fused_us"]["default"])
        cells = measured.setdefault(key, {})
        # two presets of one key at one T: the one less favourable to the fused kernel
        if r["tokens"] not in cells or worse(cell, cells[r["tokens"]]):
            cells[r["tokens"]] = cell
    entries = [
        entry_doc(k, [(t, *c) for t, c in cells.items()], model=" + ".join(models[k]),
                  source=source)
        for k, cells in measured.items()
    ]  # fmt: skip
    entries += [e.doc for k, e in (kept or {}).items() if k not in measured]
    return table_doc(entries, source=source)


def projection_cell(
    preset_name: str,
    tp: int,
    tokens: int,
    dtype: torch.dtype,
    schedules: dict[str, dict],
    timers,
    rep_ms: float,
    seed: int = 0,
) -> dict:
    """One row (module docstring): ``gemm_us``, ``pair_us``, ``weights_us``, and per schedule
    name ``fused_us[name]`` with its check (``checks[name]``: passed, max ULP)."""
    from .. import reference
    from ..lowering import lower

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(seed)
    proj, rest, hidden, width, inputs, values, variant, preset, table = projected_call(
        preset_name, tp, tokens, dtype, device, gen
    )
    base = variant.declaration
    weight_bytes = width * hidden * dtype.itemsize
    sets = _sets_for(weight_bytes, device)
    xs = [
        torch.randn(tokens, hidden, generator=gen, device=device, dtype=dtype) for _ in range(sets)
    ]
    ws = [
        (torch.randn(width, hidden, generator=gen, device=device, dtype=dtype) * hidden**-0.5)
        for _ in range(sets)
    ]
    row = dict(preset=preset_name, tp=tp, tokens=tokens, dtype=str(dtype).split(".")[-1],
               hidden=hidden, width=width, weight_sets=sets, fused_us={}, checks={})  # fmt: skip

    # the pair: cuBLAS into the packed row, then the prologue op on it
    rows = [torch.empty(tokens, width, device=device, dtype=dtype) for _ in range(sets)]
    base_values = {k: v for k, v in values.items() if k in base.index}

    def gemm_of(i: int) -> Callable[[], object]:
        return lambda: torch.mm(xs[i], ws[i].T, out=rows[i])

    def pair_of(i: int) -> Callable[[], object]:
        args = dict(base_values, qkv=rows[i], backend="triton")
        return lambda: (torch.mm(xs[i], ws[i].T, out=rows[i]), base.function(**args))

    row["gemm_us"] = timers.graph_us(rotating([gemm_of(i) for i in range(sets)]), rep_ms)
    row["pair_us"] = timers.graph_us(rotating([pair_of(i) for i in range(sets)]), rep_ms)

    exact_inputs = dict(inputs, qkv=reference.project(xs[0], ws[0]))
    expected = variant.expected(preset, exact_inputs, table)
    for name, given_schedule in schedules.items():
        most = given_schedule.get("max_tokens")  # the schedule's token range (bench keys)
        least = given_schedule.get("min_tokens")
        if (most is not None and tokens > int(most)) or (least is not None and tokens < least):
            row["fused_us"][name] = None
            continue
        schedule = lowering_options(given_schedule, hidden)
        calls = []
        for i in range(sets):
            given = dict(rest, x=xs[i], w_qkv=ws[i], backend="triton")
            if not schedule:  # the public op: its token buckets (CudaTarget.product_buckets)
                calls.append(lambda g=given: _as_tuple(proj.function(**g)))
                continue
            call = proj.bound(proj.bind((), given))
            proj.validate(call)
            kernel = lower(proj.program(call), "cuda", **schedule)
            operands = proj.operands(call)
            calls.append(lambda k=kernel, o=operands: k.launch(o))
        outs = calls[0]()
        results = [
            compare(out, exact, head_dim=preset.head_dim)
            for out, exact in zip(outs, expected.values())
        ]
        passed = all(r.passed for r in results)
        row["checks"][name] = dict(passed=passed, max_ulp=max((r.max_ulp or 0) for r in results))
        row["fused_us"][name] = timers.graph_us(rotating(calls), rep_ms) if passed else None
    # rotated over as many buffers as the weight sets, so that the copy streams from HBM too
    floors, _ = measure_copy_floor(weight_bytes, sets, device, rep_ms, timers)
    row["weights_us"] = floors.get("copy_us")
    best = [v for v in row["fused_us"].values() if v is not None]
    row["best_fused_us"] = min(best) if best else None
    row["fused_over_pair"] = row["best_fused_us"] / row["pair_us"] if best else None
    return row
