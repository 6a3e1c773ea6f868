"""``fqr bench``: time the fused kernel against the copy ceiling and unfused peers, on one GPU.

Everything happens in one process (so one device command yields the whole table)::

    fqr bench --preset qwen3-8b,qwen3-32b --tokens 1,16,128,1024,4096,16384,65536 \\
              --dtype bf16,fp16 --compare eager,compile,liger --json > b.json
    fqr bench --from-json b.json --plot b.png        # later, anywhere (no GPU needed)

The table (stdout) has one row per (preset, dtype, tokens): fqr's median kernel time, its
achieved bandwidth over the minimal traffic, % of the same-run copy ceiling, device time
(CUDA-graph replays over rotating inputs) and wall time with host dispatch, each with its own %
of the ceiling, host dispatch cost (tokens <= 256), and the speed-up over each peer; then the
floors table (the fastest same-size copy, the projection GEMM alone and followed by fqr; with
``--pdl`` also followed by fqr's kernel launched with programmatic dependent launch) and the
dispatch table (host µs per call at T = 1, 16, 1024 of the public op, ``torch.ops.fqr``,
``F.rms_norm`` and a bare Triton launch). ``--copy-probe`` instead times same-size copies
(``copy_`` eager and in a graph, int32 and bf16, the SM copy kernel) to tell why ``copy_``
swings (:mod:`fqr.bench.copy_probe`). Progress goes to stderr. Exit 0 when every
implementation passed its numerics check, 1 when one did not (it is reported, not timed), 2 on
bad usage or when there is no GPU. The method is :mod:`fqr.bench`.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from fqr.bench import (
    DEFAULT_PRESETS,
    DEFAULT_TOKENS,
    BenchConfig,
    NoGPU,
    load_document,
    merge_documents,
    require_gpu,
    run_bench,
    save_document,
)
from fqr.bench.report import (
    FAILED_CELLS,
    MissingPlotter,
    dispatch_table,
    failure_lines,
    floors_table,
    matplotlib_missing,
    plot_document,
    results_table,
    timing_notes,
)
from fqr.core import ACTIVATION_DTYPE_NAMES
from fqr.files import check_destination, write_file
from fqr.peers import PEER_NAMES
from fqr.presets import PRESETS, get_preset
from fqr.text import printable

from .common import EXIT_FAILED, EXIT_USAGE, UsageError, app, err, example, parse_csv, schema
from .options import (
    ACTIVATION_DTYPES_HELP,
    BackendName,
    JsonOption,
    Numerics,
    NumericsOption,
    comma_list,
    parse_dtypes,
)
from .render import print_table, progress_bar, rich_table


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


@app.command(
    epilog=example(
        "fqr bench --preset qwen3-8b --tokens 1,16,4096,65536 --compare eager,compile --json"
        " > b.json",
        "fqr bench --from-json docs/results/bench-h200-16bit.json --plot bench.png",
    )
)
def bench(
    ctx: typer.Context,
    preset: Annotated[
        list[str] | None,
        comma_list(
            "--preset",
            "-p",
            help=f"preset name(s); repeatable or comma list (default: {','.join(DEFAULT_PRESETS)})",
            choices=lambda: PRESETS,
        ),
    ] = None,
    tokens: Annotated[
        str | None,
        comma_list(
            "--tokens",
            "-t",
            help=f"token counts, comma list (default: {','.join(map(str, DEFAULT_TOKENS))})",
        ),
    ] = None,
    dtype: Annotated[
        str | None,
        comma_list(
            help=f"{ACTIVATION_DTYPES_HELP}, comma list (default: bf16)",
            choices=lambda: ACTIVATION_DTYPE_NAMES,
        ),
    ] = None,
    compare: Annotated[
        str | None,
        comma_list(
            help=f"peers: {','.join(PEER_NAMES)} or none (default: all; liger only where "
            "installed)",
            choices=lambda: (*PEER_NAMES, "none"),
        ),
    ] = None,
    backend: Annotated[
        BackendName, typer.Option(help="fqr backend that runs the kernel")
    ] = BackendName.triton,
    numerics: NumericsOption = Numerics.fused,
    pdl: Annotated[
        bool,
        typer.Option(
            "--pdl",
            help="also time, after the projection GEMM, fqr's kernel launched with "
            "programmatic dependent launch (floors table; triton backend)",
        ),
    ] = False,
    cold_start: Annotated[
        bool,
        typer.Option(
            "--cold-start",
            help="instead of the table: per preset, fresh processes to their first result, "
            "JIT against a kernel bundle (--bundle, else one built first), medians of 3",
        ),
    ] = False,
    bundle: Annotated[
        Path | None, typer.Option(help="the kernel bundle --cold-start loads (fqr build)")
    ] = None,
    copy_probe: Annotated[
        bool,
        typer.Option(
            "--copy-probe",
            help="instead of the table: why a same-size copy_ runs at different speeds; per "
            "size (each preset's bench cell, its bf16 qkv, the cell rounded to 2 MiB) copy_ "
            "eager and graph-replayed, int32 and bf16, and the SM copy kernel (default "
            "presets qwen3-8b,llama4-scout,llama3-8b-qk-rope, tokens 65536)",
        ),
    ] = False,
    projection: Annotated[
        bool,
        typer.Option(
            "--projection",
            help="instead of the table: the QKV projection and its prologue, per preset, --tp "
            "and token count: cuBLAS GEMM alone, GEMM + fqr's op, fqr's projected op (one "
            "kernel, per --schedules entry) and the copy of the weights' bytes, each checked "
            "against float64 before it is timed",
        ),
    ] = False,
    tp: Annotated[
        str | None, comma_list("--tp", help="--projection: tensor-parallel sizes (default 1,8)")
    ] = None,
    schedules: Annotated[
        str | None,
        typer.Option(
            help="--projection: a JSON object of schedule name -> lowering options of the "
            "projected kernel, each with its min_tokens / max_tokens and k_range (default: "
            "fqr.bench.projection.SCHEDULES)",
        ),
    ] = None,
    write_dispatch: Annotated[
        Path | None,
        typer.Option(
            help="--projection: also write the projection dispatch table (fqr.projection) "
            "here: per shape and token bucket the fused kernel or GEMM + op, whichever this run "
            "measured faster (the shipped table's entries for shapes not measured are kept)",
        ),
    ] = None,
    check_rows: Annotated[
        int, typer.Option(help="rows checked against float64 before timing (0 = all)")
    ] = 1024,
    rep_ms: Annotated[float, typer.Option(help="do_bench repetition time per timing (ms)")] = 50.0,
    warmup_ms: Annotated[float, typer.Option(help="do_bench warm-up time (ms)")] = 10.0,
    seed: Annotated[int, typer.Option(help="seed of the random inputs")] = 0,
    json_out: JsonOption = False,
    save: Annotated[
        Path | None,
        typer.Option(
            help="also write the JSON document here, rewritten after every cell (a run cut "
            "short keeps its rows)",
        ),
    ] = None,
    plot: Annotated[
        Path | None,
        typer.Option(help="write a PNG here: % of the copy ceiling vs tokens, small-T latency"),
    ] = None,
    from_json: Annotated[
        list[Path] | None,
        typer.Option(
            help="render saved --json output (repeatable: runs are merged) instead of measuring",
        ),
    ] = None,
):
    """Benchmark the fused kernel: copy ceiling, GB/s, graph replay, dispatch, speed-up."""
    if bundle is not None and not cold_start:
        raise UsageError("--bundle is the kernel bundle of --cold-start")
    mode = "copy_probe" if copy_probe else "cold_start" if cold_start else "from_json"
    if projection:
        mode = "projection"
    elif not (copy_probe or cold_start or from_json):
        mode = "table"
    refused = [flag for name, flag in _given(ctx) if name not in MODE_TAKES[mode]]
    if refused:
        raise UsageError(f"{MODE_WORDS[mode]}; it takes no {refused[0]}")
    if mode in ("copy_probe", "table", "projection"):
        _check_ms("--rep-ms", rep_ms)
        _check_ms("--warmup-ms", warmup_ms)
    if projection:
        _projection(
            preset, tokens, dtype, tp, schedules, rep_ms, warmup_ms, seed, json_out, write_dispatch
        )
        return
    if copy_probe:
        _copy_probe(preset, tokens, rep_ms, warmup_ms, json_out, save)
        return
    if cold_start:
        _cold_start(preset, tokens, bundle, json_out)
        return
    if from_json:
        _check_outputs(plot=plot)
        doc = merge_documents([load_document(p) for p in from_json])
    else:
        doc = _measure(
            _config(
                preset,
                tokens,
                dtype,
                compare,
                backend.value,
                numerics.value,
                check_rows,
                rep_ms,
                warmup_ms,
                seed,
                pdl,
            ),
            save,
            plot,
        )
    _report(doc, json_out, plot, from_json=bool(from_json))


def _cold_start(preset, tokens, bundle: Path | None, json_out: bool) -> None:
    """``--cold-start``: one row per preset (TP 1, bf16, the first of --tokens, default 1)."""
    import tempfile

    from fqr.bench.cold_start import measure_cold_start
    from fqr.tools.kernel_bundle import build_bundle

    presets = _parse_presets(preset or ["qwen3-8b"])
    count = _parse_tokens(tokens)[0] if tokens else 1
    try:
        require_gpu()
    except NoGPU as e:
        err.print(f"[red]error:[/red] {escape(str(e))}", highlight=False)
        raise typer.Exit(EXIT_USAGE) from None
    if bundle is not None and not bundle.is_dir():
        raise UsageError(f"--bundle {bundle}: not a directory (build one with fqr build)")
    rows = []
    with tempfile.TemporaryDirectory(prefix="fqr-cold-bundle-") as scratch:
        for p in presets:
            directory = bundle
            if directory is None:
                directory = Path(scratch, p.name)
                err.print(f"building a kernel bundle for {p.name} ...", highlight=False)
                build_bundle(directory, [(p.name, 1)])
            err.print(f"cold start of {p.name}: fresh processes, JIT and bundle", highlight=False)
            rows.append(measure_cold_start(p.name, str(directory), tokens=count))
    if json_out:
        doc = {"schema": schema("bench.cold-start"), "ok": True, "rows": rows}
        sys.stdout.write(json.dumps(doc, indent=1) + "\n")
        return
    from fqr.bench.cold_start import cold_start_table

    table = cold_start_table(rows)
    print_table(table)


def _projection(
    preset, tokens, dtype, tp, schedules, rep_ms, warmup_ms, seed, json_out, write_dispatch
):
    """``--projection``: one row per (preset, TP, T, dtype) (:mod:`fqr.bench.projection`);
    ``write_dispatch``: the dispatch table from those rows written there."""
    import torch

    from fqr.bench.projection import PRESETS as PROJECTION_PRESETS
    from fqr.bench.projection import SCHEDULES, projection_cell
    from fqr.bench.projection import table as projection_table
    from fqr.bench.timers import CudaTimers

    presets = _parse_presets(preset or list(PROJECTION_PRESETS))
    counts = _parse_tokens(tokens or "1,2,16,1024,16384")
    sizes = parse_csv(tp or "1,8", "tp", int)
    if any(t < 1 for t in sizes):
        raise UsageError(f"--tp: tensor-parallel sizes must be >= 1, got {sizes}")
    try:
        named = json.loads(schedules) if schedules else dict(SCHEDULES)
    except json.JSONDecodeError as e:
        raise UsageError(f"--schedules: not JSON ({e.msg})") from None
    if not isinstance(named, dict) or not all(isinstance(v, dict) for v in named.values()):
        raise UsageError("--schedules must be a JSON object of name -> lowering options")
    if write_dispatch is not None:
        if "default" not in named:
            raise UsageError(
                "--write-dispatch needs the 'default' schedule in --schedules (the public op: "
                "what the dispatch runs)"
            )
        if not write_dispatch.parent.is_dir():
            raise UsageError(f"--write-dispatch: no such directory {write_dispatch.parent}")
        _check_outputs(write_dispatch=write_dispatch)
    dtypes = parse_dtypes(dtype) if dtype else [torch.bfloat16]
    for p in presets:
        for t in sizes:
            try:
                get_preset(p.name, t)
            except ValueError as e:
                raise UsageError(f"--tp: {e}") from None
    try:
        require_gpu()
    except NoGPU as e:
        err.print(f"[red]error:[/red] {escape(str(e))}", highlight=False)
        raise typer.Exit(EXIT_USAGE) from None
    timers = CudaTimers()
    rows = []
    for p in presets:
        for t in sizes:
            for d in dtypes:
                for count in counts:
                    row = projection_cell(p.name, t, count, d, named, timers, rep_ms, seed)
                    rows.append(row)
                    fused = " ".join(
                        f"{n}={'-' if v is None else f'{v:.2f}'}"
                        for n, v in row["fused_us"].items()
                    )
                    err.print(
                        f"{p.name} TP{t} T={count}: GEMM {row['gemm_us']:.2f} GEMM+op "
                        f"{row['pair_us']:.2f} fused {fused} us",
                        highlight=False,
                    )
    ok = all(c["passed"] for r in rows for c in r["checks"].values())
    if write_dispatch is not None:
        _write_dispatch(write_dispatch, rows, counts)
    if json_out:
        doc = {"schema": schema("bench.projection"), "ok": ok, "rows": rows}
        sys.stdout.write(json.dumps(doc, indent=1) + "\n")
    else:
        from rich.table import Table

        columns, cells = projection_table(rows)
        table = Table(title="QKV projection + prologue (device us, CUDA-graph replay)")
        for column in columns:
            table.add_column(column, justify="left" if column == "preset" else "right")
        for row in cells:
            table.add_row(*row)
        print_table(table)
    if not ok:
        raise typer.Exit(EXIT_FAILED)


def _write_dispatch(path: Path, rows: list[dict], counts: list[int]) -> None:
    """The projection dispatch table from ``--projection``'s rows (:mod:`fqr.projection`),
    the shipped table's entries for keys not measured kept (none, with one warning line, where
    the shipped table cannot be read), written to ``path``."""
    import datetime

    import torch

    from fqr import __version__, projection
    from fqr.bench.projection import dispatch_table

    device = projection.device_name(torch.device("cuda", torch.cuda.current_device()))
    presets = sorted({f"{r['preset']} TP{r['tp']}" for r in rows})
    source = (
        f"fqr bench --projection --write-dispatch on {device}, fqr {__version__}, "
        f"{datetime.date.today().isoformat()}: {', '.join(presets)} at T = "
        f"{', '.join(map(str, counts))} (device us of CUDA-graph replays; fused = the public "
        "op's own schedule, 'default')"
    )
    try:
        kept = projection.load_table()
    except projection.DispatchTableError as e:
        # a shipped table of another bucket layout (an older fqr's): nothing of it can be kept
        err.print(
            f"warning: {escape(str(e))}: the new table holds the measured entries only",
            highlight=False,
        )
        kept = {}
    doc = dispatch_table(rows, device, source=source, kept=kept)
    write_file(path, projection.table_text(doc))
    fused = sum(c == "fused" for e in doc["entries"] for c in e["choice"])
    err.print(
        f"dispatch table written to {escape(str(path))}: {len(doc['entries'])} entries, "
        f"{fused} bucket(s) pick the fused kernel",
        highlight=False,
    )


# What each mode of ``fqr bench`` takes (parameter names; the JSON switch in all of them): any
# other option given on the command line is refused, naming it, so that nothing the user asked
# for is silently ignored.
MODE_TAKES = {
    "table": {
        "preset", "tokens", "dtype", "compare", "backend", "numerics", "pdl", "check_rows",
        "rep_ms", "warmup_ms", "seed", "json_out", "save", "plot",
    },
    "from_json": {"from_json", "json_out", "plot"},
    "cold_start": {"cold_start", "preset", "tokens", "bundle", "json_out"},
    "copy_probe": {"copy_probe", "preset", "tokens", "rep_ms", "warmup_ms", "json_out", "save"},
    "projection": {
        "projection", "preset", "tokens", "dtype", "tp", "schedules", "rep_ms", "warmup_ms",
        "seed", "json_out", "write_dispatch",
    },
}  # fmt: skip
MODE_WORDS = {
    "table": "the bench table measures",
    "from_json": "--from-json renders saved results",
    "cold_start": "--cold-start measures",
    "copy_probe": "--copy-probe measures copies",
    "projection": "--projection measures the projection and its prologue",
}


def _given(ctx: typer.Context) -> list[tuple[str, str]]:
    """The options given on the command line (a default given explicitly too), as (parameter
    name, long flag), in the command's order."""
    given = []
    for param in ctx.command.params:
        source = ctx.get_parameter_source(param.name) if param.name else None
        if source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP"):
            given.append((param.name, max(param.opts, key=len) if param.opts else param.name))
    return given


