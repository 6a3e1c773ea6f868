"""``fqr verify``: run backends on the golden cases and check them against the numerics contract.

For every case (``--case`` glob) and backend (``--backend``, default every available one), the
case's inputs go to the backend's device (CPU for reference / interpret / ascend-interpret, CUDA
for triton / ascend-on-cuda, NPU for ascend), :func:`fqr.split_qkv_rmsnorm_rope` runs, and q, k
are compared with the float64 expectations (:func:`fqr.numerics.compare`, per the case's
numerics), v bit for bit. Each row shows the worst ULP count and ``err/tol``, the worst
element's error as a fraction of what its tolerance allows (<= 1 passes): an unfused case's ULP
count far inside its bound reads as what it is.
Without ``--backend``, every backend unavailable here gets one line on stderr, ``skipped NAME:
REASON`` (the reason names the install command where one is the remedy).
Status per row: ``pass``, ``FAIL`` (outside tolerance, or NaN/Inf), ``error`` (the backend
raised), ``corrupt`` (the golden file's sha256 does not match the manifest). Exit 0 when every
row passes, 1 otherwise, 2 on bad usage.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from fqr.backends import BACKENDS, available_backends
from fqr.golden import GOLDEN_DIR, GoldenCorrupt, list_cases, load_case
from fqr.text import printable

from .common import EXIT_FAILED, UsageError, app, err, example, out, parse_csv, schema
from .options import CaseOption, JsonOption, comma_list
from .render import plain, print_table, progress_bar

STATUS_STYLE = {"pass": "green", "FAIL": "red", "error": "red", "corrupt": "magenta"}


def choose_backends(spec: str | None) -> list[str]:
    """Backends named in ``--backend`` (all must exist and be available), or every available."""
    if spec is None:
        return available_backends()
    names = parse_csv(spec, "backend")
    for name in names:
        if name not in BACKENDS:
            raise UsageError(
                f"--backend: unknown backend {name!r}; choose from {', '.join(BACKENDS)}"
            )
        reason = BACKENDS[name].unavailable_reason()
        if reason:
            raise UsageError(f"--backend: {name} is unavailable here: {reason}")
    return list(dict.fromkeys(names))


def skipped_backends() -> dict[str, str]:
    """The backends a plain ``fqr verify`` leaves out here, each with why (the reason says what
    to install where installing is the remedy)."""
    return {name: reason for name, b in BACKENDS.items() if (reason := b.unavailable_reason())}


def verify_one(case, backend: str) -> dict:
    """Run ``backend`` on a loaded case: a result row (status, errors, per-output details)."""
    row = {"case": case.name, "backend": backend}
    try:
        outputs = case.to(BACKENDS[backend].home_device).run(backend)
        checks = case.check(*outputs)
    except Exception as e:  # a backend that raises fails the check; the row says why
        return row | {
            "status": "error",
            "max_ulp": None,
            "max_abs": None,
            "error_ratio": None,
            "detail": f"{type(e).__name__}: {e}",
        }
    ulps = [c.max_ulp for c in checks.values() if c.max_ulp is not None]
    ratios = [c.error_ratio for c in checks.values() if c.error_ratio is not None]
    passed = all(c.passed for c in checks.values())
    return row | {
        "status": "pass" if passed else "FAIL",
        "max_ulp": max(ulps) if ulps else None,
        "max_abs": max(c.max_abs for c in checks.values()),
        "error_ratio": max(ratios) if ratios else None,
        "outputs": {name: c.to_dict() for name, c in checks.items()},
    }


def _table(rows: list[dict]) -> Table:
    table = Table(title="fqr verify")
    for col in ("case", "backend", "max ULP", "err/tol", "max abs err", "status"):
        table.add_column(
            col,
            justify="left" if col in ("case", "backend", "status") else "right",
            no_wrap=col == "case",
        )
    for r in rows:
        style = STATUS_STYLE[r["status"]]
        table.add_row(
            plain(r["case"]),
            plain(r["backend"]),
            "-" if r["max_ulp"] is None else str(r["max_ulp"]),
            "-" if r["error_ratio"] is None else f"{r['error_ratio']:.2g}",
            "-" if r["max_abs"] is None else f"{r['max_abs']:.3g}",
            f"[{style}]{r['status']}[/{style}]",
        )
    return table


@app.command(
    epilog=example(
        "fqr verify --backend reference,interpret --case 'qwen3-8b*'",
    )
)
def verify(
    backend: Annotated[
        str | None,
        comma_list(
            help=f"comma list of {', '.join(BACKENDS)} (default: every available one)",
            choices=lambda: BACKENDS,
        ),
    ] = None,
    case: CaseOption = "*",
    golden_dir: Annotated[Path, typer.Option(help="golden directory")] = GOLDEN_DIR,
    json_out: JsonOption = False,
):
    """Check backends against the golden files (exit 0 all pass, 1 a mismatch, 2 bad usage)."""
    backends = choose_backends(backend)
    entries = list_cases(golden_dir, case)
    if not entries:
        raise UsageError(f"--case: no golden case matches {case!r} in {golden_dir}")

    rows: list[dict] = []
    with progress_bar() as progress:
        task = progress.add_task("verifying", total=len(entries) * len(backends))
        for entry in entries:
            try:
                loaded = load_case(entry, golden_dir)
            except GoldenCorrupt as e:
                rows += [
                    {
                        "case": entry["name"],
                        "backend": b,
                        "status": "corrupt",
                        "max_ulp": None,
                        "max_abs": None,
                        "error_ratio": None,
                        "detail": str(e),
                    }
                    for b in backends
                ]
                progress.advance(task, len(backends))
                continue
            for name in backends:
                label = printable(f"{entry['name']} [{name}]")
                progress.update(task, description=escape(label))
                rows.append(verify_one(loaded, name))
                progress.advance(task)

    counts = {s: sum(r["status"] == s for r in rows) for s in STATUS_STYLE}
    ok = counts["pass"] == len(rows)
    if json_out:
        out.print_json(
            json.dumps(
                {
                    "schema": schema("verify"),
                    "ok": ok,
                    "golden_dir": str(golden_dir),
                    "backends": backends,
                    "counts": counts,
                    "results": rows,
                }
            )
        )
    else:
        print_table(_table(rows))
    for r in rows:
        if "detail" in r:
            err.print(
                plain(f"{r['case']} [{r['backend']}]: {r['status']}: {r['detail']}"),
                highlight=False,
            )
    if backend is None:  # the default: every available backend; say which were not and why
        for name, reason in skipped_backends().items():
            err.print(plain(f"skipped {name}: {reason}"), highlight=False)
    summary = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    err.print(
        f"{len(entries)} cases x {len(backends)} backends ({', '.join(backends)}): {summary}",
        highlight=False,
        markup=False,
    )
    if not ok:
        raise typer.Exit(EXIT_FAILED)
