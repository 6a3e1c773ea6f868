"""``fqr bench``: time the fused kernel against the copy ceiling and unfused peers, on one GPU.

Everything happens in one process (so one device command yields the whole table)::

    fqr bench --preset qwen3-8b,qwen3-32b --tokens 1,16,128,1024,4096,16384,65536 \\
              --dtype bf16,fp16 --compare eager,compile,liger --json > b.json
    fqr bench --from-json b.json --plot b.png        # later, anywhere (no GPU needed)

The table (stdout) has one row per (preset, dtype, tokens): fqr's median kernel time, its
achieved bandwidth over the minimal traffic, % of the same-run copy ceiling, CUDA-graph replay
time and host dispatch cost (tokens <= 256), and the speed-up over each peer. Progress goes to
stderr. Exit 0 when every implementation passed its numerics check, 1 when one did not (it is
reported, not timed), 2 on bad usage or when there is no GPU. The method is :mod:`fqr.bench`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from fqr.bench import (
    DEFAULT_TOKENS,
    FQR,
    GRAPH_MAX_TOKENS,
    BenchConfig,
    NoGPU,
    load_document,
    merge_documents,
    require_gpu,
    run_bench,
    save_document,
)
from fqr.peers import PEER_NAMES
from fqr.presets import get_preset

from .common import EXIT_FAILED, EXIT_USAGE, UsageError, app, err, out, parse_csv
from .options import ACTIVATION_DTYPES_HELP, parse_dtypes

# The issue-5 target set: Qwen3 0.6B/8B/32B/235B-A22B, Gemma 3 27B, Qwen3.5 27B (all TP1).
DEFAULT_PRESETS = (
    "qwen3-0.6b",
    "qwen3-8b",
    "qwen3-32b",
    "qwen3-235b-a22b",
    "gemma3-27b",
    "qwen3.5-27b",
)
PLOT_MARKERS = {FQR: "o", "eager": "s", "compile": "^", "liger": "D"}


class MissingPlotter(ValueError):
    """matplotlib is not importable, so no plot can be drawn."""


def _parse_presets(values: list[str] | None) -> list:
    names = []
    for v in values or list(DEFAULT_PRESETS):
        names += parse_csv(v, "preset")
    try:
        return [get_preset(n.lower()) for n in dict.fromkeys(names)]
    except ValueError as e:
        raise UsageError(f"--preset: {e}") from None


def _parse_tokens(value: str | None) -> list[int]:
    if value is None:
        return list(DEFAULT_TOKENS)
    tokens = parse_csv(value, "tokens", int)
    bad = [t for t in tokens if t < 1]
    if bad:
        raise UsageError(f"--tokens: token counts must be >= 1, got {bad[0]}")
    return list(dict.fromkeys(tokens))


def _parse_compare(value: str | None) -> list[str]:
    if value is not None and value.strip().lower() == "none":
        return []
    names = parse_csv(value or ",".join(PEER_NAMES), "compare")
    unknown = [n for n in names if n not in PEER_NAMES]
    if unknown:
        raise UsageError(
            f"--compare: unknown peer {unknown[0]!r}; choose from {','.join(PEER_NAMES)} (or none)"
        )
    return list(dict.fromkeys(names))


def _check_backend(name: str) -> None:
    from fqr.backends import get_backend

    if "cuda" not in get_backend(name).device_types:
        raise UsageError(
            f"--backend {name!r} does not run on CUDA tensors; use triton (or "
            "reference: the torch impl rules)"
        )


def _matplotlib_missing() -> str | None:
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        return (
            "matplotlib is not installed here, so no plot (pip install matplotlib, or draw it "
            "later from the saved JSON: fqr bench --from-json FILE --plot FILE.png)"
        )
    return None


# ------------------------------------------------------------------------------ rendering


def _num(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _speedup(row: dict, peer: str) -> str:
    if peer in row["speedup"]:
        return f"{row['speedup'][peer]:.2f}"
    r = row["impls"].get(peer)
    if r is None:
        return "-"
    if r["error"]:
        return "[red]error[/red]"
    if r["check"] and not r["check"]["passed"]:
        return "[red]wrong[/red]"
    return "-"


def render_table(doc: dict) -> Table:
    """The Rich table of a bench document (fqr's numbers; peers as speed-ups)."""
    peers = [p for p in PEER_NAMES if any(p in r["impls"] for r in doc["rows"])]
    launcher = any("launcher_dispatch_us" in r["impls"][FQR] for r in doc["rows"])
    env, ceiling = doc["environment"], doc["ceiling"]
    table = Table(
        title=f"fqr bench: {env.get('gpu', '?')}, copy ceiling {ceiling['gbps']:.0f} GB/s",
        caption=f"numerics {doc['settings'].get('numerics')}, backend "
        f"{doc['settings'].get('backend')}; graph/dispatch for T <= "
        f"{GRAPH_MAX_TOKENS} (dispatch: the public op; launch: the bare "
        "kernel launcher); x peer = peer time / fqr time"
        + ("" if doc.get("complete", True) else "; INCOMPLETE run (cut short)"),
    )
    for name in ("preset", "dtype", "T"):
        table.add_column(name, justify="left" if name != "T" else "right")
    extra = ("launch us",) if launcher else ()
    for name in (
        ("us", "GB/s", "% ceiling", "graph us", "dispatch us")
        + extra
        + tuple(f"x {p}" for p in peers)
    ):
        table.add_column(name, justify="right")
    for row in doc["rows"]:
        r = row["impls"][FQR]
        if r["error"]:
            us = "[red]error[/red]"
        elif r["check"] and not r["check"]["passed"]:
            us = "[red]WRONG[/red]"
        else:
            us = _num(r["us"], ".2f")
        table.add_row(
            row["preset"],
            row["dtype"],
            str(row["tokens"]),
            us,
            _num(r["gbps"], ".0f"),
            _num(r["pct_ceiling"], ".1f"),
            _num(r["graph_us"], ".2f"),
            _num(r["dispatch_us"], ".1f"),
            *([_num(r.get("launcher_dispatch_us"), ".1f")] if launcher else []),
            *[_speedup(row, p) for p in peers],
        )
    return table


def failure_lines(doc: dict) -> list[str]:
    """One line per implementation that failed its check or raised."""
    lines = []
    for row in doc["rows"]:
        for name, r in row["impls"].items():
            where = f"{name} {row['preset']} {row['dtype']} T={row['tokens']}"
            if r["error"]:
                lines.append(f"{where}: {r['error']}")
            elif r["check"] and not r["check"]["passed"]:
                bad = []
                for o in "qkv":
                    c = r["check"].get(o, {})
                    if not c.get("passed", True):
                        bad.append(
                            f"{o}: "
                            + (
                                c["error"]
                                if "error" in c
                                else f"{c['bad']} elements outside {c['tolerance']} "
                                f"(max ulp {c['max_ulp']}, max rel {c['max_rel_head']:.2e}, "
                                f"nonfinite {c['nonfinite_all_rows']})"
                            )
                        )
                lines.append(
                    f"{where} is wrong ({r['check']['numerics']} contract): " + "; ".join(bad)
                )
    return lines


def _tokens_label(t: int) -> str:
    return f"{t // 1024}k" if t >= 1024 and t % 1024 == 0 else str(t)


def timing_notes(doc: dict) -> list[str]:
    """One line per graph/dispatch measurement that could not be taken (the kernel was right)."""
    return [
        f"{name} {row['preset']} {row['dtype']} T={row['tokens']} {key}: {text}"
        for row in doc["rows"]
        for name, r in row["impls"].items()
        for key, text in r.get("timing_errors", {}).items()
    ]


def plot_document(doc: dict, path: Path) -> None:
    """GB/s against tokens (log x), one line per implementation, one panel per (preset, dtype),
    the copy ceiling as a horizontal line."""
    reason = _matplotlib_missing()
    if reason:
        raise MissingPlotter(reason)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = list(dict.fromkeys(r["preset"] for r in doc["rows"]))
    dtypes = list(dict.fromkeys(r["dtype"] for r in doc["rows"]))
    if not presets:
        raise ValueError("--plot: the document has no rows to plot")
    fig, axes = plt.subplots(
        len(presets),
        len(dtypes),
        squeeze=False,
        sharex=True,
        figsize=(5.2 * len(dtypes), 3.4 * len(presets)),
    )
    for i, preset in enumerate(presets):
        for j, dtype in enumerate(dtypes):
            ax = axes[i][j]
            rows = sorted(
                (r for r in doc["rows"] if r["preset"] == preset and r["dtype"] == dtype),
                key=lambda r: r["tokens"],
            )
            names = list(dict.fromkeys(n for r in rows for n in r["impls"]))
            for name in names:
                pts = [
                    (r["tokens"], r["impls"][name]["gbps"])
                    for r in rows
                    if r["impls"].get(name, {}).get("gbps")
                ]
                if pts:
                    ax.plot(*zip(*pts), marker=PLOT_MARKERS.get(name, "."), label=name)
            ceilings = {r.get("ceiling_gbps", doc["ceiling"]["gbps"]) for r in rows}
            for c in sorted(ceilings):
                ax.axhline(
                    c,
                    color="black",
                    linestyle="--",
                    linewidth=1,
                    label=f"copy ceiling {c:.0f} GB/s",
                )
            ax.set_xscale("log", base=2)
            ticks = [r["tokens"] for r in rows]
            ax.set_xticks(ticks, [_tokens_label(t) for t in ticks], fontsize=7)
            ax.set_title(f"{preset} {dtype}")
            ax.set_xlabel("tokens")
            ax.set_ylabel("GB/s (minimal traffic)")
            ax.set_ylim(bottom=0)
            ax.grid(True, which="major", alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(f"fqr bench on {doc['environment'].get('gpu', '?')}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -------------------------------------------------------------------------------- command


@app.command()
def bench(
    preset: list[str] = typer.Option(
        None,
        "--preset",
        "-p",
        help=f"preset name(s); repeatable or comma list (default: {','.join(DEFAULT_PRESETS)})",
    ),
    tokens: str = typer.Option(
        None,
        "--tokens",
        "-t",
        help=f"token counts, comma list (default: {','.join(map(str, DEFAULT_TOKENS))})",
    ),
    dtype: str = typer.Option(
        None, "--dtype", help=f"{ACTIVATION_DTYPES_HELP}, comma list (default: bf16)"
    ),
    compare: str = typer.Option(
        None,
        "--compare",
        help="peers: eager,compile,liger or none (default: all three; liger only where installed)",
    ),
    backend: str = typer.Option("triton", "--backend", help="fqr backend that runs the kernel"),
    numerics: str = typer.Option("fused", "--numerics", help="fused or unfused contract for fqr"),
    check_rows: int = typer.Option(
        1024, "--check-rows", help="rows checked against float64 before timing (0 = all)"
    ),
    rep_ms: float = typer.Option(50.0, "--rep-ms", help="do_bench repetition time per timing (ms)"),
    warmup_ms: float = typer.Option(10.0, "--warmup-ms", help="do_bench warm-up time (ms)"),
    seed: int = typer.Option(0, "--seed", help="seed of the random inputs"),
    json_out: bool = typer.Option(
        False, "--json", help="print one JSON document instead of the table"
    ),
    save: Path = typer.Option(
        None,
        "--save",
        help="also write the JSON document here, rewritten "
        "after every cell (a run cut short keeps its rows)",
    ),
    plot: Path = typer.Option(None, "--plot", help="write a GB/s-vs-tokens PNG here (matplotlib)"),
    from_json: list[Path] = typer.Option(
        None,
        "--from-json",
        help="render saved --json output (repeatable: runs are merged) instead of measuring",
    ),
):
    """Benchmark the fused kernel: copy ceiling, GB/s, graph replay, dispatch, speed-up."""
    if from_json:
        given = [
            n
            for n, v in (
                ("--preset", preset),
                ("--tokens", tokens),
                ("--dtype", dtype),
                ("--compare", compare),
            )
            if v
        ]
        if save:
            given.append("--save")
        if given:
            raise UsageError(f"--from-json renders saved results; it takes no {given[0]}")
        doc = merge_documents([load_document(p) for p in from_json])
    else:
        _check_backend(backend)
        cfg = BenchConfig(
            presets=_parse_presets(preset),
            tokens=_parse_tokens(tokens),
            dtypes=parse_dtypes(dtype or "bf16"),
            compare=_parse_compare(compare),
            backend=backend,
            numerics=numerics,
            check_rows=check_rows,
            warmup_ms=warmup_ms,
            rep_ms=rep_ms,
            seed=seed,
        )
        if save and not save.parent.is_dir():
            raise UsageError(f"--save: no such directory {save.parent}")
        try:
            require_gpu()
        except NoGPU as e:
            err.print(f"[red]error:[/red] {escape(str(e))}", highlight=False)
            raise typer.Exit(EXIT_USAGE) from None
        if plot and _matplotlib_missing():
            err.print(f"[yellow]note:[/yellow] {escape(_matplotlib_missing())}", highlight=False)
        doc = _measure(cfg, save)
        for reason in sorted(set(doc["skipped"].values())):
            peers = sorted({k.split("/")[0] for k, v in doc["skipped"].items() if v == reason})
            err.print(
                f"[yellow]skipped[/yellow] {','.join(peers)}: {escape(reason)}", highlight=False
            )

    if json_out:
        sys.stdout.write(json.dumps(doc, indent=1) + "\n")
    else:
        table = render_table(doc)
        # Never squeeze the table into a pipe's default 80 columns: its cells are data.
        width = Measurement.get(out, out.options.update(max_width=1000), table).maximum
        Console(file=out.file, width=max(out.width, width)).print(table)
    for line in timing_notes(doc):
        err.print(f"[yellow]not measured:[/yellow] {escape(line)}", highlight=False)
    for line in failure_lines(doc):
        err.print(f"[red]check failed:[/red] {escape(line)}", highlight=False)
    if plot:
        try:
            plot_document(doc, plot)
            err.print(f"plot written to {escape(str(plot))}", highlight=False)
        except MissingPlotter as e:
            if from_json:
                raise
            err.print(f"[yellow]no plot:[/yellow] {escape(str(e))}", highlight=False)
    if not doc["passed"]:
        raise typer.Exit(EXIT_FAILED)


def _measure(cfg: BenchConfig, save: Path | None) -> dict:
    columns = (
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    checkpoint = (lambda doc: save_document(doc, save)) if save else (lambda doc: None)
    with Progress(*columns, console=err, transient=True) as progress:
        task = progress.add_task("starting", total=cfg.cells + 1)
        doc = run_bench(
            cfg,
            progress=lambda text: progress.update(task, description=escape(text)),
            advance=lambda: progress.advance(task),
            on_row=checkpoint,
        )
    if save:
        save_document(doc, save)
        err.print(f"saved to {escape(str(save))}", highlight=False)
    return doc
