"""The cuda target's tuning sweep: the data behind ``fqr/lowering/tuning.json``.

For each preset, every option set of :func:`option_sets` (warps, tokens per tile, chunk budget,
chunk mode: what changes the compiled kernel) is timed at each token count with each
program-per-SM cap of :data:`PROGRAMS_PER_SM` (what changes only the grid), as the bench times
fqr (device µs of CUDA-graph replays, rotating over enough input sets to overflow L2). The
option set with the least summed time relative to each token count's best wins its token
bucket (:func:`fqr.lowering.tuning.table_from_sweep`), and the table is rewritten with the
swept shapes' entries replaced.

Two steps, so that the GPU's time goes to running, not compiling:

``build``  on any machine, no GPU: every kernel the sweep launches, compiled for ``cuda:90``
           into a kernel bundle (:mod:`fqr.lowering.bundle`; launches on ``meta`` tensors at
           each alignment class of the swept token counts);
``run``    on the GPU, with ``FQR_KERNEL_BUNDLE`` naming that bundle: the timings (a JSON of
           rows, rewritten after each preset), then the regenerated table beside them.

``python -m fqr.tools.tuning_sweep build -o DIR [--preset ...] [--sets ...]``;
``python -m fqr.tools.tuning_sweep run --out DIR [--preset ...] [--decode | --launch-once]``.

The option sets (``--sets``): ``all`` (the 30 sets of warps, tokens per tile, chunk budget and
mode), ``decode`` (more warps, smaller grid chunks), and issue 38's schedule knobs, each beside
the shape's shipped variant so that one run compares them: ``sched-decode`` (T = 1, 16: the
decode schedule, ``heads_per_program``) and ``sched-wide`` (T = 16,384, 65,536: a register
budget, a pipelined token loop, warps over several tokens). A table regenerated from rows that
cover only some buckets keeps the other buckets' variants of the table before.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..core import dtype_name
from ..lowering import lower, plan_program
from ..lowering.bundle import BundleTarget, building
from ..lowering.plan import KernelPlan
from ..lowering.targets import UNTUNED, shape_key, tuned_variants
from ..lowering.tuning import (
    TILING_OPTIONS,
    TOKEN_BUCKETS,
    TUNING_FILE,
    config_of,
    load_table,
    parse_table,
    table_from_sweep,
    table_text,
    upgraded,
)
from ..presets import get_preset
from ..prologue import get_variant, variant_of

# The bench's presets with a row in docs/PERFORMANCE.md's table (issue 31): one of each variant
# and the base models, those furthest from the copy ceiling first (a sweep cut short keeps the
# presets it finished).
SWEEP_PRESETS = (
    "deepseek-v3", "deepseek-v3.2", "qwen3.5-27b", "minimax-m3-index-cache", "deepseek-v3-q-rope",
    "qwen3-8b-kv-insert", "minimax-m3", "minimax-m3-kvcache", "qwen3-vl-8b", "qwen3-8b",
    "qwen3-vl-8b-qk-mrope", "llama3-8b-qk-rope", "gemma4-31b-sliding", "llama4-scout",
    "qwen3-0.6b",
)  # fmt: skip
# Two token counts per bucket of the table (decode <= 256, middle <= 8192, large): each bucket's
# winner is chosen over the counts measured in it.
SWEEP_TOKENS = (1, 16, 1024, 4096, 16384, 65536)
PROGRAMS_PER_SM = (0, 4, 8, 16)  # 0: one program per token tile
# Presets whose chosen variants the plain split-qkv row of the same model takes too: text-only
# mRoPE must give plain RoPE's bits (tests/gpu/test_gpu.py::
# test_text_only_mrope_is_plain_rope_bit_for_bit), so the two kernels reduce in one order.
# (qwen3-vl-8b needs no entry here: its program has Qwen3-8B's table key.)
PLAIN_ROW_TIED = ("qwen3.5-27b",)


def option_sets(plan: KernelPlan | None = None) -> list[dict[str, Any]]:
    """The compiled option sets swept: 1, 2 or 4 warps, 1, 2 or 4 tokens per tile, chunks of
    2048 or 4096 fp32 values, unrolled or grid chunks (not 4 tokens of 4096 values: registers
    spill). No earlier H200 sweep chose 8 warps."""
    return [
        dict(num_warps=w, block_t=b, tile_elems=e, chunk_mode=m)
        for w, b, e, m in itertools.product((1, 2, 4), (1, 2, 4), (2048, 4096), ("unroll", "grid"))
        if not (b == 4 and e == 4096)
    ]


def decode_option_sets(plan: KernelPlan | None = None) -> list[dict[str, Any]]:
    """The decode sweep's option sets (``--sets decode``, at T = 1 and 16): grid chunks of 512,
    1,024 or 2,048 values over 4, 8 or 16 warps, one token per tile. At T = 1 a call is latency:
    fewer values per thread shorten each program's chain of loads, sums and stores."""
    return [
        dict(num_warps=w, block_t=1, tile_elems=e, chunk_mode="grid")
        for w, e in itertools.product((4, 8, 16), (512, 1024, 2048))
    ]


