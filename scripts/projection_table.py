"""Print ``fqr bench --projection --json`` output as a plain table, one line per cell
(``python3 scripts/projection_table.py projection.json``; columns: fqr.bench.projection.table)."""

import json
import sys

from fqr.bench.projection import table

doc = json.load(open(sys.argv[1]))
columns, cells = table(doc["rows"])
print(" | ".join(columns))
for row in cells:
    print(" | ".join(row))
print(f"all checks passed: {doc['ok']}")