def _check_ms(option: str, value: float) -> None:
    """A timing budget: a finite number of milliseconds > 0 (``nan``, ``inf``, 0 and negative
    values refused, naming ``option``)."""
    if not (math.isfinite(value) and value > 0):
        raise UsageError(f"{option} must be a finite number of milliseconds > 0, got {value}")


def _copy_probe(
    preset, tokens, rep_ms: float, warmup_ms: float, json_out: bool, save: Path | None
) -> None:
    """``--copy-probe``: :mod:`fqr.bench.copy_probe` on this GPU, as tables or JSON (and the
    JSON also to ``save``)."""
    import torch

    from fqr.bench import CudaTimers, environment
    from fqr.bench.copy_probe import PROBE_PRESETS, PROBE_TOKENS, probe_copies, probe_sizes
    from fqr.bench.report import copy_probe_tables

    presets = _parse_presets(preset or list(PROBE_PRESETS))
    counts = _parse_tokens(tokens) if tokens else list(PROBE_TOKENS)
    if save and not save.parent.is_dir():
        raise UsageError(f"--save: no such directory {save.parent}")
    _check_outputs(save=save)
    try:
        require_gpu()
    except NoGPU as e:
        err.print(f"[red]error:[/red] {escape(str(e))}", highlight=False)
        raise typer.Exit(EXIT_USAGE) from None
    device = torch.device("cuda")
    sizes = probe_sizes(presets, counts, device)
    with progress_bar() as progress:
        task = progress.add_task("copy probe", total=len(sizes))

        started = []

        def step(text: str) -> None:  # called as each size starts: the one before is done
            if started:
                progress.advance(task)
            started.append(text)
            progress.update(task, description=escape(text))

        rows = probe_copies(sizes, CudaTimers(), device, rep_ms, warmup_ms, progress=step)
    doc = {
        "schema": schema("bench.copy-probe"),
        "ok": True,
        "environment": environment(device),
        "settings": {
            "presets": [p.name for p in presets],
            "tokens": counts,
            "rep_ms": rep_ms,
            "warmup_ms": warmup_ms,
        },  # fmt: skip
        "rows": rows,
    }
    text = json.dumps(doc, indent=1) + "\n"
    if save:
        write_file(save, text)
        err.print(f"saved to {escape(str(save))}", highlight=False)
    if json_out:
        sys.stdout.write(text)
        return
    for table in copy_probe_tables(doc):
        print_table(rich_table(table, FAILED_CELLS))


