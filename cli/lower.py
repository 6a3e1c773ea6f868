"""``fqr lower``: print the traced program and/or the generated kernel for a preset."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from fqr.files import write_file
from fqr.lowering.ascend import CHIPS

from .common import EXIT_FAILED, UsageError, app, err, example, out, schema
from .options import (
    Dtype,
    DtypeOption,
    Numerics,
    NumericsOption,
    PresetName,
    TargetName,
    choice_enum,
    parse_dtype,
)
from .render import add_plain_row, print_table

Chip = choice_enum("Chip", CHIPS)


@app.command(
    epilog=example(
        "fqr lower --preset qwen3-8b --ir",
        "fqr lower --preset gemma3-27b --target ascend --check --json",
    )
)
def lower(
    preset: Annotated[
        PresetName | None,
        typer.Option(help="model preset, e.g. qwen3-8b (--check: default every preset)"),
    ] = None,
    tp: Annotated[
        int | None,
        typer.Option(
            help="tensor-parallel size (per-rank head counts); default 1 (--check: each of 1, 2, "
            "4, 8 the preset allows)",
        ),
    ] = None,
    dtype: DtypeOption = Dtype.bf16,
    target: Annotated[TargetName, typer.Option(help="the lowering target")] = TargetName.cuda,
    numerics: NumericsOption = Numerics.fused,
    bias: Annotated[bool, typer.Option("--bias", help="norm with a bias term")] = False,
    ir: Annotated[bool, typer.Option("--ir", help="print the traced program (jaxpr-like)")] = False,
    output: Annotated[
        Path | None, typer.Option("-o", "--output", help="write the kernel source here")
    ] = None,
    check: Annotated[
        bool,
        typer.Option(
            "--check",
            help="ascend: compile through Triton-Ascend's stages (TTIR, triton-adapter-opt -> "
            "linalg/HIVM; bishengir needs CANN)",
        ),
    ] = False,
    num_vectorcore: Annotated[
        int | None,
        typer.Option(
            help="ascend: persistent grid size (default: the NPU's vector cores, offline 40)",
        ),
    ] = None,
    chip: Annotated[Chip | None, typer.Option(help="ascend: the chip (UB budget, arch)")] = None,
    ub_bytes: Annotated[
        int | None, typer.Option(help="ascend: override the chip's UB size")
    ] = None,
    json_out: Annotated[
        bool,
        typer.Option(
            "--json",
            help="print one JSON document: the program, the kernel source (or the file written)"
            " and its options; with --check the compile reports",
        ),
    ] = False,
):
    """Trace the prologue of PRESET and emit its fused Triton kernel for TARGET."""
    from fqr import get_preset
    from fqr.lowering import kernel_source
    from fqr.prologue import program_of

    preset_name = None if preset is None else preset.value
    target, numerics = target.value, numerics.value
    chip = None if chip is None else chip.value
    ascend = {
        k: v
        for k, v in (("chip", chip), ("ub_bytes", ub_bytes), ("num_vectorcore", num_vectorcore))
        if v is not None
    }
    if ascend and not target.startswith("ascend"):
        raise UsageError("--chip/--ub-bytes/--num-vectorcore apply to --target ascend only")
    if check:
        if target != "ascend":
            raise UsageError(
                f"--check compiles for an NPU: it needs --target ascend, got {target!r}"
            )
        _ascend_check(preset_name, tp, parse_dtype(dtype), numerics, bias, ascend, json_out)
        return
    if preset_name is None:
        raise UsageError("--preset is required (e.g. --preset qwen3-8b)")
    tp = 1 if tp is None else tp
    p = get_preset(preset_name, tp)
    program = program_of(
        p, parse_dtype(dtype), numerics=numerics, bias=bias, sharded_full_norm=tp > 1
    )
    if ir and not json_out:
        out.print(str(program), highlight=False, markup=False)
    source = kernel_source(program, target, **ascend)
    if output is not None:
        try:
            write_file(output, source)  # never through a symlink
        except OSError as e:
            raise UsageError(f"-o {output}: cannot write the kernel source: {e.strerror}") from None
        err.print(
            f"wrote {output} ({len(source.splitlines())} lines, target {target})",
            highlight=False,
            markup=False,
        )
    if json_out:
        doc = {
            "schema": schema("lower"),
            "ok": True,
            "preset": p.name,
            "tp": tp,
            "dtype": dtype.value,
            "target": target,
            "numerics": numerics,
            "bias": bias,
            "options": ascend,
            "program": str(program),
        }
        doc |= {"output": str(output)} if output is not None else {"source": source}
        out.print_json(json.dumps(doc))
    elif output is None and not ir:
        out.print(source, highlight=False, markup=False)


def _ascend_check(preset, tp, dtype, numerics, bias, options, json_out) -> None:
    """``--target ascend --check``: one row per (preset, TP), and one for the projected form of
    the preset's op where it has one (fused numerics: its only mode) at the TP sizes of
    ``projected_tp_pairs``; exit 1 when a stage fails."""
    from rich.table import Table

    from fqr.lowering.ascend_compile import NEEDS_CANN
    from fqr.tools.ascend_check import (
        check_preset,
        check_projected,
        preset_tp_pairs,
        projected_tp_pairs,
        require_triton_ascend,
    )

    require_triton_ascend()
    cube = {k: v for k, v in options.items() if k != "num_vectorcore"}  # AI cores: its grid
    results = []
    projected = set(projected_tp_pairs(preset, tp)) if numerics == "fused" else set()
    for name, size in preset_tp_pairs(preset, tp):
        checks = [partial(check_preset, numerics=numerics, bias=bias, **options)]
        if (name, size) in projected:
            checks.append(partial(check_projected, bias=bias, **cube))
        for check in checks:
            r = check(name, size, dtype)
            err.print(f"{r.label}: {r.report.summary}", highlight=False, markup=False)
            results.append(r)
    failed = [r for r in results if not r.report.passed]
    if json_out:
        doc = {
            "schema": schema("lower.check"),
            "ok": not failed,
            "checks": [r.to_dict() for r in results],
        }
        out.print_json(json.dumps(doc))
    else:
        archs = ", ".join(sorted({r.report.arch for r in results}))
        table = Table(title=f"ascend compile check ({archs})")
        cols = ("preset", "chip", "BLOCK_T", "head chunks", "UB KiB", "ttir", "linalg", "npubin")
        for col in cols:
            table.add_column(col, no_wrap=True)
        for r in results:
            st = {s.name: s.status for s in r.report.stages}
            add_plain_row(
                table,
                r.label,
                r.tiling.chip.name,
                str(r.tiling.tiling.block_t),
                "/".join(map(str, r.tiling.tiling.head_chunks)),
                f"{r.tiling.footprint / 1024:.0f}/{r.tiling.budget / 1024:.0f}",
                *(st.get(n, "-") for n in ("ttir", "linalg", "npubin")),
            )
        print_table(table)
    for r in failed:
        bad = next(s for s in r.report.stages if s.status == "failed")
        err.print(
            f"[red]FAILED[/red] {escape(f'{r.label} at {bad.name}: {bad.detail}')}",
            highlight=False,
        )
    if any(s.status == NEEDS_CANN for r in results for s in r.report.stages):
        err.print(
            "note: the last step (bishengir-compile: HIVM -> NPU binary) needs the CANN "
            "toolkit, which is not installed here; TTIR and Ascend linalg/HIVM passed "
            "through Triton-Ascend's own stages.",
            highlight=False,
        )
    err.print(
        f"{len(results) - len(failed)} passed, {len(failed)} failed", highlight=False, markup=False
    )
    if failed:
        raise typer.Exit(EXIT_FAILED)
