"""``fqr golden list`` and ``fqr golden regen``: show and rebuild the bundled golden cases.

The cases, their storage and the exact float64 expectations are defined in :mod:`fqr.golden`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from fqr.golden import GOLDEN_DIR, is_source_checkout, list_cases, regen

from .common import EXIT_FAILED, UsageError, app, err, example, out, schema
from .options import CaseOption, JsonOption
from .render import add_plain_row, plain, print_table

golden_app = typer.Typer(no_args_is_help=True, help="List and regenerate the golden cases.")
app.add_typer(golden_app, name="golden")

DirOption = Annotated[
    Path, typer.Option("--dir", help="golden directory (manifest.json + *.safetensors)")
]


@golden_app.command("list", epilog=example("fqr golden list --case 'gemma3*' --json"))
def golden_list(
    directory: DirOption = GOLDEN_DIR,
    case: CaseOption = None,
    json_out: JsonOption = False,
):
    """Show the cases in the manifest: shape, dtype, numerics, variations and tolerance (exit 1
    when an entry is malformed: it is listed with the reason)."""
    listed = list_cases(directory, case)
    if case is not None and not listed:
        raise UsageError(f"--case: no golden case matches {case!r}")
    entries = [e for e in listed if "corrupt" not in e]
    corrupt = [{"name": e["name"], "reason": e["corrupt"]} for e in listed if "corrupt" in e]
    for c in corrupt:
        err.print(plain(f"corrupt: {c['name']}: {c['reason']}"), highlight=False)
    if json_out:
        doc = {
            "schema": schema("golden.list"),
            "ok": not corrupt,
            "golden_dir": str(directory),
            "cases": entries,
            "corrupt": corrupt,
        }
        out.print_json(json.dumps(doc))
        if corrupt:
            raise typer.Exit(EXIT_FAILED)
        return
    table = Table(title=plain(f"golden cases ({directory})"))
    for col in (
        "case",
        "preset",
        "tp",
        "dtype",
        "T",
        "numerics",
        "norm",
        "rotary/D",
        "style",
        "bias",
        "max pos",
        "tolerance q/k",
        "bytes",
    ):
        table.add_column(
            col,
            justify="right" if col in ("tp", "T", "max pos", "bytes") else "left",
            no_wrap=col == "case",
        )
    for e in entries:
        add_plain_row(
            table,
            e["name"],
            e["preset"],
            str(e["tp"]),
            e["dtype"],
            str(e["tokens"]),
            e["numerics"],
            e["norm"] + ("+stats" if e["norm_stats"] else ""),
            f"{e['rotary_dim']}/{e['head_dim']}",
            "neox" if e["is_neox"] else "gptj",
            "yes" if e["bias"] else "-",
            str(e["max_position"]),
            _tolerance(e),
            str(e["bytes"]),
        )
    print_table(table)
    err.print(
        f"{len(entries)} cases, {sum(e['bytes'] for e in entries) / 1e6:.1f} MB"
        + (f", {len(corrupt)} corrupt" if corrupt else ""),
        highlight=False,
        markup=False,
    )
    if corrupt:
        raise typer.Exit(EXIT_FAILED)


def _tolerance(entry: dict) -> str:
    """q's tolerance, or the first output's by name where a case has no q (a paged-cache
    insert, MLA's latent outputs)."""
    tol = entry["tolerance"]
    if "q" in tol:
        return tol["q"]
    name, text = next(iter(tol.items()))
    return f"{name}: {text}"


@golden_app.command(
    "regen", epilog=example("fqr golden regen --dir ./my-goldens --case 'qwen3-8b*'")
)
def golden_regen(
    directory: Annotated[
        Path | None,
        typer.Option(
            "--dir",
            help="directory to write (manifest.json + *.safetensors); default: the checkout's "
            "golden/ in a source checkout, required for an installed fqr (its bundled goldens "
            "are read-only)",
            show_default=False,
        ),
    ] = None,
    case: CaseOption = None,
):
    """Rebuild the case files (all, or those matching --case) and the manifest; deterministic."""
    if directory is None:
        if not is_source_checkout():
            raise UsageError(
                "--dir: name a directory of your own to write (the goldens bundled in the "
                "installed package are read-only): fqr golden regen --dir DIR, then "
                "fqr verify --golden-dir DIR"
            )
        directory = GOLDEN_DIR
    written = regen(directory, case)
    total = sum(e["bytes"] for e in written)
    err.print(
        f"wrote {len(written)} cases ({total / 1e6:.1f} MB) and {directory / 'manifest.json'}",
        highlight=False,
        markup=False,
    )
