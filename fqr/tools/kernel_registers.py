"""Registers, spills and pipelined loads of fqr's cuda kernels, compiled for sm_90 on any machine.

Occupancy on the H200 is set by the registers a thread uses (65,536 a multiprocessor: 128 a
thread holds 16 warps, 25%; 64 holds 32, 50%), and Nsight Compute found every large-T kernel
register-limited (``../shared/profiles/README.md``). This tool compiles a preset's kernel with
each option set (the shipped table's variants, or a sweep's ``--sets``) through upstream
Triton for ``GPUTarget("cuda", 90, 32)`` (no GPU: Triton's own ``ptxas``), and reads what the
compiled kernel asks of the multiprocessor: ``ptxas -v`` on its PTX (registers a thread,
bytes spilled to local memory), the shared memory Triton allocated, and the asynchronous
copies in its PTX (``cp.async``: loads that Triton's pipeliner issues ahead of their use,
``pipeline_stages``).

``python -m fqr.tools.kernel_registers --preset qwen3-8b,deepseek-v3 [--sets shipped,sched-wide]
[--json]`` (``TRITON_INTERPRET`` must be unset: the kernels are compiled, not interpreted).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..lowering import lower, plan_program
from ..lowering.targets import tuned_variants
from ..lowering.tuning import TILING_OPTIONS, TOKEN_BUCKETS
from ..presets import get_preset
from ..prologue import variant_of
from .tuning_sweep import OPTION_SETS, SET_TOKENS

# The token count a shipped bucket's kernel is compiled for (its own grid does not matter: T
# is a runtime argument).
BUCKET_TOKENS = (1, 1024, 65536)


def shipped_sets(plan) -> list[dict[str, Any]]:
    """The shipped table's variants of ``plan``'s shape, one per token bucket (the grid cap
    left out: it changes no compiled code)."""
    sets = []
    for cfg in tuned_variants(plan):
        options = dict(zip(TILING_OPTIONS, cfg))
        options.pop("programs_per_sm")
        sets.append(options)
    return sets


def compile_sm90(kernel, tokens: int) -> Any:
    """``kernel`` (lowered for ``cuda``) compiled for sm_90 with its launch options, as a
    launch with ``tokens`` tokens would specialise it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ..lowering.ascend_compile import kernel_signature, launch_arguments

    args, kwargs, _ = launch_arguments(kernel, tokens)
    signature, constants = kernel_signature(kernel.fn, args, kwargs)
    signature = {k: v for k, v in signature.items() if v != "constexpr"}
    constexprs = {(kernel.fn.arg_names.index(k),): v for k, v in constants.items()}
    source = ASTSource(kernel.fn, signature, constexprs=constexprs)
    options = {k: v for k, v in kernel._launch.items() if k != "launch_pdl"}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def _ptxas() -> str:
    from triton.backends.nvidia import compiler

    return str(Path(compiler.__file__).with_name("bin") / "ptxas")


