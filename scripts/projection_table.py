"""Print ``fqr bench --projection --json`` output as a plain table (one line per cell)."""

import json
import sys

doc = json.load(open(sys.argv[1]))
rows = doc["rows"]
names = list(rows[0]["fused_us"]) if rows else []


def cell(v):
    return "-" if v is None else f"{v:.2f}"


print(
    "preset TP T | GEMM GEMM+op | "
    + " ".join(f"fused[{n}]" for n in names)
    + " | best/pair weights-copy | max ULP per schedule"
)
for r in rows:
    ulps = ",".join(
        f"{n}:{c['max_ulp']}{'' if c['passed'] else '!'}" for n, c in r["checks"].items()
    )
    print(
        f"{r['preset']} {r['tp']} {r['tokens']} | {cell(r['gemm_us'])} {cell(r['pair_us'])} | "
        + " ".join(cell(v) for v in r["fused_us"].values())
        + f" | {cell(r['fused_over_pair'])} {cell(r['weights_us'])} | {ulps}"
    )
print(f"all checks passed: {doc['ok']}")