def _shipped_variant(plan: KernelPlan | None, bucket: int) -> dict[str, Any] | None:
    """The option set the shipped table runs ``plan`` with in token bucket ``bucket`` (the
    grid cap left to the sweep), or None without a plan."""
    if plan is None:
        return None
    cfg = dict(zip(TILING_OPTIONS, tuned_variants(plan)[bucket]))
    cfg.pop("programs_per_sm")
    return cfg


def sched_decode_option_sets(plan: KernelPlan | None = None) -> list[dict[str, Any]]:
    """The decode schedule's option sets (issue 38, ``--sets sched-decode``, at T = 1 and 16):
    each chain's heads in groups of 1, 2 or 4, one program per group (grid axis 1), in
    programs of 1, 2 or 4 warps, one token per tile (a chain reduced over its whole row stays
    one program, chunked by 2048 values); beside them the shipped decode variant of the
    plan's shape, timed in the same run."""
    sets = [
        dict(num_warps=w, block_t=1, tile_elems=2048, chunk_mode="grid", heads_per_program=h)
        for h, w in itertools.product((1, 2, 4), (1, 2, 4))
    ]
    shipped = _shipped_variant(plan, 0)
    return ([shipped] if shipped and shipped not in sets else []) + sets


def sched_wide_option_sets(plan: KernelPlan | None = None) -> list[dict[str, Any]]:
    """The wide-row schedule's option sets (issue 38, ``--sets sched-wide``, at large T), from
    the shipped large-T variant of the plan's shape (2 warps, 1 token, 2048-value unrolled
    chunks without a plan): that variant under a register budget of 64 or 80 registers a
    thread (half / 40% occupancy on the H200) and with its token loop pipelined (2 stages:
    the next tile's loads in flight; the grid caps of the sweep make the loop iterate); and
    2 warps over 2 tokens or 4 over 4 (several warps a program for the one-warp kernels), with
    and without the 64-register budget."""
    base = _shipped_variant(plan, len(TOKEN_BUCKETS) - 1) or dict(
        num_warps=2, block_t=1, tile_elems=2048, chunk_mode="unroll"
    )
    base = {**base, "heads_per_program": 0}  # the decode schedule is not a wide-row one
    sets = [
        {**base, "maxnreg": r, "pipeline_stages": s}
        for r, s in itertools.product((0, 64, 80), (0, 2))
    ]
    for w in (2, 4):
        if base["tile_elems"] * w > 8192:  # 4 tokens of 4096 values: registers spill
            continue
        sets += [
            {**base, "num_warps": w, "block_t": w, "maxnreg": r, "pipeline_stages": 0}
            for r in (0, 64)
        ]
    unique: list[dict[str, Any]] = []
    for cfg in sets:
        if cfg not in unique:
            unique.append(cfg)
    return unique


OPTION_SETS: dict[str, Callable[..., list[dict[str, Any]]]] = {
    "all": option_sets,
    "decode": decode_option_sets,
    "sched-decode": sched_decode_option_sets,
    "sched-wide": sched_wide_option_sets,
}
# The token counts a set is swept at unless --tokens says otherwise.
SET_TOKENS = {"sched-decode": (1, 16), "sched-wide": (16384, 65536)}


def _alignment_classes(tokens: Iterable[int]) -> list[int]:
    """One token count per 16-byte alignment class among ``tokens`` (an argument whose offset
    grows with T, mRoPE's position planes at ``8 * T`` bytes, specialises by T's parity)."""
    seen: dict[int, int] = {}
    for t in tokens:
        seen.setdefault(t % 2, t)
    return sorted(seen.values())


