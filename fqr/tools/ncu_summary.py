"""The counters that say why a kernel takes its time, read from Nsight Compute's text report.

``ncu`` (sections LaunchStats, Occupancy, SpeedOfLight, WarpStateStats) prints one block per
profiled launch; ``python -m fqr.tools.tuning_sweep run --launch-once`` prints which preset and
token count each kernel ran for (``P T=N: fqr_cuda_<key>``). This reads both from one log and
writes, per (preset, T): the launch (grid x block), registers a thread, theoretical and achieved
occupancy, DRAM throughput (% of peak), the warp cycles between two issued instructions and the
share of them stalled on an L1TEX scoreboard dependency (a global load not yet back: ncu's rule
"each warp ... spends X cycles being stalled waiting for a scoreboard dependency on a L1TEX",
divided by "Warp Cycles Per Issued Instruction"), and the duration under the profiler.

``python -m fqr.tools.ncu_summary LOG [LOG ...] [--json OUT]``: a Markdown table per log on
stdout (the table of docs/PERFORMANCE.md's counters), all rows as JSON in ``OUT``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# ``P T=N: kernel`` lines of ``tuning_sweep run --launch-once``
LAUNCHED = re.compile(r"^(\S+) T=(\d+): (\S+)\s*$", re.M)
# a profiled launch's header: ``  fqr_cuda_x (65536, 1, 1)x(32, 1, 1), Context 1, ...``
HEADER = re.compile(r"^\s{2}(\S+) \((\d+), (\d+), (\d+)\)x\((\d+), (\d+), (\d+)\), Context", re.M)
METRICS = {
    "registers": "Registers Per Thread",
    "theoretical_occupancy": "Theoretical Occupancy",
    "achieved_occupancy": "Achieved Occupancy",
    "dram_percent": "DRAM Throughput",
    "issue_cycles": "Warp Cycles Per Issued Instruction",
    "duration": "Duration",
}
L1TEX = re.compile(
    r"spends ([\d.,]+) cycles being stalled waiting for a scoreboard dependency on a L1TEX"
)


def _metric(block: str, name: str) -> tuple[float, str] | None:
    m = re.search(rf"^\s+{re.escape(name)}\s+(\S+(?:/\S+)?)?\s+([\d.,]+)\s*$", block, re.M)
    if m is None:
        return None
    return float(m.group(2).replace(",", "")), m.group(1) or ""


def parse(text: str) -> list[dict[str, Any]]:
    """One row per profiled launch (the last one of each kernel name), named by the preset and
    T it was launched for where the log says so."""
    names = {k: (p, int(t)) for p, t, k in LAUNCHED.findall(text)}
    heads = list(HEADER.finditer(text))
    rows: dict[str, dict[str, Any]] = {}
    for i, h in enumerate(heads):
        block = text[h.start() : heads[i + 1].start() if i + 1 < len(heads) else len(text)]
        kernel = h.group(1)
        row: dict[str, Any] = {
            "kernel": kernel,
            "grid": [int(h.group(j)) for j in (2, 3, 4)],
            "block": [int(h.group(j)) for j in (5, 6, 7)],
        }
        if kernel in names:
            row["preset"], row["T"] = names[kernel]
        for key, metric in METRICS.items():
            found = _metric(block, metric)
            if found is not None:
                value, unit = found
                row[key] = value / 1000 if key == "duration" and unit == "ns" else value
        flat = " ".join(block.split())
        stall = L1TEX.search(flat)
        if stall and row.get("issue_cycles"):
            cycles = float(stall.group(1).replace(",", ""))
            row["l1tex_stall_cycles"] = cycles
            row["l1tex_stall_share"] = cycles / row["issue_cycles"]
        rows[kernel] = row
    return list(rows.values())


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    head = (
        "| preset | T | grid x block | regs/thread | theoretical / achieved occupancy | "
        "DRAM % of peak | L1TEX stall share | duration (us, ncu) |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- |"
    )
    lines = [head]
    for r in sorted(rows, key=lambda r: (r.get("preset", r["kernel"]), r.get("T", 0))):
        grid = " x ".join(str(g) for g in r["grid"] if g > 1) or "1"
        block = r["block"][0] * r["block"][1] * r["block"][2]

        def pct(key: str, r: dict = r) -> str:
            return f"{r[key]:.0f}%" if key in r else "-"

        stall = f"{r['l1tex_stall_share']:.0%}" if "l1tex_stall_share" in r else "-"
        regs = f"{r['registers']:.0f}" if "registers" in r else "-"
        us = f"{r['duration']:.2f}" if "duration" in r else "-"
        lines.append(
            f"| {r.get('preset', r['kernel'])} | {r.get('T', '-')} | {grid} x {block} | {regs} | "
            f"{pct('theoretical_occupancy')} / {pct('achieved_occupancy')} | "
            f"{pct('dram_percent')} | {stall} | {us} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fqr.tools.ncu_summary", description=__doc__)
    parser.add_argument("logs", nargs="+", help="ncu text reports")
    parser.add_argument("--json", help="write every row (with its log's name) here")
    args = parser.parse_args(argv)
    every = []
    for log in args.logs:
        try:
            text = Path(log).read_text(errors="replace")
        except OSError as e:
            print(f"error: {log}: {e.strerror}", file=sys.stderr)
            return 2
        rows = parse(text)
        print(f"{log}:\n\n{markdown(rows)}\n")
        every += [{"log": Path(log).name, **r} for r in rows]
    if args.json:
        Path(args.json).write_text(json.dumps(every, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