def _config(
    preset, tokens, dtype, compare, backend, numerics, check_rows, rep_ms, warmup_ms, seed, pdl
) -> BenchConfig:
    _check_backend(backend)
    if pdl and backend != "triton":
        raise UsageError(f"--pdl: programmatic dependent launch runs on triton, not {backend!r}")
    return BenchConfig(
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
        pdl=pdl,
    )


def _check_outputs(**paths: Path | None) -> None:
    """Refuse, before any work, an output path the bench would not write (a symlink, a
    directory: :func:`fqr.files.write_file`), naming its option."""
    for option, path in paths.items():
        if path is not None:
            try:
                check_destination(path)
            except OSError as e:
                raise UsageError(f"--{option} {path}: {e.strerror}") from None


def _measure(cfg: BenchConfig, save: Path | None, plot: Path | None) -> dict:
    """Run the bench (after the no-GPU check), saving the document as it grows."""
    if save and not save.parent.is_dir():
        raise UsageError(f"--save: no such directory {save.parent}")
    _check_outputs(save=save, plot=plot)
    try:
        require_gpu()
    except NoGPU as e:
        err.print(f"[red]error:[/red] {escape(str(e))}", highlight=False)
        raise typer.Exit(EXIT_USAGE) from None
    if plot and matplotlib_missing():
        err.print(f"[yellow]note:[/yellow] {escape(matplotlib_missing())}", highlight=False)
    checkpoint = (lambda doc: save_document(doc, save)) if save else (lambda doc: None)
    with progress_bar() as progress:
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
    for reason in sorted(set(doc["skipped"].values())):
        peers = sorted({k.split("/")[0] for k, v in doc["skipped"].items() if v == reason})
        err.print(f"[yellow]skipped[/yellow] {','.join(peers)}: {escape(reason)}", highlight=False)
    return doc


def _report(doc: dict, json_out: bool, plot: Path | None, from_json: bool) -> None:
    """The table (or JSON) on stdout, notes and failures on stderr, the plot; exit 1 when an
    implementation failed its check."""
    if json_out:
        sys.stdout.write(json.dumps(doc, indent=1) + "\n")
    else:
        print_table(rich_table(results_table(doc), FAILED_CELLS))
        for extra in (floors_table(doc), dispatch_table(doc)):
            if extra is not None:
                print_table(rich_table(extra, FAILED_CELLS))
    # the lines quote the document (a saved one may hold any text): shown as written
    for line in timing_notes(doc):
        err.print(f"[yellow]not measured:[/yellow] {escape(printable(line))}", highlight=False)
    for line in failure_lines(doc):
        err.print(f"[red]check failed:[/red] {escape(printable(line))}", highlight=False)
    if plot:
        try:
            plot_document(doc, plot)
            err.print(f"plot written to {escape(str(plot))}", highlight=False)
        except MissingPlotter as e:
            if from_json:
                raise
            err.print(f"[yellow]no plot:[/yellow] {escape(str(e))}", highlight=False)
    if not doc["ok"]:
        raise typer.Exit(EXIT_FAILED)