def _meta(inputs: dict) -> dict:
    return {n: t.to("meta") if isinstance(t, torch.Tensor) else t for n, t in inputs.items()}


def build(
    directory: str | Path,
    presets: Sequence[str] = SWEEP_PRESETS,
    tokens: Sequence[int] = SWEEP_TOKENS,
    dtype: torch.dtype = torch.bfloat16,
    target: str = "cuda:90",
    log: Callable[[str], None] = print,
    option_sets_of: str = "all",
) -> int:
    """Compile every kernel :func:`run` launches (with the option sets ``OPTION_SETS[
    option_sets_of]``) into the bundle ``directory``; the number of kernels written."""
    with building(directory, BundleTarget.parse(target)) as writer:
        for name in presets:
            preset = get_preset(name)
            variant = variant_of(preset)
            program = variant.program(preset, dtype)
            before, start = writer.written, time.perf_counter()
            table = torch.empty((preset.max_position, preset.rotary_dim), device="meta")
            for t in _alignment_classes(tokens):
                drawn = variant.draw(
                    preset, t, dtype, torch.Generator().manual_seed(0),
                    max_position=preset.max_position,
                )  # fmt: skip
                args = variant.program_args(preset, _meta(drawn), table)
                for options in OPTION_SETS[option_sets_of](plan_program(program)):
                    lower(program, "cuda", **options).launch(args, donate=True)
            log(f"{name}: {writer.written - before} kernels in {time.perf_counter() - start:.0f} s")
        return writer.written


def run(
    presets: Sequence[str] = SWEEP_PRESETS,
    tokens: Sequence[int] = SWEEP_TOKENS,
    dtype: torch.dtype = torch.bfloat16,
    *,
    rep_ms: float = 5.0,
    save: Callable[[list[dict]], None] | None = None,
    log: Callable[[str], None] = print,
    device: torch.device | None = None,
    timers: Any = None,
    target: str = "cuda",
    option_sets_of: str = "all",
) -> list[dict]:
    """Device µs of every (preset, T, option set, programs per SM) on ``device`` (default: the
    current CUDA device, timed by :class:`fqr.bench.timers.CudaTimers`): rows ``{"preset", "T",
    "cfg": {option: value}, "us", "gbps"}`` (a cap the grid does not reach at that T is the
    uncapped grid: measured once, recorded for each), over the option sets
    ``OPTION_SETS[option_sets_of]``. ``target``: the lowering target (the tests run the sweep's
    bookkeeping on ``interpret``)."""
    from ..bench.environment import environment
    from ..bench.floors import rotating
    from ..bench.timers import CudaTimers
    from ..bench.traffic import rotation_sets
    from ..bench.variant_cells import variant_traffic

    device = device or torch.device("cuda", torch.cuda.current_device())
    timers, l2 = timers or CudaTimers(), environment(device)["l2_bytes"]
    rows: list[dict] = []
    for name in presets:
        preset = get_preset(name)
        variant = variant_of(preset)
        program = variant.program(preset, dtype)
        cache = preset.cos_sin_cache().to(device)
        start = time.perf_counter()
        for t in tokens:
            generator = torch.Generator(device=device).manual_seed(t)
            limit = cache.shape[0]
            first = variant.draw(preset, t, dtype, generator, max_position=limit)
            moved = variant_traffic(variant, preset, first, cache, dtype).total
            sets = [first] + [
                variant.draw(preset, t, dtype, generator, max_position=limit)
                for _ in range(rotation_sets(moved, l2) - 1)
            ]
            operands = [variant.program_args(preset, s, cache) for s in sets]
            best = None
            # (tiling, tokens per tile, launch options, grid) -> us: option sets that lower
            # to one kernel launched alike (a knob a shape has no use for) are timed once
            timed: dict[tuple, float] = {}
            for options in OPTION_SETS[option_sets_of](plan_program(program)):
                for per_sm in PROGRAMS_PER_SM:
                    kernel = lower(program, target, **options, programs_per_sm=per_sm)
                    programs = kernel.target.grid(t, kernel._block_t, device, **kernel.options)
                    same = (
                        repr(kernel.tiling),
                        kernel._block_t,
                        tuple(sorted(kernel._launch.items())),
                        programs,
                    )
                    if same not in timed:
                        calls = [lambda k=kernel, a=a: k.launch(a, donate=True) for a in operands]
                        timed[same] = timers.graph_us(rotating(calls), rep_ms)
                    us = timed[same]
                    # every option named, in the table's order (a knob not set: off)
                    cfg = dict(
                        zip(TILING_OPTIONS, config_of({**options, "programs_per_sm": per_sm}))
                    )
                    rows.append(
                        {"preset": name, "T": t, "cfg": cfg, "us": us, "gbps": moved / us / 1e3}
                    )
                    if best is None or us < best["us"]:
                        best = rows[-1]
            assert best is not None
            log(f"{name} T={t}: best {best['us']:.2f} us ({best['gbps']:.0f} GB/s) {best['cfg']}")
            del sets, operands, first
            if device.type == "cuda":
                torch.cuda.empty_cache()
        log(f"{name}: {time.perf_counter() - start:.0f} s")
        if save is not None:
            save(rows)
    return rows