def ptxas_usage(ptx: str) -> dict[str, int]:
    """``ptxas -v`` of ``ptx`` for sm_90a: ``{"registers", "spill_stores", "spill_loads",
    "stack"}`` (bytes). A register budget is in the PTX (``.maxnreg``, from Triton's
    ``maxnreg``)."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "k.ptx"
        path.write_text(ptx)
        cmd = [_ptxas(), "-v", "--gpu-name=sm_90a", str(path), "-o", str(Path(d) / "k.cubin")]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    found = {
        "registers": r"Used (\d+) registers",
        "spill_stores": r"(\d+) bytes spill stores",
        "spill_loads": r"(\d+) bytes spill loads",
        "stack": r"(\d+) bytes stack frame",
    }
    return {k: int(m.group(1)) if (m := re.search(p, out)) else 0 for k, p in found.items()}


def occupancy(registers: int, warps: int) -> float:
    """Theoretical occupancy of an H100/H200 multiprocessor (64 warps, 65,536 registers, 32
    blocks) for blocks of ``warps`` warps using ``registers`` a thread (allocated per warp in
    units of 256; shared memory not counted)."""
    per_warp = -(-max(registers, 1) * 32 // 256) * 256
    by_registers = (65536 // per_warp) // warps * warps
    blocks = min(32, by_registers // warps, 64 // warps)
    return blocks * warps / 64


def measure(preset_name: str, sets: Sequence[str], dtype: torch.dtype = torch.bfloat16) -> list:
    """One row per (option set, token count) of ``preset_name`` under the option sets named
    by ``sets`` (``shipped``: the table's bucket variants; else a sweep's ``OPTION_SETS``)."""
    preset = get_preset(preset_name)
    program = variant_of(preset).program(preset, dtype)
    plan = plan_program(program)
    rows = []
    for name in sets:
        if name == "shipped":
            cases = list(zip(shipped_sets(plan), BUCKET_TOKENS, ("decode", "middle", "large")))
        else:
            tokens = SET_TOKENS.get(name, (1024,))[-1]
            cases = [(o, tokens, name) for o in OPTION_SETS[name](plan)]
        for options, tokens, label in cases:
            kernel = lower(program, "cuda", **options)
            # T is a runtime argument (never specialised): one token count compiles every
            # bucket's kernel as its own calls would (enough tokens for any slot mapping)
            compiled = compile_sm90(kernel, 1024)
            ptx = compiled.asm["ptx"]
            usage = ptxas_usage(ptx)
            warps = kernel._launch["num_warps"]
            rows.append(
                {
                    "preset": preset_name,
                    "set": label,
                    "T": tokens,
                    "options": options,
                    "programs_per_token_tile": kernel.grid_blocks,
                    **usage,
                    "shared": int(compiled.metadata.shared),
                    "cp_async": ptx.count("cp.async.ca") + ptx.count("cp.async.cg"),
                    "occupancy": occupancy(usage["registers"], warps),
                }
            )
    return rows


def _short(options: dict[str, Any]) -> str:
    names = {
        "num_warps": "w",
        "block_t": "bt",
        "tile_elems": "e",
        "chunk_mode": "",
        "heads_per_program": "hpp",
        "pipeline_stages": "stages",
    }
    return " ".join(
        f"{names.get(k, k)}{v}" if names.get(k, k) else str(v)
        for k, v in options.items()
        if v or k in ("num_warps", "block_t")
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fqr.tools.kernel_registers", description=__doc__
    )
    parser.add_argument("--preset", required=True, help="comma list of presets")
    parser.add_argument(
        "--sets",
        default="shipped",
        help=f"comma list of shipped, {', '.join(OPTION_SETS)} (default: shipped)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")
    args = parser.parse_args(argv)
    sets = [s for s in args.sets.split(",") if s]
    bad = [s for s in sets if s != "shipped" and s not in OPTION_SETS]
    if bad or not sets:
        print(f"error: --sets must name shipped or {', '.join(OPTION_SETS)}", file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("error: unset TRITON_INTERPRET: the kernels are compiled here", file=sys.stderr)
        return 2
    try:
        presets = [get_preset(n).name for n in args.preset.split(",") if n]
    except ValueError as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    rows = [r for p in presets for r in measure(p, sets)]
    if args.json:
        print(json.dumps(rows))
        return 0
    print(
        f"{'preset':24s} {'set':12s} {'T':>6s} {'progs':>5s} {'regs':>4s} {'spill':>5s} "
        f"{'smem':>6s} {'cp.async':>8s} {'occ':>4s}  options"
    )
    for r in rows:
        print(
            f"{r['preset']:24s} {r['set']:12s} {r['T']:6d} {r['programs_per_token_tile']:5d} "
            f"{r['registers']:4d} {r['spill_stores']:5d} {r['shared']:6d} {r['cp_async']:8d} "
            f"{r['occupancy']:4.0%}  {_short(r['options'])}"
        )
    return 0


assert len(BUCKET_TOKENS) == len(TOKEN_BUCKETS)

if __name__ == "__main__":
    sys.exit(main())
