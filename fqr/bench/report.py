"""Reading a result document: the results table, the lines for what failed or was not
measured, and the GB/s plot. Plain data out (the CLI renders it with Rich); a further table
(device vs wall time, dispatch) is one more function here that returns a :class:`ReportTable`.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from ..peers import PEER_NAMES
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
                    failed.upper() if failed == "wrong" else failed or _num(r[m.key], m.fmt)
                )
                cells += [_num(r["gbps"], ".0f"), _num(r["pct_ceiling"], ".1f")]
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
    return ReportTable(
        f"fqr bench: {env.get('gpu', '?')}, copy ceiling {ceiling['gbps']:.0f} GB/s",
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
                lines.append(
                    f"{where} is wrong ({r['check']['numerics']} contract): " + "; ".join(bad)
                )
    return lines


def timing_notes(doc: dict) -> list[str]:
    """One line per measurement that could not be taken (the kernel was right)."""
    return [
        f"{name} {row['preset']} {row['dtype']} T={row['tokens']} {key}: {text}"
        for row in doc["rows"]
        for name, r in row["impls"].items()
        for key, text in r.get("timing_errors", {}).items()
    ]


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


def plot_document(doc: dict, path: Path) -> None:
    """GB/s against tokens (log x), one line per implementation, one panel per (preset, dtype),
    the copy ceiling as a horizontal line."""
    reason = matplotlib_missing()
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