def _shipped(name: str, tokens: int, dtype: torch.dtype) -> tuple:
    """``(preset, variant, kernels, table, generator)`` of preset ``name`` on the current CUDA
    device: its program's kernels as the tuning table picks them (``lower_by_tokens``), its
    RoPE table there and a generator there seeded with ``tokens``."""
    from ..lowering import lower_by_tokens

    device = torch.device("cuda", torch.cuda.current_device())
    preset = get_preset(name)
    variant = variant_of(preset)
    kernels = lower_by_tokens(variant.program(preset, dtype), "cuda")
    table = preset.cos_sin_cache().to(device)
    return preset, variant, kernels, table, torch.Generator(device=device).manual_seed(tokens)


def decode_latency(
    presets: Sequence[str] = SWEEP_PRESETS,
    tokens: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    rep_ms: float = 5.0,
) -> list[dict]:
    """Where a decode call's device time goes, per preset at ``tokens`` with its tuned kernel:
    µs of graph replays over rotating input sets (``cold``: nothing in L2, as the bench
    times), over sets that share one positions tensor (``index_hot``: the positions and the
    table rows they pick stay in L2, the rows and outputs rotate), and of one set
    (``all_hot``); ``empty`` is an empty kernel. ``cold - index_hot`` is what the dependent
    loads (positions, then the table row at each position) cost beyond the rows' own load."""
    from ..bench.floors import empty_kernel_us, rotating
    from ..bench.timers import CudaTimers

    timers = CudaTimers()
    rows = []
    for name in presets:
        preset, variant, kernels, cache, generator = _shipped(name, tokens, dtype)
        sets = [
            variant.draw(preset, tokens, dtype, generator, max_position=cache.shape[0])
            for _ in range(32)
        ]
        shared = [
            {**s, **{n: sets[0][n] for n in ("positions", "slot_mapping") if n in s}} for s in sets
        ]

        timed = {}
        for label, inputs in (("cold", sets), ("index_hot", shared), ("all_hot", sets[:1])):
            operands = [variant.program_args(preset, x, cache) for x in inputs]
            calls = [lambda k=kernels, a=a: k.launch(a, donate=True) for a in operands]
            timed[label] = timers.graph_us(rotating(calls), rep_ms)
        rows.append({"preset": name, "T": tokens, **timed})
    empty = empty_kernel_us(timers, rep_ms)
    for r in rows:
        r["empty"] = empty
    return rows


def launch_once(
    presets: Sequence[str], tokens: int, dtype: torch.dtype = torch.bfloat16, warmup: bool = True
) -> list[str]:
    """Launch each preset's shipped kernel (its token bucket's variant) once at ``tokens`` on
    the current CUDA device, after one warm-up launch (``warmup``; a profiler that replays
    the kernel itself needs none): what a profiler (``ncu --kernel-name regex:fqr_``)
    attaches to. Returns the kernels' names, in launch order."""
    names = []
    for name in presets:
        preset, variant, kernels, cache, generator = _shipped(name, tokens, dtype)
        drawn = variant.draw(preset, tokens, dtype, generator, max_position=cache.shape[0])
        args = variant.program_args(preset, drawn, cache)
        if warmup:
            kernels.launch(args, donate=True)
            torch.cuda.synchronize()
        kernels.launch(args, donate=True)
        torch.cuda.synchronize()
        fn = kernels.kernel_for(tokens).fn
        names.append(getattr(fn, "__name__", repr(fn)))
    return names


