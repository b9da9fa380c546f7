#!/bin/bash
set -euo pipefail
python3 - <<'PY'
import csv
from decimal import Decimal

totals: dict[str, Decimal] = {}
with open("/app/sales.csv", newline="") as f:
    for row in csv.DictReader(f):
        totals[row["region"]] = totals.get(row["region"], Decimal(0)) + Decimal(row["quantity"]) * Decimal(
            row["unit_price"])
with open("/app/totals.csv", "w") as f:
    f.write("region,revenue\n")
    for region in sorted(totals):
        f.write(f"{region},{totals[region]:.2f}\n")
PY
