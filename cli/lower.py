"""``fqr lower``: print the traced program and/or the generated kernel for a preset."""

from __future__ import annotations

from pathlib import Path

import typer

from .common import UsageError, app, err, out
from .options import DTYPES, parse_dtype

TARGET_NAMES = ("cuda", "interpret", "ascend", "ascend-interpret")


@app.command()
def lower(
    preset: str = typer.Option(..., "--preset", help="model preset, e.g. qwen3-8b"),
    tp: int = typer.Option(1, "--tp", help="tensor-parallel size (per-rank head counts)"),
    dtype: str = typer.Option("bf16", "--dtype", help=f"activation dtype: {', '.join(DTYPES)}"),
    target: str = typer.Option("cuda", "--target", help=f"one of {', '.join(TARGET_NAMES)}"),
    numerics: str = typer.Option("fused", "--numerics", help="fused | unfused"),
    bias: bool = typer.Option(False, "--bias", help="norm with a bias term"),
    ir: bool = typer.Option(False, "--ir", help="print the traced program (jaxpr-like)"),
    output: Path = typer.Option(None, "-o", "--output", help="write the kernel source here"),
):
    """Trace the prologue of PRESET and emit its fused Triton kernel for TARGET."""
    from fqr import get_preset
    from fqr.lowering import kernel_source
    from fqr.prologue import preset_program

    if target not in TARGET_NAMES:
        raise UsageError(f"--target must be one of {', '.join(TARGET_NAMES)}, got {target!r}")
    if numerics not in ("fused", "unfused"):
        raise UsageError(f"--numerics must be fused or unfused, got {numerics!r}")
    p = get_preset(preset, tp)
    program = preset_program(p, parse_dtype(dtype), numerics=numerics, bias=bias,
                             sharded_full_norm=tp > 1)
    if ir:
        out.print(str(program), highlight=False, markup=False)
    source = kernel_source(program, target)
    if output is not None:
        output.write_text(source)
        err.print(f"wrote {output} ({len(source.splitlines())} lines, target {target})")
    elif not ir:
        out.print(source, highlight=False, markup=False)