def shape_groups(presets: Iterable[str], dtype: torch.dtype = torch.bfloat16) -> dict[str, tuple]:
    """Each preset's tuning-table key (:func:`fqr.lowering.targets.shape_key`); presets whose
    programs share one are one group, named ``a+b``: the table has one entry per key."""
    keys: dict[tuple, list[str]] = {}
    for name in presets:
        preset = get_preset(name)
        key = shape_key(plan_program(variant_of(preset).program(preset, dtype)))
        keys.setdefault(key, []).append(name)
    return {"+".join(names): key for key, names in keys.items()}


def _scored_together(rows: Sequence[dict], members: list[str], group: str) -> list[dict]:
    """One row per (T, option set) of ``group``: ``us`` the sum over ``members`` of each one's
    time relative to its best at that T (option sets measured for every member only)."""
    relative: dict[tuple, list[float]] = {}
    best: dict[tuple, float] = {}
    for r in rows:
        if r["preset"] in members:
            at = (r["preset"], r["T"])
            best[at] = min(best.get(at, float("inf")), r["us"])
    for r in rows:
        if r["preset"] in members:
            cfg = config_of(r["cfg"])
            relative.setdefault((r["T"], cfg), []).append(r["us"] / best[(r["preset"], r["T"])])
    return [
        {"preset": group, "T": t, "cfg": dict(zip(TILING_OPTIONS, cfg)), "us": sum(times)}
        for (t, cfg), times in relative.items()
        if len(times) == len(members)
    ]


