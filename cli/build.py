"""``fqr build``: compile the kernels of model presets ahead of time into a kernel bundle."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import typer

from fqr.presets import PRESETS
from fqr.validate import NUMERICS

from .common import UsageError, app, err, example, out, parse_csv, schema
from .options import ACTIVATION_DTYPES_HELP, JsonOption, comma_list, parse_dtypes
from .render import add_plain_row, print_table


@app.command(
    epilog=example(
        "fqr build --preset qwen3-8b,deepseek-v3 --tp 1,2 --target cuda:90 -o kernels-h200",
        "FQR_KERNEL_BUNDLE=kernels-h200 vllm serve Qwen/Qwen3-8B",
    )
)
def build(
    preset: Annotated[
        list[str],
        comma_list("--preset", "-p", help="preset name(s), comma list", choices=lambda: PRESETS),
    ],
    output: Annotated[str, typer.Option("-o", "--output", help="the bundle's directory")],
    tp: Annotated[
        str, comma_list(help="tensor-parallel sizes, comma list (per-rank head counts)")
    ] = "1",
    dtype: Annotated[
        str, comma_list(help=f"activation dtypes: {ACTIVATION_DTYPES_HELP}, comma list")
    ] = "bf16",
    numerics: Annotated[
        str, comma_list(help=f"numerics modes: {', '.join(NUMERICS)}, comma list")
    ] = "fused",
    target: Annotated[
        str, typer.Option(help="the GPU the kernels are for: cuda:<arch>, e.g. cuda:90 (H100/H200)")
    ] = "cuda:90",
    json_out: JsonOption = False,
):
    """Compile every kernel the presets' calls need (each token bucket of the tuning table)
    for TARGET, on this machine (no GPU needed), into a bundle that FQR_KERNEL_BUNDLE or
    fqr.use_kernel_bundle loads with no compile."""
    from fqr.lowering.bundle import BundleTarget, BundleWriter
    from fqr.lowering.loader import triton_mode
    from fqr.presets import get_preset
    from fqr.tools.kernel_bundle import build_bundle

    # Every refusal before anything is created or compiled (LLVM aborts the process on an
    # architecture it does not know: the target is checked against the installed ptxas first).
    try:
        bundle_target = BundleTarget.parse(target)
        bundle_target.check_compilable()
    except ValueError as e:
        raise UsageError(f"--target: {e}") from None
    if not output:
        raise UsageError("-o/--output: an empty path; name the bundle's directory")
    names = list(dict.fromkeys(n for v in preset for n in parse_csv(v, "preset")))
    sizes = list(dict.fromkeys(parse_csv(tp, "tp", int)))
    pairs = []
    for name in names:
        for size in sizes:
            try:
                get_preset(name, size)
            except ValueError as e:
                raise UsageError(f"--preset {name} --tp {size}: {e}") from None
            pairs.append((name, size))
    modes = list(dict.fromkeys(parse_csv(numerics, "numerics")))
    for mode in modes:
        if mode not in NUMERICS:
            raise UsageError(f"--numerics must be among {', '.join(NUMERICS)}, got {mode!r}")
    dtypes = parse_dtypes(dtype)
    BundleWriter(output, bundle_target).check()  # a damaged or foreign bundle there, a link
    if triton_mode() == "interpreted" or os.environ.get("TRITON_INTERPRET") == "1":
        raise UsageError("fqr build compiles kernels: run it without TRITON_INTERPRET=1")
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError:
        raise UsageError(
            "fqr build needs upstream Triton with its nvidia backend (pip install 'fqr[triton]')"
        ) from None
    report = build_bundle(Path(output), pairs, dtypes=dtypes, numerics=modes, target=bundle_target)
    if json_out:
        doc = {"schema": schema("build"), "ok": True, **report.to_dict()}
        out.print_json(json.dumps(doc))
        return
    from rich.table import Table

    table = Table(title=f"kernel bundle {report.directory} ({report.target})")
    for column in ("preset", "tp", "dtype", "numerics", "tokens called", "kernels"):
        table.add_column(column)
    for row in report.rows:
        tokens = ",".join(f"{low}-{high}" for low, high in row["tokens"])
        cells = (row["preset"], row["tp"], row["dtype"], row["numerics"], tokens, row["compiled"])
        add_plain_row(table, *map(str, cells))
    print_table(table)
    err.print(
        f"{report.written} kernels compiled for {report.target} into {report.directory} in "
        f"{report.seconds:.1f} s (FQR_KERNEL_BUNDLE={report.directory} loads them)",
        highlight=False,
        markup=False,
    )
