"""Reading a result document: the results table, the lines for what failed or was not
measured, and the GB/s plot. Plain data out (the CLI renders it with Rich); a further table
(device vs wall time, dispatch) is one more function here that returns a :class:`ReportTable`.
"""

from __future__ import annotations

import importlib.util
import io
from dataclasses import dataclass
from pathlib import Path

from ..files import write_file
from ..peers import PEER_NAMES
from ..presets import DEFAULT_PRESET
from ..text import printable
from .floors import COPY_, not_a_floor
from .measurements import GRAPH_MAX_TOKENS, MEASUREMENTS
from .run import FQR

FAILED_CELLS = ("error", "WRONG", "wrong")  # cell texts that mark a failure (the CLI colours them)
PLOT_MARKERS = {FQR: "o", "eager": "s", "compile": "^", "liger": "D"}


@dataclass(frozen=True)
class ReportTable:
    title: str
    caption: str
    columns: list[tuple[str, str]]  # (header, "left" | "right")
    rows: list[list[str]]


def _num(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _status(result: dict | None) -> str | None:
    """``error`` / ``wrong`` when an implementation failed, else None."""
    if result is None:
        return None
    if result["error"]:
        return "error"
    if result["check"] and not result["check"]["passed"]:
        return "wrong"
    return None


def _speedup(row: dict, peer: str) -> str:
    if peer in row["speedup"]:
        return f"{row['speedup'][peer]:.2f}"
    return _status(row["impls"].get(peer)) or "-"


def results_table(doc: dict) -> ReportTable:
    """fqr's figures per cell (one column per measurement that has a value, GB/s and % of the
    copy ceiling beside the primary one), the peers as speed-ups."""
    peers = [p for p in PEER_NAMES if any(p in r["impls"] for r in doc["rows"])]
    measured = [
        m
        for m in MEASUREMENTS
        if m.primary or any(r["impls"][FQR].get(m.key) is not None for r in doc["rows"])
    ]
    columns = [("preset", "left"), ("dtype", "left"), ("T", "right")]
    for m in measured:
        columns.append((m.column, "right"))
        if m.primary:
            columns += [("GB/s", "right"), ("% ceiling", "right")]
        elif m.pct_key:
            columns.append((f"{m.column.split()[0]} %", "right"))
    columns += [(f"x {p}", "right") for p in peers]
    rows = []
    for row in doc["rows"]:
        r = row["impls"][FQR]
        cells = [row["preset"], row["dtype"], str(row["tokens"])]
        for m in measured:
            if m.primary:
                failed = _status(r)
                cells.append(
                    failed.upper() if failed == "wrong" else failed or _num(r.get(m.key), m.fmt)
                )
                cells += [_num(r.get("gbps"), ".0f"), _num(r.get("pct_ceiling"), ".1f")]
            else:
                cells.append(_num(r.get(m.key), m.fmt))
                if m.pct_key:
                    cells.append(_num(r.get(m.pct_key), ".1f"))
        cells += [_speedup(row, p) for p in peers]
        rows.append(cells)
    env, ceiling = doc["environment"], doc["ceiling"]
    caption = (
        f"numerics {doc['settings'].get('numerics')}, backend {doc['settings'].get('backend')}; "
        "us: do_bench, L2 flushed; device: CUDA-graph replays over rotating inputs; wall: "
        f"back-to-back calls with host dispatch; dispatch/launch for T <= {GRAPH_MAX_TOKENS} "
        "(dispatch: the public op; launch: the bare kernel launcher); x peer = peer time / "
        "fqr time" + ("" if doc.get("complete", True) else "; INCOMPLETE run (cut short)")
    )
    by = f" ({printable(ceiling['by'])})" if ceiling.get("by") else ""
    return ReportTable(
        f"fqr bench: {env.get('gpu', '?')}, copy ceiling {ceiling['gbps']:.0f} GB/s{by}",
        caption,
        columns,
        rows,
    )


def dispatch_table(doc: dict) -> ReportTable | None:
    """Host µs per call of the public op, the custom op, ``F.rms_norm`` and a bare Triton
    launch (``doc["dispatch"]``), each with its ratio to ``F.rms_norm``; None without rows."""
    entries = doc.get("dispatch") or []
    if not entries:
        return None
    names = list(entries[0]["host_us"])
    columns = [("preset", "left"), ("dtype", "left"), ("T", "right")]
    for name in names:
        columns += [(f"{name} us", "right"), ("x aten", "right")]
    rows = []
    for e in entries:
        cells = [e["preset"], e["dtype"], str(e["tokens"])]
        for name in names:
            cells += [_num(e["host_us"].get(name), ".1f"), _num(e["x_rms_norm"].get(name), ".2f")]
        rows.append(cells)
    return ReportTable(
        "dispatch: host us per call without graphs (inference mode)",
        "x aten = time / F.rms_norm's on the same qkv; triton launch: the generated kernel "
        "through Triton's JITFunction launch path",
        columns,
        rows,
    )


def floors_table(doc: dict) -> ReportTable | None:
    """Per cell, fqr's device time beside its floors (:mod:`fqr.bench.floors`): the same-size
    copy and fqr as % of it, the projection GEMM alone, GEMM then fqr, and what fqr costs
    after the GEMM (also as a multiple of its time alone), and with ``--pdl`` what its
    kernel costs there launched with programmatic dependent launch; None without floors. The
    copy is the fastest candidate (named where the document says which); a copy slower than
    fqr is no floor (``-``, and a note: :func:`timing_notes`)."""
    rows = [r for r in doc["rows"] if r.get("floors")]
    if not rows:
        return None
    pdl = any("gemm_op_pdl_us" in r["floors"] for r in rows)
    named = any("copy_candidates" in r["floors"] for r in rows)
    columns = [("preset", "left"), ("dtype", "left"), ("T", "right")]
    columns += [
        (h, "right")
        for h in (
            "copy us",
            *(("fastest copy",) if named else ()),
            "device us",
            "% copy",
            "GEMM us",
            "GEMM+fqr us",
            "after GEMM us",
            "x alone",
            *(("after GEMM us, PDL",) if pdl else ()),
        )
    ]
    table = []
    for row in rows:
        f, r = _as_floor(row["floors"], row["impls"][FQR]), row["impls"][FQR]
        table.append(
            [row["preset"], row["dtype"], str(row["tokens"])]
            + [
                _num(f.get("copy_us"), ".2f"),
                *((_copy_by(f),) if named else ()),
                _num(r.get("graph_us"), ".2f"),
                _num(r.get("pct_copy") if f.get("copy_us") is not None else None, ".1f"),
                _num(f.get("gemm_us"), ".2f"),
                _num(f.get("gemm_op_us"), ".2f"),
                _num(r.get("after_gemm_us"), ".2f"),
                _num(r.get("after_gemm_x"), ".2f"),
                *((_num(r.get("after_gemm_pdl_us"), ".2f"),) if pdl else ()),
            ]
        )
    empty = (doc.get("floors") or {}).get("empty_kernel_us")
    return ReportTable(
        "floors: device us, CUDA-graph replays over rotating buffers, same run",
        "copy: the fastest device-to-device copy of exactly the call's bytes ("
        + (
            "copy_ or the SM copy kernel; - where slower than fqr: not a floor"
            if named
            else "copy_"
        )
        + "); % copy = copy / fqr; GEMM: "
        "the projection whose output the op reads ([T, hidden] @ [hidden, width]); after GEMM "
        "= (GEMM+fqr) - GEMM, x alone = that / fqr's device time"
        + ("; PDL: fqr's kernel launched with programmatic dependent launch" if pdl else "")
        + ("" if empty is None else f"; an empty Triton kernel: {empty:.2f} us"),
        columns,
        table,
    )


def failure_lines(doc: dict) -> list[str]:
    """One line per implementation that failed its check or raised."""
    lines = []
    for row in doc["rows"]:
        for name, r in row["impls"].items():
            where = f"{name} {row['preset']} {row['dtype']} T={row['tokens']}"
            if r["error"]:
                lines.append(f"{where}: {r['error']}")
            elif r["check"] and not r["check"]["passed"]:
                bad = [r["check"]["error"]] if r["check"].get("error") else []
                outputs = [o for o, c in r["check"].items() if isinstance(c, dict)]
                for o in outputs:  # q, k, v and any other output of a variant
                    c = r["check"][o]
                    if c.get("passed", True):
                        continue
                    detail = c.get("error") or (
                        f"{c['bad']} elements outside {c['tolerance']} (max ulp "
                        f"{c['max_ulp']}, max rel {c['max_rel_head']:.2e}, nonfinite "
                        f"{c['nonfinite_all_rows']})"
                    )
                    bad.append(f"{o}: {detail}")
                numerics = r["check"].get("numerics", "?")
                lines.append(f"{where} is wrong ({numerics} contract): " + "; ".join(bad))
    return lines


def _refused(floors: dict, result: dict) -> str | None:
    """Why a row's recorded copy is no floor of fqr's device time (a document written before
    the bench refused such floors), or None."""
    copy, device = floors.get("copy_us"), result.get("graph_us")
    if copy is None or not device:
        return None
    return not_a_floor(copy, floors.get("copy_by") or COPY_, device)


def _as_floor(floors: dict, result: dict) -> dict:
    """``floors`` as the table shows them: a copy slower than fqr left out."""
    return dict(floors, copy_us=None, copy_by=None) if _refused(floors, result) else floors


def _copy_by(floors: dict) -> str:
    """The fastest copy's name where it is the floor; ``-`` otherwise."""
    return printable(floors["copy_by"]) if floors.get("copy_by") else "-"


def timing_notes(doc: dict) -> list[str]:
    """One line per measurement that could not be taken (the kernel was right), per floor
    that could not be (or is no floor: slower than fqr), and per copy the ceiling could not
    time."""
    lines = [
        f"{name} {row['preset']} {row['dtype']} T={row['tokens']} {key}: {text}"
        for row in doc["rows"]
        for name, r in row["impls"].items()
        for key, text in r.get("timing_errors", {}).items()
    ]
    for row in doc["rows"]:
        floors = row.get("floors") or {}
        errors = dict(floors.get("errors") or {})
        refused = _refused(floors, row["impls"][FQR])
        if refused:
            errors.setdefault("copy_us", refused)
        where = f"floors {row['preset']} {row['dtype']} T={row['tokens']}"
        lines += [f"{where} {key}: {text}" for key, text in errors.items()]
    lines += [f"ceiling {k}: {v}" for k, v in (doc["ceiling"].get("errors") or {}).items()]
    return lines


class MissingPlotter(ValueError):
    """matplotlib is not importable, so no plot can be drawn."""


def matplotlib_missing() -> str | None:
    """Why no plot can be drawn here, or None."""
    if importlib.util.find_spec("matplotlib") is None:
        return (
            "matplotlib is not installed here, so no plot (pip install matplotlib, or draw it "
            "later from the saved JSON: fqr bench --from-json FILE --plot FILE.png)"
        )
    return None


def _tokens_label(t: int) -> str:
    return f"{t // 1024}k" if t >= 1024 and t % 1024 == 0 else str(t)


PLOT_COLOURS = {FQR: "C0", "eager": "C1", "compile": "C2", "liger": "C3"}
PLOT_LINESTYLES = {"bf16": "-", "fp16": "--", "fp32": ":"}
PLOT_COLUMNS = 3
LATENCY_TICKS = (1, 2, 3, 5, 10, 20, 30, 50, 100, 200, 300, 500, 1000, 2000, 5000)


def _pct_of_ceiling(row: dict, impl: dict, doc: dict) -> float | None:
    """An implementation's achieved bandwidth as % of its own run's copy ceiling."""
    if impl.get("pct_ceiling") is not None:
        return impl["pct_ceiling"]
    gbps, ceiling = impl.get("gbps"), row.get("ceiling_gbps", doc["ceiling"]["gbps"])
    return 100 * gbps / ceiling if gbps and ceiling else None


def _label(text) -> str:
    """Text from the document as matplotlib draws it: control characters escaped, ``$`` shown
    as a dollar sign (not the start of mathtext, which would fail to parse)."""
    return printable(text).replace("$", r"\$")


def _latency_preset(presets: list[str]) -> str:
    """The preset whose small-T latency is drawn: Qwen3-8B when present (the running example
    of the docs), else the first."""
    return DEFAULT_PRESET if DEFAULT_PRESET in presets else presets[0]


def plot_document(doc: dict, path: Path) -> list[str]:
    """Draw ``doc`` to ``path`` (PNG, or the format its suffix names; written by
    :func:`fqr.files.write_file`: never through a symlink); return the panel titles, in order.

    One panel per preset: each implementation's bandwidth as % of the same-run copy ceiling
    (100% dashed) against tokens (log x), colour and marker per implementation, line style per
    dtype. Then one latency panel: the CUDA-graph replay time (µs, log y) of every implementation at
    small token counts (T <= :data:`GRAPH_MAX_TOKENS`) for one preset, where % of the ceiling
    says little (launch-bound). One legend for the figure; no panel without data.
    """
    reason = matplotlib_missing()
    if reason:
        raise MissingPlotter(reason)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    rows = sorted(doc["rows"], key=lambda r: r["tokens"])
    presets = list(dict.fromkeys(r["preset"] for r in doc["rows"]))
    if not presets:
        raise ValueError("--plot: the document has no rows to plot")
    dtypes = list(dict.fromkeys(r["dtype"] for r in doc["rows"]))
    impls = list(dict.fromkeys(n for r in rows for n in r["impls"]))

    def series(preset, dtype, name, value):
        return [
            (r["tokens"], v)
            for r in rows
            if r["preset"] == preset and r["dtype"] == dtype and name in r["impls"]
            for v in [value(r, r["impls"][name])]
            if v is not None
        ]

    def style(name, dtype):
        return dict(
            color=PLOT_COLOURS.get(name),
            marker=PLOT_MARKERS.get(name, "."),
            linestyle=PLOT_LINESTYLES.get(dtype, "-."),
            markersize=4,
            linewidth=1.3,
        )

    def token_axis(ax, tokens):
        ax.set_xscale("log", base=2)
        ax.set_xticks(tokens, [_tokens_label(t) for t in tokens], fontsize=7)
        ax.minorticks_off()
        ax.set_xlabel("tokens", fontsize=8)
        ax.tick_params(axis="y", labelsize=7)
        ax.grid(True, alpha=0.3)

    panels: list[tuple[str, list]] = []
    for preset in presets:
        lines = [
            (name, dtype, pts)
            for dtype in dtypes
            for name in impls
            if (pts := series(preset, dtype, name, lambda r, i: _pct_of_ceiling(r, i, doc)))
        ]
        if lines:
            panels.append((preset, lines))
    small = _latency_preset(presets)
    latency = [
        (name, dtype, pts)
        for dtype in dtypes
        for name in impls
        if (
            pts := [
                (t, us)
                for t, us in series(small, dtype, name, lambda r, i: i.get("graph_us"))
                if t <= GRAPH_MAX_TOKENS
            ]
        )
    ]
    count = len(panels) + bool(latency)
    cols = min(PLOT_COLUMNS, count)
    grid_rows = -(-count // cols)
    fig, axes = plt.subplots(grid_rows, cols, squeeze=False, figsize=(4.6 * cols, 3.3 * grid_rows))
    flat = [ax for row in axes for ax in row]
    for ax in flat[count:]:
        fig.delaxes(ax)
    titles = []
    for ax, (preset, lines) in zip(flat, panels):
        for name, dtype, pts in lines:
            ax.plot(*zip(*pts), **style(name, dtype))
        ax.axhline(100, color="black", linestyle="--", linewidth=0.9)
        token_axis(ax, sorted({t for _, _, pts in lines for t, _ in pts}))
        top = max(v for _, _, pts in lines for _, v in pts)
        ax.set_ylim(0, max(110, 1.05 * top))
        ax.set_ylabel("% of copy ceiling", fontsize=8)
        ax.set_title(_label(preset), fontsize=9)
        titles.append(preset)
    if latency:
        ax = flat[len(panels)]
        for name, dtype, pts in latency:
            ax.plot(*zip(*pts), **style(name, dtype))
        token_axis(ax, sorted({t for _, _, pts in latency for t, _ in pts}))
        ax.set_yscale("log")  # launch-bound kernels and eager chains differ tenfold
        values = [us for _, _, pts in latency for _, us in pts]
        ticks = [v for v in LATENCY_TICKS if min(values) / 1.6 <= v <= max(values) * 1.6]
        ax.set_yticks(ticks, [f"{v:g}" for v in ticks], fontsize=7)
        ax.minorticks_off()
        ax.set_ylabel("CUDA-graph replay µs (log)", fontsize=8)
        title = f"{small}: latency, T <= {GRAPH_MAX_TOKENS}"
        ax.set_title(_label(title), fontsize=9)
        titles.append(title)
    handles = [
        Line2D([], [], color=PLOT_COLOURS.get(n), marker=PLOT_MARKERS.get(n, "."), label=_label(n))
        for n in impls
    ]
    handles += [
        Line2D([], [], color="grey", linestyle=PLOT_LINESTYLES.get(d, "-."), label=_label(d))
        for d in dtypes
    ]
    handles.append(
        Line2D([], [], color="black", linestyle="--", linewidth=0.9, label="copy ceiling")
    )
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    gpu = doc["environment"].get("gpu", "?")
    fig.suptitle(
        f"fqr bench on {_label(gpu)}: bandwidth as % of the same-run copy ceiling", fontsize=10
    )
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    image = io.BytesIO()
    fig.savefig(image, format=Path(path).suffix[1:].lower() or "png", dpi=120)
    plt.close(fig)
    write_file(path, image.getvalue())
    return titles


def copy_probe_tables(doc: dict) -> list[ReportTable]:
    """``fqr bench --copy-probe``'s document (:mod:`fqr.bench.copy_probe`) as two tables: per
    size each method's µs and GB/s (bytes read + written), then the device activities the
    profiler saw for one eager ``copy_`` and one graph replay of it."""
    times, seen = [], []
    for row in doc["rows"]:
        labels = row["labels"]
        size = labels[0] + (f" (+{len(labels) - 1} same size)" if len(labels) > 1 else "")
        mb = f"{row['bytes'] / 1e6:.1f}"
        for method, us in row["us"].items():
            times.append([size, mb, method, f"{us:.1f}", f"{2 * row['bytes'] / us / 1e3:.0f}"])
        for method, text in row["errors"].items():
            times.append([size, mb, method, "error", printable(text)[:60]])
        for how, activities in row["activities"].items():
            for name, us in activities.items():
                seen.append([size, how, printable(name), f"{us:.1f}"])
    env = doc.get("environment", {})
    return [
        ReportTable(
            f"copy probe: {env.get('gpu', '?')}, one buffer pair per size",
            "MB: bytes copied each way; GB/s: bytes read + written over the time; eager: "
            "do_bench (CUDA events, L2 flushed); graph: CUDA-graph replays (copy_ is a memcpy "
            "node there); sm_copy: the bench's SM copy kernel (16-byte vectors)",
            [
                ("size", "left"),
                ("MB", "right"),
                ("method", "left"),
                ("us", "right"),
                ("GB/s", "right"),
            ],
            times,
        ),
        ReportTable(
            "copy probe: device activities of one copy_ (profiler)",
            "Memcpy DtoD: the driver's memcpy (copy engines or its own kernel); a kernel "
            "shows under its name",
            [("size", "left"), ("issued", "left"), ("activity", "left"), ("us", "right")],
            seen,
        ),
    ]