def regenerated_table(
    rows: Sequence[dict], base: dict, *, source: str, dtype: torch.dtype = torch.bfloat16
) -> dict:
    """``base`` (a tuning document) with an entry per swept shape from ``rows`` (presets that
    share a shape are scored together: :func:`_scored_together`), replacing ``base``'s entry
    for that shape and dtype."""
    groups = shape_groups(sorted({r["preset"] for r in rows}), dtype)
    grouped = [row for group in groups for row in _scored_together(rows, group.split("+"), group)]
    models = {}
    for group in groups:
        names = group.split("+")
        hf_ids = ", ".join(get_preset(n).hf_id or n for n in names)
        models[group] = f"{' + '.join(names)} ({hf_ids})"
    base = upgraded(base)
    _, before = parse_table(base)
    kept_variants = {g: before[key] for g, key in groups.items() if key in before}
    swept = table_from_sweep(
        grouped, groups, UNTUNED, source=source, models=models, kept=kept_variants
    )
    kept_dtype = None if dtype == torch.bfloat16 else dtype_name(dtype)
    for e in swept["entries"]:
        e["dtype"] = kept_dtype
    for name in PLAIN_ROW_TIED:
        group = next((g for g in groups if name in g.split("+")), None)
        if group is None:
            continue
        preset = get_preset(name)
        plain = get_variant("split-qkv").program(preset, dtype)
        chosen = next(e for e in swept["entries"] if e["shape"] == [list(c) for c in groups[group]])
        swept["entries"].append(
            {
                **chosen,
                "model": f"{name}'s q/k/v row without the gate ({preset.hf_id or name})",
                "shape": [list(c) for c in shape_key(plan_program(plain))],
            }
        )
    swept_keys = {(json.dumps(e["shape"]), e["dtype"]) for e in swept["entries"]}
    kept = [
        e for e in base["entries"] if (json.dumps(e["shape"]), e.get("dtype")) not in swept_keys
    ]
    doc = {**base, "source": source, "entries": kept + swept["entries"]}
    parse_table(doc)  # the document the target will read: refused here, not at import
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fqr.tools.tuning_sweep", description=__doc__)
    sub = parser.add_subparsers(dest="step", required=True)
    b = sub.add_parser("build", help="compile the sweep's kernels into a bundle (no GPU)")
    b.add_argument("-o", "--output", required=True, help="the bundle directory")
    r = sub.add_parser("run", help="time the sweep on the GPU; write rows and a table")
    r.add_argument("--out", required=True, help="directory for sweep.json and tuning.json")
    r.add_argument("--rep-ms", type=float, default=5.0)
    r.add_argument(
        "--decode", action="store_true", help="instead: where T = 1's time goes (decode_latency)"
    )
    r.add_argument(
        "--launch-once",
        action="store_true",
        help="instead: each preset's shipped kernel launched twice at each --tokens (for a "
        "profiler: fqr.tools.ncu_summary reads its report)",
    )
    r.add_argument(
        "--no-warmup",
        action="store_true",
        help="with --launch-once: one launch of each kernel (ncu replays it itself)",
    )
    r.add_argument(
        "--with-rows",
        help="an earlier sweep's sweep.json: its rows join this run's in the table (a decode "
        "sweep adds option sets to the decode bucket of a full one)",
    )
    for p in (b, r):
        p.add_argument("--preset", default=",".join(SWEEP_PRESETS))
        p.add_argument(
            "--tokens",
            default=None,
            help=f"comma list (default: {','.join(map(str, SWEEP_TOKENS))}; for the sched "
            "sets, the T they are for: 1,16 and 16384,65536)",
        )
        p.add_argument(
            "--sets",
            default="all",
            help=f"option sets, a comma list of {', '.join(OPTION_SETS)} (build: the union, "
            "each at its own token counts)",
        )
    args = parser.parse_args(argv)
    presets = [n for n in args.preset.split(",") if n]
    set_names = [n for n in args.sets.split(",") if n]
    unknown = [n for n in set_names if n not in OPTION_SETS]
    if unknown or not set_names:
        print(f"error: --sets must name option sets of {', '.join(OPTION_SETS)}", file=sys.stderr)
        return 2
    try:
        default = ",".join(map(str, SET_TOKENS.get(set_names[0], SWEEP_TOKENS)))
        tokens = [int(t) for t in (args.tokens or default).split(",") if t]
        if not tokens or min(tokens) < 1:
            raise ValueError(f"--tokens must be positive ints, got {args.tokens!r}")
        for n in presets:
            get_preset(n)
    except ValueError as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    if args.step == "build":
        written = 0
        for name in set_names:
            at = tokens if args.tokens else list(SET_TOKENS.get(name, SWEEP_TOKENS))
            written += build(args.output, presets, at, option_sets_of=name)
        print(f"bundle {args.output}: {written} kernels written")
        return 0
    if len(set_names) > 1:
        print("error: run takes one --sets (chain runs with --with-rows)", file=sys.stderr)
        return 2
    args.sets = set_names[0]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save(rows: list[dict]) -> None:
        (out / "sweep.json").write_text(json.dumps({"options": TILING_OPTIONS, "rows": rows}))

    if args.launch_once:
        for t in tokens:
            for name, kernel in zip(presets, launch_once(presets, t, warmup=not args.no_warmup)):
                print(f"{name} T={t}: {kernel}", flush=True)
        return 0
    if args.decode:
        found = decode_latency(presets)
        (out / "decode.json").write_text(json.dumps(found))
        print("preset                    T  cold us  index hot  all hot  empty kernel")
        for r in found:
            print(
                f"{r['preset']:24s} {r['T']:2d} {r['cold']:8.2f} {r['index_hot']:10.2f} "
                f"{r['all_hot']:8.2f} {r['empty']:13.2f}"
            )
        return 0
    kept: list[dict] = []

    def save_and_keep(rows: list[dict]) -> None:
        kept[:] = rows
        save(rows)

    try:
        run(presets, tokens, rep_ms=args.rep_ms, save=save_and_keep, option_sets_of=args.sets)
    except KeyboardInterrupt:  # cut short (timeout -s INT): the table of the presets done
        print(f"interrupted: a table of the {len({r['preset'] for r in kept})} presets done")
    rows = kept
    if not rows:
        return 1
    if args.with_rows:
        earlier = json.loads(Path(args.with_rows).read_text())["rows"]
        rows = earlier + rows
    base = json.loads(TUNING_FILE.read_text())
    source = (
        f"fqr.tools.tuning_sweep on {torch.cuda.get_device_name()} (bf16, T = "
        f"{', '.join(map(str, tokens))}, device us of CUDA-graph replays over rotating inputs; "
        f"presets {', '.join(presets)}); the shapes not swept keep the entries of the table "
        "before (its source: git history)"
    )
    doc = regenerated_table(rows, base, source=source)
    (out / "tuning.json").write_text(table_text(doc))
    load_table(out / "tuning.json")
    print(f"{out / 'tuning.json'}: {len(doc['entries'])} entries")
    return 0


if __name__ == "__main__":
    sys.exit(main())
